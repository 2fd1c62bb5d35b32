"""The memory plan against what a load then reports, and loads the plan refuses.

The plan reads ``config.json`` only; a load reports its weights (``weights_bytes``, by kind in
``weight_groups``) and its KV pool (``kv.nbytes``). They must agree within 1% for the default
model at every precision and for tiny random models of each family.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.loading import LoadSpec, load_engine
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError, OutOfMemoryError
from engine.loader import load as loader
from engine.loader import memory_plan
from engine.loader.load import load_model
from engine.loader.memory_plan import parse_bytes, plan_for_folder, plan_memory
from engine.model.config import ModelConfig
from tests.probed import precisions

PRECISIONS = precisions(
    "fp32", "bf16", "int8", "int8+head", "int4-g32", "int4-g32+head", "int4-g128"
)
CONFIGS = Path(__file__).parent.parent / "resources" / "configs"


def assert_plan_matches(engine: LLMEngine, folder: Path, precision: str, config: EngineConfig):
    plan = plan_for_folder(folder, precision, "cpu", config=config)
    assert plan.weight_bytes == pytest.approx(engine.weights_bytes, rel=0.01)
    assert plan.kv_pool_bytes == pytest.approx(engine.kv.nbytes, rel=0.01)
    by_kind: dict[str, int] = {}
    for group in engine.weight_groups:
        by_kind[group.kind] = by_kind.get(group.kind, 0) + group.nbytes
    planned = {k: v for k, v in plan.weights.items() if v}
    assert planned.keys() == {k for k, v in by_kind.items() if v}
    for kind, nbytes in planned.items():
        assert nbytes == pytest.approx(by_kind[kind], rel=0.01), kind


@pytest.mark.real_model
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_plan_of_the_default_model_is_what_its_load_reports(default_model, precision):
    config = EngineConfig(kv_memory=64 * 2**20)
    engine = load_model(default_model, precision=precision, config=config)
    assert_plan_matches(engine, default_model, precision, config)


@pytest.mark.parametrize("precision", precisions("fp32", "int8", "int4-g32+head"))
@pytest.mark.parametrize(
    ("arch", "tied"),
    [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False)],
)
def test_the_plan_of_tiny_models_is_what_their_load_reports(tiny_model_dir, arch, tied, precision):
    folder, _ = tiny_model_dir(arch, tied)
    config = EngineConfig(num_blocks=7, block_size=4)
    engine = load_model(folder, precision=precision, config=config)
    assert_plan_matches(engine, folder, precision, config)


def test_a_plan_for_a_12_gib_gpu_is_made_without_one():
    """Llama-3.1-8B's shapes on 12 GiB: fp16 cannot fit (its weights alone are 15 GiB);
    INT4 fits with room for a long context; every figure is consistent."""
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-8b.json")
    fp16 = plan_memory(cfg, "fp16", "cuda", memory=12 * 2**30)
    assert not fp16.fits and fp16.weight_bytes > 12 * 2**30
    why = fp16.refusal()
    assert why is not None and "12.00 GiB" in why and "try int8" in why
    int4 = plan_memory(cfg, "int4-g32+head", "cuda", memory=12 * 2**30)
    assert int4.fits and int4.refusal() is None
    assert int4.peak_bytes <= int4.budget_bytes
    assert int4.max_context * int4.kv_bytes_per_token <= int4.kv_room_bytes
    assert int4.max_batch(2048) == int4.kv_room_bytes // (2048 * int4.kv_bytes_per_token)
    # 2 (K, V) × 32 layers × 8 KV heads × 128 dims × 2 bytes (bf16)
    assert int4.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_a_load_that_cannot_fit_is_refused_before_it_starts(tiny_model_dir, monkeypatch):
    folder, _ = tiny_model_dir("llama", True)
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 2**20)
    started = []
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: started.append(a))
    with pytest.raises(OutOfMemoryError, match=r"does not fit on cpu: it needs .* (GiB|MiB)"):
        load_engine(LoadSpec(str(folder), "fp32", "cpu", kv_memory_mib=1))
    assert not started


def test_the_plan_suggests_what_would_fit():
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.2-3b.json")
    pool = EngineConfig(kv_memory=256 * 2**20)
    fp16 = plan_memory(cfg, "fp16", "cuda", memory=64 * 2**30, config=pool)
    budget = fp16.peak_bytes - 2**30  # fp16 misses by a GiB; INT8 and INT4 need far less
    short = plan_memory(cfg, "fp16", "cuda", memory=budget, config=pool)
    assert not short.fits
    assert short.suggestion.startswith("try int8: it fits")  # the best quality that fits
    why = short.refusal()
    assert why is not None and "does not fit on cuda" in why and "try int8" in why
    nothing = plan_memory(cfg, "fp16", "cuda", memory=2**30, config=pool)
    assert "no precision fits" in nothing.suggestion


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12GiB", 12 * 2**30), ("12 GB", 12 * 2**30), ("800MiB", 800 * 2**20), ("1.5T", 1.5 * 2**40),
     ("4096", 4096)],
)  # fmt: skip
def test_memory_sizes_parse(text, expected):
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize("text", ["twelve", "-1G", "12 parsecs", "", "12ib", "5bb", "0.5"])
def test_a_bad_memory_size_says_how_to_write_one(text):
    with pytest.raises(InvalidRequestError, match="12GiB"):
        parse_bytes(text)


def test_infersight_plan_prints_json_and_says_when_nothing_fits(capsys):
    from app.cli.main import main

    shapes = str(CONFIGS / "llama-3.1-8b.json")
    args = ["plan", "--model", shapes, "--device", "cuda", "--memory", "12GiB", "--json"]
    assert main(args) == 0
    plans = json.loads(capsys.readouterr().out)
    fits = {p["precision"]: p["fits"] for p in plans}
    assert fits["fp16"] is False and fits["int4-g32+head"] is True
    assert all(p["budget_bytes"] == 12 * 2**30 for p in plans)
    assert main(["plan", "--model", shapes, "--device", "cuda", "--memory", "4GiB"]) == 3
    assert "does not fit" in capsys.readouterr().out


def test_a_gguf_that_cannot_fit_is_refused_before_it_is_imported(
    user_home: Path, tmp_path: Path, monkeypatch
):
    from engine.store.model_store import models_dir
    from tests.conftest import build_tiny_hf
    from tests.gguf_factory import write_gguf

    gguf = write_gguf(build_tiny_hf("llama", tied=True), tmp_path / "tiny.gguf", arch="llama")
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 2**20)
    with pytest.raises(OutOfMemoryError, match="tiny at fp32 does not fit on cpu"):
        load_engine(LoadSpec(str(gguf), "fp32", "cpu", kv_memory_mib=16))
    assert not models_dir().exists() or not any(models_dir().iterdir())


def test_a_plan_never_times_the_weight_layout(tiny_model_dir, monkeypatch, fresh_measurements):
    """Planning (in the loader thread beside a decoding model, in the picker's scan) reads
    this machine's measured layout verdicts; a shape never timed counts as packed (the
    layout that takes more memory)."""
    from engine.kernels import packed_linear

    folder, _ = tiny_model_dir("llama", True)
    monkeypatch.delenv(packed_linear.LAYOUT_ENV, raising=False)
    monkeypatch.setattr(
        packed_linear, "time_layouts", lambda *a: pytest.fail("a plan timed a layout")
    )
    plan = plan_for_folder(folder, "fp32", "cpu")
    cfg = ModelConfig.from_file(folder / "config.json")
    packed = packed_linear.cpu_paths().packed(torch.float32).ok
    assert plan.weights["lm_head"] == (cfg.vocab_size * cfg.hidden_size * 4 if packed else 0)


def test_the_load_bound_follows_the_precision():
    """A float load holds its largest tensor in the compute dtype; a quantized head holds it in
    fp32 (the head/embedding being quantized), and an INT4 one its packed chunks before they
    are joined; a GPU holds no checkpoint copy."""
    from engine.formats import int4

    cfg = ModelConfig.from_file(CONFIGS / "llama-3.2-3b.json")
    overhead = {
        p: plan_memory(cfg, p, "cpu", memory=64 * 2**30).load_overhead_bytes
        for p in ("bf16", "int8", "int4-g32+head")
    }
    # Llama-3.2-3B's largest tensor is its tied embedding, in bf16 unless the head is quantized
    embedding = cfg.vocab_size * cfg.hidden_size
    assert overhead["bf16"] == overhead["int8"] < overhead["int4-g32+head"]
    chunks = int4.torch_cpu(None).load_temporaries(cfg.vocab_size, cfg.hidden_size, 32)
    assert chunks == embedding // 2
    assert overhead["int4-g32+head"] - overhead["int8"] == embedding * (4 - 2) + chunks
    gpu = plan_memory(cfg, "int8", "cuda", memory=64 * 2**30).load_overhead_bytes
    assert gpu == overhead["int8"] - embedding * 2  # no bf16 checkpoint copy on the device


def test_a_plan_whose_weights_fit_but_not_its_context_says_so():
    """A model with a huge KV cache per token (8 MiB) and small weights: the load fits, the
    room left holds fewer than 256 tokens."""
    cfg = ModelConfig.from_dict(
        {"model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 256, "num_attention_heads": 32, "num_key_value_heads": 32,
         "head_dim": 256, "max_position_embeddings": 4096}
    )  # fmt: skip
    pool = EngineConfig(num_blocks=1, block_size=1)
    roomy = plan_memory(cfg, "bf16", "cpu", memory=64 * 2**30, config=pool)
    budget = roomy.peak_bytes + 16 * 2**20
    tight = plan_memory(cfg, "bf16", "cpu", memory=budget, config=pool)
    assert tight.peak_bytes <= tight.budget_bytes and tight.max_context < 256
    assert not tight.fits
    why = tight.refusal()
    assert why is not None and f"leaves room for {tight.max_context} tokens of context" in why


def test_a_new_pool_keeps_the_weights_and_a_failed_one_keeps_the_old(tiny_model_dir, monkeypatch):
    from engine.core import engine as engine_module
    from engine.core.sampling import SamplingParams

    folder, _ = tiny_model_dir("llama", True)
    old = load_model(folder, precision="fp32", config=EngineConfig(num_blocks=8, block_size=4))
    rid = old.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="no request is running"):
        old.with_pool(num_blocks=16)
    while old.has_work():
        old.step()
    assert old.request_metrics(rid) is not None

    class Broken(engine_module.PagedKVCache):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("simulated: out of memory while allocating the pool")

    with monkeypatch.context() as mp:
        mp.setattr(engine_module, "PagedKVCache", Broken)
        with pytest.raises(RuntimeError, match="simulated"):
            old.with_pool(num_blocks=16)
    assert old.kv.manager.num_blocks == 8  # the old engine goes on with its pool
    list(old.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
    new = old.with_pool(num_blocks=16)
    assert new.model is old.model and new.kv.manager.num_blocks == 16
    assert len(list(new.generate([1, 2, 3], SamplingParams(max_new_tokens=3)))) == 3


def test_a_file_that_is_no_model_is_refused_by_name(tmp_path, capsys):
    from app.cli.main import main

    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert main(["plan", "--model", str(text)]) == 2
    assert "is a file, not a model folder" in capsys.readouterr().err
