"""Models from the Hub (engine/store/hub.py) against a local server that speaks the Hub's HTTP
API (tests/hub_server.py, ``HF_ENDPOINT``), driven by ``huggingface_hub`` itself: search, a
repo's files and sizes, each precision's verdict from config.json alone, a download into the
HF cache that loads, resumed after a dropped connection, cancelled and resumed, a 404 and a
gated 401 said plainly, the token from the keyring."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import keyring
import pytest

from engine.core.sampling import SamplingParams
from engine.errors import CancelledError, InvalidRequestError, ModelPullError
from engine.loader.load import load_model
from engine.store import hub
from tests import hub_server
from tests.memory_keyring import MemoryKeyring


@pytest.fixture
def local_hub(tiny_model_dir, tmp_path, monkeypatch) -> Iterator[hub_server.Hub]:
    folder, _ = tiny_model_dir("llama", False)
    state = hub_server.Hub()
    state.add_folder("tiny-org/tiny-llama", folder).downloads = 10
    state.add_folder("tiny-org/tiny-llama-gated", folder, gated=True)
    state.add_folder("other/unrelated", folder).downloads = 99
    server, url = hub_server.serve(state)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # chunks of 64 KiB, not 10 MiB: the tiny model's half-megabyte file is many chunks, as a
    # real model's gigabytes are, so that a drop or a cancel leaves part of it on disk
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    previous = keyring.get_keyring()
    keyring.set_keyring(MemoryKeyring())
    yield state
    keyring.set_keyring(previous)
    server.shutdown()


def test_search_lists_the_matching_repos(local_hub):
    assert hub.search("tiny-llama") == ["tiny-org/tiny-llama", "tiny-org/tiny-llama-gated"]
    assert hub.search("nothing-like-it") == []
    with pytest.raises(InvalidRequestError, match="part of a model's name"):
        hub.search("  ")


def test_a_repo_lists_its_weights_with_their_sizes_and_a_verdict_per_precision(local_hub):
    repo = hub.repo("tiny-org/tiny-llama")
    files = local_hub.repos["tiny-org/tiny-llama"].files
    assert {(f.path, f.size) for f in repo.files} == {(p, len(b)) for p, b in files.items()}
    assert [f.path for f in repo.weights] == ["model.safetensors"]
    verdicts = hub.verdicts(hub.config("tiny-org/tiny-llama"), ["fp32", "int8"], "cpu")
    assert [(v.precision, v.fits, v.text) for v in verdicts] == [
        ("fp32", True, "fits"), ("int8", True, "fits")]  # fmt: skip
    assert local_hub.gets == ["config.json"]  # the verdict fetched the config alone


def test_a_pull_lands_in_the_hf_cache_resumed_after_a_dropped_connection_and_loads(
    local_hub, tmp_path
):
    local_hub.drop_once.add("model.safetensors")
    seen: list[tuple[int, int]] = []
    folder = hub.pull("tiny-org/tiny-llama", progress=lambda s, d, t: seen.append((d, t)))
    assert folder.is_relative_to(tmp_path / "hf-cache")
    files = local_hub.repos["tiny-org/tiny-llama"].files
    for name, data in files.items():
        assert (
            hashlib.sha256((folder / name).read_bytes()).digest() == hashlib.sha256(data).digest()
        )
    assert [name for name, _ in local_hub.ranges] == ["model.safetensors"]  # resumed, not over
    total = sum(len(b) for b in files.values())
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    engine = load_model(folder)
    gen = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
    for _ in gen:
        pass
    assert len(gen.result.token_ids) == 2


def test_a_cancelled_pull_leaves_nothing_half_done_and_the_next_completes(local_hub, tmp_path):
    """A cancel (the progress callback raising, as the app's Cancel does) stops the download
    at once; no partial file is left where a load would take it for whole (huggingface_hub
    keeps none since 2.0), and the next pull completes the model."""
    weights = local_hub.repos["tiny-org/tiny-llama"].files["model.safetensors"]

    def cancel_midway(stage: str, done: int, total: int) -> None:
        if done > total // 2:
            raise CancelledError("cancelled by the user")

    with pytest.raises(CancelledError):
        hub.pull("tiny-org/tiny-llama", progress=cancel_midway)
    cache = tmp_path / "hf-cache"
    partial = [p for p in cache.rglob("model.safetensors") if p.stat().st_size != len(weights)]
    assert not partial and not list(cache.rglob("*.incomplete"))
    folder = hub.pull("tiny-org/tiny-llama")
    assert (folder / "model.safetensors").read_bytes() == weights


def test_a_missing_repo_and_a_gated_one_are_said_plainly(local_hub):
    with pytest.raises(ModelPullError, match="no model nobody/nothing on the Hub"):
        hub.repo("nobody/nothing")
    with pytest.raises(ModelPullError, match="is gated: accept its terms"):
        hub.pull("tiny-org/tiny-llama-gated")
    hub.save_token(hub_server.TOKEN)  # the token field: kept in the keyring
    assert hub.token() == hub_server.TOKEN
    assert (hub.pull("tiny-org/tiny-llama-gated") / "model.safetensors").is_file()
    hub.save_token(None)
    assert hub.token() is None


def test_the_command_line_searches_shows_verdicts_and_pulls(local_hub, tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", "models", *args], cwd=root,
                              env=dict(os.environ), capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    found = cli("search", "tiny")
    assert found.returncode == 0 and found.stdout.split() == [
        "tiny-org/tiny-llama", "tiny-org/tiny-llama-gated"]  # fmt: skip
    files = cli("files", "tiny-org/tiny-llama", "--device", "cpu", "--precision", "fp32,int8")
    assert files.returncode == 0, files.stderr
    assert "model.safetensors" in files.stdout and "MiB" in files.stdout
    assert [line.split() for line in files.stdout.splitlines()[-2:]] == [
        ["fp32", "fits"], ["int8", "fits"]]  # fmt: skip
    pulled = cli("pull", "tiny-org/tiny-llama")
    assert pulled.returncode == 0, pulled.stderr
    assert (Path(pulled.stdout.strip()) / "config.json").is_file()
    missing = cli("files", "nobody/nothing")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "no model nobody/nothing on the Hub" in missing.stderr


def test_the_get_models_page_finds_judges_downloads_and_loads(local_hub, qtbot, tmp_path):
    """The model picker's "Get models" page with the app's calls, against the local Hub:
    search, a repo's files and verdicts, a download with its bar, and the folder handed on
    to load; a gated repo's error shown, then its token saved and the download made."""
    from app.gui.hub_calls import hub_calls
    from widgets.model_picker import ModelPicker

    def no_scan(*args: object) -> object:
        raise RuntimeError("not scanned here")

    picker = ModelPicker(no_scan, hub=hub_calls(lambda: ("fp32", "cpu")))
    qtbot.addWidget(picker)
    page = picker.hub_page
    assert page is not None and picker.pages.tabText(1) == "Get models"
    requested: list[str] = []
    picker.model_requested.connect(requested.append)

    def wait() -> None:
        qtbot.waitUntil(lambda: not page.busy, timeout=60_000)

    page.query.setText("tiny-llama")
    page.search()
    wait()
    assert [page.results.item(i).text() for i in range(page.results.count())] == [
        "tiny-org/tiny-llama", "tiny-org/tiny-llama-gated"]  # fmt: skip
    page.results.setCurrentRow(0)
    wait()
    assert page.files.item(0, 0).text() == "model.safetensors"
    assert "✓ fp32: fits" in page.verdict.text()
    page.download()
    wait()
    assert requested and (Path(requested[0]) / "model.safetensors").is_file()
    page.results.setCurrentRow(1)  # gated: the Hub's 401 said plainly, then the token
    wait()
    assert page.verdict.text().startswith("Gated: accept its terms")
    page.download()
    wait()
    assert "is gated" in page.status.text() and len(requested) == 1
    page.token.setText(hub_server.TOKEN)
    page.save_token()
    wait()
    page.download()
    wait()
    assert len(requested) == 2 and "tiny-llama-gated" in requested[1]
    picker.shutdown()


@pytest.mark.skipif(
    not __import__("os").environ.get("INFERSIGHT_SCREENSHOTS"),
    reason="renders for the docs (make screenshots)",
)
def test_get_models_screenshot(local_hub, qtbot):
    """docs/screenshots/get-models.png: the Get models page on a repo, with its verdicts."""
    import os

    from app.gui.hub_calls import hub_calls
    from widgets.model_picker import ModelPicker

    picker = ModelPicker(lambda *a: None, hub=hub_calls(lambda: ("fp32", "cpu")))
    qtbot.addWidget(picker)
    picker.resize(900, 560)
    picker.show()
    page = picker.hub_page
    assert page is not None
    picker.pages.setCurrentWidget(page)
    page.query.setText("tiny")
    page.search()
    qtbot.waitUntil(lambda: not page.busy, timeout=60_000)
    page.results.setCurrentRow(0)
    qtbot.waitUntil(lambda: not page.busy and page.repo is not None, timeout=60_000)
    picker.grab().save(str(Path(os.environ["INFERSIGHT_SCREENSHOTS"]) / "get-models.png"))
    picker.shutdown()
