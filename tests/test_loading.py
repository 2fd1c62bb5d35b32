"""The memory plan against what a load then reports, and loads the plan refuses.

The plan reads ``config.json`` only; a load reports its weights (``weights_bytes``, by kind in
``weight_groups``) and its KV pool (``kv.nbytes``). They must agree within 1% for the default
model at every precision and for tiny random models of each family.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.loading import LoadSpec, load_engine
from engine import loading
from engine.config import ModelConfig
from engine.engine import EngineConfig, LLMEngine
from engine.errors import InvalidRequestError, OutOfMemoryError
from engine.loading import parse_bytes, plan_for_folder, plan_memory

PRECISIONS = ["fp32", "bf16", "int8", "int8+head", "int4-g32", "int4-g32+head", "int4-g128"]
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
    engine = LLMEngine.load(default_model, precision=precision, config=config)
    assert_plan_matches(engine, default_model, precision, config)


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4-g32+head"])
@pytest.mark.parametrize(
    ("arch", "tied"),
    [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False)],
)
def test_the_plan_of_tiny_models_is_what_their_load_reports(tiny_model_dir, arch, tied, precision):
    folder, _ = tiny_model_dir(arch, tied)
    config = EngineConfig(num_blocks=7, block_size=4)
    engine = LLMEngine.load(folder, precision=precision, config=config)
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
    monkeypatch.setattr(loading, "free_memory", lambda device: 2**20)
    started = []
    monkeypatch.setattr(LLMEngine, "load", classmethod(lambda *a, **k: started.append(a)))
    with pytest.raises(OutOfMemoryError, match=r"does not fit on cpu: it needs .* GiB|MiB"):
        load_engine(LoadSpec(str(folder), "fp32", "cpu", kv_memory_mib=1))
    assert not started


def test_the_plan_suggests_what_would_fit():
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.2-3b.json")
    int4 = plan_memory(cfg, "int4-g32+head", "cuda", memory=12 * 2**30)
    budget = int4.peak_bytes + 2**20  # just enough for INT4 with its tied head
    fp16 = plan_memory(cfg, "fp16", "cuda", memory=budget, config=EngineConfig(kv_memory=0.5))
    assert not fp16.fits
    assert "try int" in fp16.suggestion
    nothing = plan_memory(cfg, "fp16", "cuda", memory=2**30)
    assert "no precision fits" in nothing.suggestion


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12GiB", 12 * 2**30), ("12 GB", 12 * 2**30), ("800MiB", 800 * 2**20), ("1.5T", 1.5 * 2**40),
     ("4096", 4096)],
)  # fmt: skip
def test_memory_sizes_parse(text, expected):
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize("text", ["twelve", "-1G", "12 parsecs", ""])
def test_a_bad_memory_size_says_how_to_write_one(text):
    with pytest.raises(InvalidRequestError, match="12GiB"):
        parse_bytes(text)


def test_infersight_plan_prints_json_and_says_when_nothing_fits(capsys):
    from app.cli import main

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
    from engine.model_store import models_dir
    from tests.conftest import build_tiny_hf
    from tests.gguf_factory import write_gguf

    gguf = write_gguf(build_tiny_hf("llama", tied=True), tmp_path / "tiny.gguf", arch="llama")
    monkeypatch.setattr(loading, "free_memory", lambda device: 2**20)
    with pytest.raises(OutOfMemoryError, match="tiny at fp32 does not fit on cpu"):
        load_engine(LoadSpec(str(gguf), "fp32", "cpu", kv_memory_mib=16))
    assert not models_dir().exists() or not any(models_dir().iterdir())
