"""The controls panel offscreen (pytest-qt): number fields that refuse what is out of range,
sampling settings and the model's own defaults, the device choice, the prefix cache switch,
speculative decoding's settings; each round-trips its state."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from engine.core.sampling import SamplingParams
from widgets.controls import ControlsPanel
from widgets.number_field import NumberField

pytestmark = pytest.mark.usefixtures("gui_gc")


def test_number_field_refuses_out_of_range_and_keeps_the_last_good_value(qtbot: object) -> None:
    f = NumberField("top-p", 0.9, lo=0, hi=1, lo_open=True)
    qtbot.addWidget(f)  # type: ignore[attr-defined]
    said: list[str] = []
    changed: list[bool] = []
    f.invalid.connect(said.append)
    f.changed.connect(lambda: changed.append(True))
    for bad in ("0", "1.5", "abc", "", "nan"):
        f.setText(bad)
        f.editingFinished.emit()
        assert f.text() == "0.9" and f.value() == 0.9
    assert len(said) == 5 and all("top-p" in s for s in said)
    assert "must be in (0, 1]" in said[0] and "must be a number" in said[2]
    f.setText("0.5")
    f.editingFinished.emit()
    assert f.value() == 0.5 and changed == [True]


def test_optional_integer_field(qtbot: object) -> None:
    f = NumberField("seed", None, lo=0, hi=100, integer=True, optional=True)
    qtbot.addWidget(f)  # type: ignore[attr-defined]
    assert f.value() is None
    f.setText("1.5")
    f.editingFinished.emit()
    assert f.value() is None
    f.setText("42")
    f.editingFinished.emit()
    assert f.value() == 42


def test_controls_give_valid_sampling_params_and_round_trip_their_state(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    c.top_k.set_value(40)
    c.seed.set_value(3)
    c.stop_strings.setText("###, User:")
    c.window_on.setChecked(True)
    params = SamplingParams(**c.sampling())  # the engine accepts what the panel holds
    assert params.top_k == 40 and params.seed == 3 and params.stop == ("###", "User:")
    assert c.cache_window() == (4, 256)
    other = ControlsPanel()
    qtbot.addWidget(other)  # type: ignore[attr-defined]
    other.restore(c.state())
    assert other.sampling() == c.sampling() and other.cache_window() == c.cache_window()
    other.restore({"temperature": "99", "top_k": "x"})  # unreadable values keep defaults
    assert other.sampling()["temperature"] == c.sampling()["temperature"]


SMOL = {"temperature": 0.2, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0}


def test_controls_show_the_model_default_sampling_and_reset_restores_it(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    c.set_model_defaults("default", SMOL)
    s = c.sampling()
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"]) == (0.2, 50, 0.9, 0)
    assert c.sampling_source.text() == "model default"
    assert not c.reset_sampling_button.isEnabled()
    assert "temperature 0.2, top-k 50, top-p 0.9" in c.sampling_source.toolTip()
    c.temperature.setText("0.8")  # the user's own value
    c.temperature.editingFinished.emit()
    assert c.sampling_source.text() == "your own values" and c.reset_sampling_button.isEnabled()
    c.set_model_defaults("default", SMOL)  # the same model again (say, another precision)
    assert c.sampling()["temperature"] == 0.8
    saved = c.state()
    c.reset_sampling_button.click()
    assert c.sampling()["temperature"] == 0.2 and c.sampling_source.text() == "model default"
    c.temperature.set_value(1.0)
    c.set_model_defaults("/models/other", {"temperature": 0.0, "repetition_penalty": 1.1})
    s = c.sampling()  # another model: its own defaults
    assert (s["temperature"], s["top_k"], s["top_p"], s["repetition_penalty"]) == (0, 0, 1, 1.1)
    assert c.sampling_source.text() == "model default"

    after_restart = ControlsPanel()  # the user's values survive a restart with that model
    qtbot.addWidget(after_restart)  # type: ignore[attr-defined]
    after_restart.restore(saved)
    after_restart.set_model_defaults("default", SMOL)
    assert after_restart.sampling()["temperature"] == 0.8
    old_settings = ControlsPanel()  # saved before models had defaults: the model's win
    qtbot.addWidget(old_settings)  # type: ignore[attr-defined]
    old_settings.restore({"temperature": "0.7", "top_p": "0.95"})
    old_settings.set_model_defaults("default", SMOL)
    assert old_settings.sampling()["temperature"] == 0.2
    assert old_settings.sampling()["top_p"] == 0.9


def test_device_choice_offers_auto_and_shows_where_it_runs(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    c.set_devices(["auto", "cpu", "cuda:0"])
    assert c.device_combo.itemText(0) == "auto" and c.device() == "auto"
    requested: list[str] = []
    c.device_requested.connect(requested.append)
    c.show_model("default", "fp32", "auto", "cpu")
    assert c.device() == "auto" and c.device_combo.currentText() == "auto → cpu"
    c.device_combo.activated.emit(0)
    assert requested == ["auto"]
    c.show_model("default", "fp32", "cuda:0", "cuda:0")
    assert c.device() == "cuda:0"
    c.set_devices(["auto", "cpu"])  # the chosen device is gone: back to auto
    assert c.device() == "auto"


def test_controls_prefix_cache_switch_clear_button_and_label(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    assert c.prefix_cache() and c.clear_prefix_cache.isEnabled()  # on by default
    assert c.prefix_cache_label.text() == "no prompts yet"
    toggled: list[bool] = []
    cleared: list[bool] = []
    c.prefix_cache_toggled.connect(toggled.append)
    c.prefix_cache_clear_requested.connect(lambda: cleared.append(True))
    c.clear_prefix_cache.click()
    assert cleared == [True]
    c.show_prefix_cache(0.64, 20)
    assert c.prefix_cache_label.text() == "hits 64% · 20 blocks cached"
    c.show_prefix_cache(1.0, 1)
    assert c.prefix_cache_label.text() == "hits 100% · 1 block cached"
    c.prefix_cache_on.click()  # off: no clearing, the label says so
    assert toggled == [False] and not c.prefix_cache()
    assert not c.clear_prefix_cache.isEnabled() and c.prefix_cache_label.text() == "off"
    c.show_prefix_cache(None, 0)  # a snapshot while off keeps saying off
    assert c.prefix_cache_label.text() == "off"
    c.prefix_cache_on.click()
    assert toggled == [False, True] and c.clear_prefix_cache.isEnabled()
    assert c.prefix_cache_label.text() == "no prompts yet"

    c.prefix_cache_on.setChecked(False)
    saved = c.state()
    other = ControlsPanel()
    qtbot.addWidget(other)  # type: ignore[attr-defined]
    restored: list[bool] = []
    other.prefix_cache_toggled.connect(restored.append)
    other.restore(saved)  # a saved 'off' reaches whoever listens: the engine follows it
    assert not other.prefix_cache() and restored == [False]
    assert not other.clear_prefix_cache.isEnabled()
    other.restore({"temperature": "0.5"})  # saved before the prefix cache existed: on
    assert other.prefix_cache() and other.clear_prefix_cache.isEnabled()
    other.restore({"prefix_cache": "false"})  # as a settings store may hand it back
    assert not other.prefix_cache()


def test_controls_speculation_emits_text_and_k_and_round_trips(
    qtbot: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    asked: list[tuple[str, int]] = []
    c.speculation_changed.connect(lambda text, k: asked.append((text, k)))
    assert c.speculation() == ("", 8) and c.spec_label.text() == "off"  # off by default
    assert not c.spec_precision.isEnabled() and not c.spec_folder.isEnabled()

    def choose(method: str) -> None:
        c.spec_method.setCurrentIndex(c.spec_method.findData(method))

    choose("lookup")
    assert asked == [("lookup", 8)] and c.spec_label.text() == "applying…"
    c.show_speculation("lookup", 8)  # the worker's answer, then a metrics snapshot
    assert c.spec_label.text() == "lookup · no drafts yet"
    c.show_speculation_stats(0.62, 2.94)
    assert c.spec_label.text() == "lookup · 62% accepted · 2.9 tokens/step"
    c.spec_k.setValue(6)
    c.spec_k.setValue(20)  # clamped to 16
    assert asked[1:] == [("lookup", 6), ("lookup", 16)]
    choose("self")
    assert c.spec_precision.isEnabled() and asked[-1] == ("self:int4-g32+head", 16)
    assert c.spec_label.text() == "loading the drafter…"
    c.spec_precision.setCurrentText("int8+head")
    assert asked[-1] == ("self:int8+head", 16)
    for text, k in asked[1:]:  # the answers to the four changes since
        c.show_speculation(text, k)
    n = len(asked)
    choose("model")  # no folder yet: nothing asked, the running drafter is named
    assert len(asked) == n and c.speculation() is None and c.spec_browse.isEnabled()
    assert c.spec_label.text() == "choose the draft model's folder (self:int8+head runs meanwhile)"
    monkeypatch.setattr(
        "widgets.speculation_controls.QFileDialog.getExistingDirectory",
        lambda *a, **k: "/models/draft-135m",
    )
    c.spec_browse.click()
    assert asked[-1] == ("model:/models/draft-135m", 16)
    # the folder is refused: the controls go back to what runs and say why
    c.show_speculation("self:int8+head", 16, "speculative decoding with model:… could not start")
    assert c.spec_method.currentData() == "self" and c.spec_precision.currentText() == "int8+head"
    assert c.spec_label.text().startswith("⚠ speculative decoding with model:")
    assert len(asked) == n + 1  # going back asks for nothing

    choose("model")  # the folder is kept: this asks for it again
    assert asked[-1] == ("model:/models/draft-135m", 16)
    c.show_speculation("model:/models/draft-135m", 16)
    c.show_speculation_stats(0.5, 2.0)
    assert c.spec_label.text() == "model:draft-135m · 50% accepted · 2.0 tokens/step"
    other = ControlsPanel()
    qtbot.addWidget(other)  # type: ignore[attr-defined]
    restored: list[tuple[str, int]] = []
    other.speculation_changed.connect(lambda text, k: restored.append((text, k)))
    other.restore(c.state())  # a saved choice reaches whoever listens: the engine follows it
    assert restored == [("model:/models/draft-135m", 16)] and other.speculation() == c.speculation()
    other.restore({"temperature": "0.5"})  # saved before speculative decoding existed: off
    assert restored[-1] == ("", 8) and other.spec_method.currentData() == ""
    other.restore({"speculation": {"method": "self", "precision": "int4-g64", "k": "x"}})
    assert restored[-1] == ("self:int4-g64", 8)  # an unreadable k keeps the default
    choose("")
    assert asked[-1] == ("", 16)
