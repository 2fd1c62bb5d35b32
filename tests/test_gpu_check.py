"""``make gpu-check``'s dry run: ``checks/gpu/`` on the CPU with tiny shapes, the same
code that a lent GPU runs, so that the script cannot rot before one is lent. Every check passes
(or is skipped where this CPU's probes refuse the precision), the JSON on stdout is the one in
the file, and it holds every figure the GPU run reports; the tie rule for greedy ids on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from checks.gpu import common as gpu_check
from checks.gpu import graphs
from engine.errors import InvalidRequestError
from engine.executor import inductor, table
from engine.loader.random_weights import SyntheticCheckpoint
from engine.loader.synthetic import build_engine
from engine.model.config import ModelConfig
from engine.quant.spec import parse_precision_spec

ROOT = Path(__file__).resolve().parent.parent
#: what each precision that runs reports (on a GPU also its peaks against the plan's)
FIGURES = {"weights_bytes", "plan", "load_s", "read_bytes", "decode_tok_s", "tpot_ms",
           "prefill_tok_s", "ttft_ms", "batch_decode_tok_s", "bandwidth_fraction"}  # fmt: skip


def runs_on_cpu(precision: str) -> bool:
    """What this CPU's probes allow (INT4 needs its kernel)."""
    try:
        parse_precision_spec(precision, "cpu")
    except InvalidRequestError:
        return False
    return True


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    run = subprocess.run(
        [sys.executable, "-m", "checks.gpu", "--dry-run", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(out.read_text()), run.stdout


def test_the_dry_run_passes_every_check_and_prints_the_json_it_writes(dry_run):
    data, stdout = dry_run
    assert json.loads(stdout.strip().splitlines()[-1]) == data
    summary = data["gpu_check"]
    assert summary["dry_run"] and summary["finished"] and summary["passed"]
    assert not summary["over_budget"] and summary["budget_s"] == gpu_check.BUDGET_S
    assert summary["running"] is None and summary["mode"] == "full"
    names = [c["name"] for c in data["checks"]]
    first, *rest = (f"precision {p}" for p in gpu_check.PRECISIONS)
    # in the order of what they tell: the kernels, the 12 GB card's precision, the graphs
    assert names == ["bandwidth", "triton kernels", first, "triton and graphs",
                     "compiled decode", "transformers fp16", "out of memory", *rest,
                     "experts and Gemma 3", "app worker", "kernels at 0 rows",
                     "tensor parallel"]  # fmt: skip
    precisions = [first, *rest]
    for check in data["checks"]:
        refused = check["name"] in precisions and not runs_on_cpu(check["name"][10:])
        assert check["status"] == ("skipped" if refused else "passed"), check
        assert check["why"].startswith("not native") if refused else check["why"] == ""
    assert "gpu-check took" in stdout  # the table, printed before the JSON


def test_the_dry_run_reports_every_figure(dry_run):
    data, _ = dry_run
    assert {"device", "torch", "transformers", "allocator", "cuda_runtime_bytes"} <= set(
        data["environment"]
    )
    assert data["shapes"]["batch"] == gpu_check.DRY.batch
    checks = {c["name"]: c["figures"] for c in data["checks"]}
    assert checks["bandwidth"]["read_bytes_per_s"] > 0
    ran = [p for p in gpu_check.PRECISIONS if runs_on_cpu(p)]
    assert "int8" in ran and "fp32" in ran
    for precision in ran:
        f = checks[f"precision {precision}"]
        assert set(f) >= FIGURES
        assert f["plan"]["fits"] and f["plan"]["peak_bytes"] >= f["plan"]["weights_bytes"] > 0
        assert abs(f["plan"]["weights_bytes"] - f["weights_bytes"]) <= 0.01 * f["weights_bytes"]
        assert 0 < f["read_bytes"] <= f["weights_bytes"]
        assert f["decode_tok_s"] > 0 and f["batch_decode_tok_s"] > 0 and f["prefill_tok_s"] > 0
        assert "peak_bytes" not in f  # a CPU has no allocator peak to hold the plan to
        assert f["ran"]["kernels"] and f["ran"]["decode_step"].startswith("decode step")
        assert f["ran"]["quantized_off_triton"] == sum(f["ran"]["quantized_layers"].values())
    families = checks["experts and Gemma 3"]  # the grouped GEMM; Gemma 3 on our attention
    assert families["moe"]["grouped"]["experts"] == ["grouped Triton GEMM"]
    assert families["moe"]["grouped_vs_modules"]["agree"]
    # experts in host memory (the dry run's CPU marks them so): the same tokens
    assert families["moe"]["host"]["experts"] == ["grouped Triton GEMM (in host memory)"]
    assert families["moe"]["host_vs_grouped"]["agree"]
    assert families["gemma3"]["triton"]["attention"]["backend"] == "triton"
    assert families["gemma3"]["triton_vs_torch"]["agree"]
    kernels = checks["triton kernels"]  # every load-time check, in the interpreter
    assert kernels["load_checks"] and set(kernels["load_checks"].values()) == {"passed"}
    assert {"attention float16 d128", "attention float16 d64", "GEMMs float16"} <= set(
        kernels["load_checks"]
    )
    assert all(kernels[f"int8_error_{m}_rows"] <= 1e-2 for m in (1, 5, 16, 80))

    hf = checks["transformers fp16"]
    assert hf["layers"] == gpu_check.DRY.raw["num_hidden_layers"]
    assert hf["greedy"]["agree"] and hf["greedy"]["compared"] > 0
    assert hf["ours"]["decode_tok_s"] > 0 and hf["transformers"]["decode_tok_s"] > 0

    oom = checks["out of memory"]
    assert oom["pressure"] == "injected (CPU)"
    assert (oom["out_of_memory_steps"], oom["chunks_lowered"], oom["requests_failed"]) == (1, 1, 0)
    assert (oom["first"], oom["next"], oom["kv_blocks_in_use"]) == ("'length'", "'length'", 0)
    before, after = oom["prefill_chunk"]
    assert before == 512 and after < gpu_check.DRY.prompt_tokens

    compiled = checks["compiled decode"]  # the dry run compiles nothing (minutes on a CPU)
    assert compiled["ran"]["decode_step"] == "decode step eager: off as asked"
    assert compiled["under_triton_attention"] == "decode step eager: off as asked"
    assert compiled["greedy"] == {"compared": gpu_check.DRY.compare_tokens,
                                  "same": gpu_check.DRY.compare_tokens, "agree": True}  # fmt: skip
    assert checks["app worker"]["finish"] in (["length"], ["stop"])
    ours = checks["triton and graphs"]  # our kernels in the interpreter, the static steps
    assert ours["small"]["graphs"]["ran"]["cuda_graphs"].startswith("static steps")
    assert "interpreted" in ours["small"]["eager"]["ran"]["kernels"]
    assert ours["graphs_vs_eager"]["agree"] and ours["ours_vs_torch"]["agree"]
    assert set(ours["targets"]) == {"graphs ≥ 1.5× eager"}
    layers = ["int8"] + (["int4-g32"] if runs_on_cpu("int4-g32") else [])
    assert sorted(k.split(" (")[0] for k in checks["kernels at 0 rows"]) == sorted(layers)
    tp = checks["tensor parallel"]  # two ranks over gloo, the code a two-GPU machine runs
    assert (
        tp["greedy"]["agree"] and tp["max_logit_diff"] < 1e-3 and "2 ranks (gloo)" in tp["kernels"]
    )
    assert "rank 1 died" in tp["killed_rank"]["error"] and tp["killed_rank"]["named_after_s"] < 30


def test_greedy_ids_that_part_at_a_tie_agree_and_elsewhere_do_not():
    lp = torch.log_softmax(torch.tensor([0.0, 1.0, 1.02, -1.0]), dim=-1)
    asked: list[list[int]] = []

    def logprobs(output: list[int]) -> torch.Tensor:
        asked.append(output)
        return lp

    assert gpu_check.parting([3, 1, 0], [3, 1, 0], logprobs) == {
        "compared": 3, "same": 3, "agree": True,
    }  # fmt: skip
    assert asked == []  # nothing to judge where they never part
    tie = gpu_check.parting([3, 2, 0], [3, 1, 1, 1], logprobs)
    assert (tie["same"], tie["compared"], tie["agree"]) == (1, 3, True)
    assert tie["gap"] == pytest.approx(0.02, abs=1e-5) and asked == [[3]]
    far = gpu_check.parting([3, 3], [3, 2], logprobs)
    assert (far["same"], far["agree"]) == (1, False)  # 2.02 nats apart: a fault, not rounding


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model_type": "qwen2", "tie_word_embeddings": True},
        {"model_type": "qwen3", "head_dim": 48},
    ],
    ids=["llama", "qwen2-tied-biases", "qwen3-qk-norms"],
)
def test_a_synthetic_checkpoint_is_the_same_every_draw_and_loads_as_the_config_says(overrides):
    raw = gpu_check.tiny() | overrides
    cfg = ModelConfig.from_dict(raw)
    checkpoint = SyntheticCheckpoint(cfg, seed=3)
    names = checkpoint.keys()
    per_layer = 9 + 3 * cfg.attention_bias + 2 * cfg.qk_norm
    assert len(names) == 2 + per_layer * cfg.num_layers + (not cfg.tie_word_embeddings)
    for name in (names[0], names[-1]):
        assert torch.equal(checkpoint.get_tensor(name), checkpoint.get_tensor(name))
    assert not torch.equal(checkpoint.draw(names[0]), SyntheticCheckpoint(cfg).draw(names[0]))
    engine = build_engine(raw, "fp32")
    assert engine.num_parameters == sum(torch.Size(s).numel() for s in checkpoint.shapes.values())
    ids = gpu_check.greedy(engine, [5, 6, 7, 8], 4)
    assert len(ids) == 4 or ids[-1] in cfg.eos_token_ids


def test_compiled_decode_is_asked_of_the_engine_where_our_attention_runs(monkeypatch):
    """With our Triton attention (the GPU's default) the engine never compiles its step; the
    check builds the compiled side on torch's attention and asks ``inductor.choose`` what
    the Triton side gets. TorchInductor's own work is not what is tested here: the compile is
    the identity, so the check's logic runs in seconds on the CPU."""
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")  # as a GPU's default: ours attend
    monkeypatch.setattr(inductor, "compiler_problem", lambda _device: "")
    monkeypatch.setattr(inductor, "compile_forward", lambda forward: forward)
    figures: dict[str, Any] = {}
    scale = replace(gpu_check.DRY, raw=gpu_check.wide_tiny())  # heads our kernels take
    graphs.check_compiled(scale, torch.device("cpu"), True, figures, mode="on")
    assert figures["ran"]["decode_step"].startswith("decode step compiled")
    assert not figures["ran"]["triton_attention"]
    refused = table.refusal("compiled", "triton")
    assert figures["under_triton_attention"] == f"decode step eager: eager: {refused}"
    assert figures["greedy"]["agree"]


@pytest.mark.parametrize("tie", [True, False])
def test_graph_replays_are_held_to_the_tie_rule_not_to_equal_ids(monkeypatch, tie):
    """A graph replay splits decode attention where the eager step runs one pass, so fp16
    rounds the two apart: ids that part where the two tokens are within the tie rule agree,
    elsewhere the check fails. The graphs' side is made to take the runner-up token at its
    third step; the tie rule's width decides which of the two that is."""
    real = graphs.greedy

    def greedy(engine: Any, prompt: list[int], tokens: int) -> list[int]:
        ids = real(engine, prompt, tokens)
        if engine.graphs.why.startswith("static"):  # the CUDA graphs' side
            runner_up = gpu_check.our_logprobs(engine, prompt, ids[:2]).topk(2).indices[1]
            ids = [*ids[:2], int(runner_up)]
        return ids

    monkeypatch.setattr(graphs, "greedy", greedy)
    monkeypatch.setattr(gpu_check, "TIE_FRACTION", 1e9 if tie else 0.0)
    figures: dict[str, Any] = {}
    # few interpreted steps: the comparison is what is tested, not the speeds
    scale = replace(gpu_check.DRY, short_prompt=8, decode_tokens=2, repeats=1, compare_tokens=4)
    if tie:
        graphs.check_triton(scale, torch.device("cpu"), True, True, figures)
    else:
        with pytest.raises(AssertionError, match="graph replays changed greedy ids, not at a tie"):
            graphs.check_triton(scale, torch.device("cpu"), True, True, figures)
    part = figures.get("graphs_vs_eager") or {}
    assert (part["compared"], part["same"], part["agree"]) == (3, 2, tie)
