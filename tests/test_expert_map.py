"""The expert heat map (a real Qt widget): each layer's share of its recent routed tokens by
expert, from the snapshots' cumulative counts, decayed between frames; fed by the engine's
own snapshots of a mixture of experts."""

from __future__ import annotations

import numpy as np
import pytest

from widgets.expert_map import DECAY, ExpertHeatMap


def test_the_map_draws_each_layers_recent_shares(qtbot):
    heat = ExpertHeatMap()
    qtbot.addWidget(heat)
    heat.set_load((0, 2), [[0, 0, 0], [0, 0, 0]])
    assert heat.shares.tolist() == [[0, 0, 0], [0, 0, 0]]  # nothing routed yet
    heat.set_load((0, 2), [[3, 1, 0], [0, 0, 4]])
    assert heat.shares.tolist() == [[0.75, 0.25, 0.0], [0.0, 0.0, 1.0]]
    heat.set_load((0, 2), [[3, 1, 4], [0, 0, 4]])  # layer 0's next 4 tokens to expert 2
    first = np.array([DECAY * 3, DECAY * 1, 4.0])
    assert heat.shares[0] == pytest.approx(first / first.sum())
    assert heat.shares[1].tolist() == [0.0, 0.0, 1.0]  # nothing new: its old shares, decayed
    assert np.array_equal(heat.image.image, heat.shares)
    assert heat.plot.isVisibleTo(heat) and "2 layers of 3 experts" in heat.label.text()
    heat.set_load((), ())
    assert not heat.plot.isVisibleTo(heat) and "dense model" in heat.label.text()


def test_the_instruments_show_a_mixture_of_experts_routing(qtbot, tiny_model_dir):
    from app.gui.instrument_frames import frame_of
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model
    from widgets.instruments import InstrumentsPanel

    folder, _ = tiny_model_dir("qwen3_moe", False)
    engine = load_model(folder, precision="fp32")
    panel = InstrumentsPanel()
    qtbot.addWidget(panel)
    panel.add_frame(frame_of(engine.metrics()))
    list(engine.generate(list(range(3, 20)), SamplingParams(max_new_tokens=8, ignore_eos=True)))
    panel.add_frame(frame_of(engine.metrics()))
    heat = panel.expert_map
    assert heat.layers == (0, 2) and heat.shares.shape == (2, 6)
    assert heat.shares.sum(axis=1) == pytest.approx([1.0, 1.0])
    routed = np.asarray(engine.metrics().expert_tokens, dtype=float)
    assert heat.shares == pytest.approx(routed / routed.sum(axis=1, keepdims=True))
