"""The command line: bad input gives one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from tests.conftest import build_tiny_hf
from tests.gguf_factory import write_gguf


@pytest.fixture()
def tiny(tiny_model_dir, tmp_path) -> Path:
    folder, _ = tiny_model_dir("llama", True)
    copy = tmp_path / "tiny"
    shutil.copytree(folder, copy)
    return copy


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("infersight: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


def test_generate_json_on_a_tiny_model(capsys, tiny):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1 t2 t3",
                           "--max-new-tokens", "5", "--json")  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"prompt_ids", "token_ids", "text", "finish_reason", "ttft_s", "tpot_s"}
    assert result["prompt_ids"] == [1, 2, 3]
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"


def test_missing_model_folder(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_clean_error(code, err, "does not exist")


def test_unsupported_architecture_in_config(capsys, tiny):
    config = json.loads((tiny / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tiny / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1")
    assert_clean_error(code, err, "'gpt_neox' is not supported", "llama")


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_truncated_or_corrupt_safetensors(capsys, tiny, damage):
    weights = tiny / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"\xff" * 16 + data[16:])
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1")
    assert_clean_error(code, err, "model.safetensors is truncated or corrupt")


def test_missing_tensor_is_named(capsys, tiny):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tiny / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), "--prompt", "t1")
    assert_clean_error(code, err, "layers.1.mlp.gate_up_proj.weight")


@pytest.mark.parametrize(
    ("arch", "override", "needle"),
    [("gpt2", None, "'gpt2' model"), ("llama", "IQ4_XS", "tensor type(s) IQ4_XS")],
)
def test_import_gguf_refuses_unsupported_files(capsys, tmp_path, arch, override, needle):
    hf = build_tiny_hf("llama", tied=True, hidden_size=64, intermediate_size=128)
    src = write_gguf(hf, tmp_path / "m.gguf", arch=arch, tensor_type_override=override)
    code, _, err = run_cli(capsys, "import-gguf", str(src), str(tmp_path / "out"))
    assert_clean_error(code, err, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "t1 " * 300], "context is 256"),
        (["--prompt", "t1", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "t1", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "t1", "--top-p", "1.01"], "top_p must be in (0, 1]"),
        (["--prompt", "t1", "--top-k", "-3"], "top_k must be >= 0"),
        (["--prompt", "t1", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
        (["--prompt", "t1", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["--chat", "hello"], "no chat template"),
    ],
)
def test_bad_requests(capsys, tiny, args, needle):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny), *args)
    assert_clean_error(code, err, needle)


def test_tokenize_reads_lines_from_stdin(capsys, monkeypatch, tiny):
    monkeypatch.setattr(
        sys, "stdin", io.TextIOWrapper(io.BytesIO(b"t5 t6\nt7\n"), encoding="utf-8")
    )
    import app.cli

    monkeypatch.setattr(app.cli, "_stdin_text", lambda: sys.stdin)
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(tiny))
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == [[5, 6], [7]]


def test_real_process_prints_no_traceback(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "generate",
            "--model",
            str(tmp_path / "x"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("infersight: error: ")
    assert "Traceback" not in done.stderr


def test_help_is_fast_and_imports_no_torch():
    code = (
        "import sys; from app.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_bench_single_and_mixed_workloads_report_json(capsys, tiny):
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--new-tokens", "8",
                           "--repeats", "1", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    (result,) = report["results"]
    assert result["engine"] == "infersight" and result["decode_tok_s"] > 0

    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed",
                           "--requests", "6", "--max-batch-size", "1", "3", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    rows = {r["max_batch_size"]: r for r in report["results"]}
    assert set(rows) == {1, 3}
    for row in rows.values():
        assert row["prompt_tokens"] == rows[1]["prompt_tokens"]  # the same seeded workload
        assert 0 <= row["mean_kv_waste"] < 1 and 0 < row["peak_kv_usage"] <= 1
    assert set(report["speedup_vs_batch1"]) == {"1", "3"} or set(report["speedup_vs_batch1"]) == {
        1,
        3,
    }


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-batch-size", "0"], "--max-batch-size values must be at least 1"),
        (["--requests", "0"], "--requests must be at least 1"),
        (["--max-tokens-per-step", "0"], "max_tokens_per_step must be >= 1"),
        (["--kv-memory", "-5"], "kv_memory must be > 0"),
        (["--cache-window", "0"], "--cache-window must be >= 1"),
    ],
)
def test_bench_rejects_bad_limits(capsys, tiny, args, needle):
    code, _, err = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed", *args)
    assert_clean_error(code, err, needle)


def test_bench_compare_hf_on_a_tiny_model(capsys, tiny):
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--new-tokens", "6",
                           "--repeats", "1", "--compare-hf", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert [r["engine"] for r in report["results"]] == ["infersight", "transformers"]
    assert report["ratio_decode"] > 0
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny), "--workload", "mixed",
                           "--requests", "4", "--max-batch-size", "2", "--compare-hf",
                           "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    hf_row = next(r for r in report["results"] if r["engine"] == "transformers")
    assert hf_row["output_tokens"] == report["results"][0]["output_tokens"]
    assert set(report["ratio_vs_transformers"]) in ({"2"}, {2})
