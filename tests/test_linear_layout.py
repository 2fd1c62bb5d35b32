"""The timed choice between oneDNN's packed layout and ``nn.Linear``
(engine/kernels/packed_linear.py): timed once per (dtype, shape) and machine, kept in
``kernels.json``, obeyed by the loader."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.hardware import measured
from engine.hardware.cpu_paths import cpu_paths
from engine.hardware.verdicts import Timing
from engine.kernels import packed_linear
from engine.kernels.packed_linear import PackedLinear, pack_linears, packs, time_layouts
from engine.loader.load import load_model

needs_packing = pytest.mark.skipif(
    not cpu_paths().packed_fp32.ok, reason="this CPU does not run oneDNN's packed fp32 linear"
)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Iterator[object]:
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    monkeypatch.delenv(packed_linear.LAYOUT_ENV, raising=False)
    yield tmp_path


@pytest.fixture
def packable(home, monkeypatch) -> Iterator[object]:
    """Every dtype counts as packable here (the timing is faked: no packed op runs)."""
    probe = SimpleNamespace(ok=True)
    monkeypatch.setattr(packed_linear, "cpu_paths", lambda: SimpleNamespace(packed=lambda d: probe))
    yield home


@needs_packing
def test_both_layouts_are_timed_streaming_from_memory():
    t = time_layouts(torch.float32, 96, 64)
    assert t.ours_ms > 0 and t.torch_ms > 0


def test_a_verdict_is_timed_once_and_kept_per_machine(packable, monkeypatch):
    timed: list[tuple[int, int]] = []

    def fake(dtype: torch.dtype, out_features: int, in_features: int) -> Timing:
        timed.append((out_features, in_features))
        return Timing(ours_ms=1.0, torch_ms=2.0)

    monkeypatch.setattr(packed_linear, "time_layouts", fake)
    assert packs(torch.float32, 96, 64)
    assert packs(torch.float32, 96, 64)
    assert timed == [(96, 64)]
    saved = json.loads((packable / measured.KERNELS_FILE).read_text())
    entry = packed_linear.layout_key(torch.float32, 96, 64).entry()
    kept = {"ours_ms": 1.0, "torch_ms": 2.0, "noise": 0.0, "call_ms": 0.0}
    assert saved == {entry: {"float32 96x64": kept}}
    assert entry.startswith(measured.machine_key())


def test_an_unreadable_file_is_timed_again(packable, monkeypatch):
    (packable / measured.KERNELS_FILE).write_text("{not json")
    monkeypatch.setattr(packed_linear, "time_layouts", lambda *a: Timing(3.0, 1.0))
    assert not packs(torch.float32, 32, 32)
    assert "float32 32x32" in (packable / measured.KERNELS_FILE).read_text()


def test_noise_within_five_percent_keeps_the_packed_layout(packable, monkeypatch):
    timings = {64: Timing(ours_ms=1.04, torch_ms=1.0), 32: Timing(ours_ms=1.06, torch_ms=1.0)}
    monkeypatch.setattr(packed_linear, "time_layouts", lambda d, n, k: timings[n])
    assert packs(torch.float32, 64, 16) and not packs(torch.float32, 32, 16)
    # a plan reads the same verdicts back under the same rule; a shape never timed counts as
    # packed (the layout that takes more memory)
    assert packs(torch.float32, 64, 16, measure=False)
    assert not packs(torch.float32, 32, 16, measure=False)
    assert packs(torch.float32, 48, 16, measure=False)


@needs_packing
@pytest.mark.parametrize("packed_faster", [True, False])
def test_the_loader_packs_only_where_packing_measured_faster(
    tiny_model_dir, home, monkeypatch, packed_faster
):
    # The head (vocab 320) gets one verdict, every other shape the opposite.
    def fake(dtype: torch.dtype, out_features: int, in_features: int) -> Timing:
        faster = packed_faster == (out_features != 320)
        return Timing(1.0, 2.0) if faster else Timing(2.0, 1.0)

    monkeypatch.setattr(packed_linear, "time_layouts", fake)
    folder, _ = tiny_model_dir("llama", False)
    model = load_model(folder).model
    assert isinstance(model.lm_head, PackedLinear) is not packed_faster
    qkv = model.layers[0].attn.qkv_proj
    assert isinstance(qkv, PackedLinear) is packed_faster
    # pack=True packs every linear whatever the timings (the tests of the packed path)
    forced = load_model(folder, pack=True).model
    assert all(type(m) is not nn.Linear for m in forced.modules())


@needs_packing
def test_the_layout_switch_skips_the_timing(monkeypatch):
    monkeypatch.setattr(packed_linear, "time_layouts", lambda *a: pytest.fail("timed"))
    monkeypatch.setenv(packed_linear.LAYOUT_ENV, "plain")
    assert not packed_linear.packs(torch.float32, 96, 64)
    monkeypatch.setenv(packed_linear.LAYOUT_ENV, "packed")
    assert packed_linear.packs(torch.float32, 96, 64)


@needs_packing
def test_untimed_packing_swaps_every_float_linear():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))
    assert pack_linears(model, timed=False) == 2
    assert all(isinstance(m, PackedLinear) for m in model)
