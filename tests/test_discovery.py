"""Finding the models people already have (the store, the Hugging Face cache, LM Studio, their
own folders), and a GGUF import that checks the disk first and leaves nothing when stopped."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors import safe_open

from engine.errors import CancelledError, ModelLoadError, UnsupportedModelError
from engine.store.catalog import DiscoveredModel
from engine.store.discovery import discover_models, hf_cache_dir, lmstudio_dirs
from engine.store.gguf_import import import_gguf
from engine.store.gguf_reader import gguf_model_config, read_gguf_header
from engine.store.model_store import import_into_store, models_dir
from engine.store.planning import discover_and_plan
from tests.conftest import build_tiny_hf
from tests.gguf_factory import write_gguf

TinyDir = Callable[[str, bool], tuple[Path, torch.nn.Module]]
REVISION = "4f2a9c0d" * 5


def add_to_hf_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Lay ``files`` out the way the hub does: content-addressed blobs, a snapshot of
    relative symlinks to them, and ``refs/main`` naming the snapshot's revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", sha))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def safetensors_parameters(folder: Path) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return total


def hf_parameters(model: torch.nn.Module, *, tied: bool) -> int:
    state = dict(model.state_dict())
    if tied:
        state.pop("lm_head.weight", None)
    return sum(t.numel() for t in state.values())


def by_path(models: list[DiscoveredModel]) -> dict[Path, DiscoveredModel]:
    return {m.path: m for m in models}


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    hf = build_tiny_hf("llama", tied=True)
    return write_gguf(hf, tmp_path / "tiny-f16.gguf", arch="llama", quant="F16"), hf


def test_the_hub_cache_and_lm_studio_are_found_with_architecture_parameters_and_size(
    user_home: Path, tiny_model_dir: TinyDir, tiny_gguf: tuple[Path, torch.nn.Module]
) -> None:
    folder, _ = tiny_model_dir("llama", False)
    snapshot = add_to_hf_cache(hf_cache_dir(), "tester/tiny-llama", folder_files(folder))
    gguf, hf = tiny_gguf
    lms = user_home / ".lmstudio" / "models" / "tester" / "tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(gguf, lms / "tiny-f16.gguf")

    found = by_path(discover_models())

    cached = found[snapshot]
    assert (cached.name, cached.source, cached.format) == (
        "tester/tiny-llama",
        "hf-cache",
        "safetensors",
    )
    assert cached.architecture == "llama" and cached.config is not None
    assert cached.config.num_layers == 3 and cached.config.hidden_size == 64
    assert cached.parameters == safetensors_parameters(folder)
    assert cached.disk_bytes == sum(len(d) for d in folder_files(folder).values())

    local = found[lms / "tiny-f16.gguf"]
    assert (local.name, local.source, local.format) == ("tiny-f16", "lmstudio", "gguf")
    assert local.architecture == "llama"
    assert local.parameters == hf_parameters(hf, tied=True)
    assert local.disk_bytes == gguf.stat().st_size
    assert local.config is not None and local.config.num_kv_heads == 2
    assert local.config.tie_word_embeddings


def test_a_broken_or_unsupported_snapshot_is_skipped_and_hides_nothing(
    user_home: Path, tiny_model_dir: TinyDir
) -> None:
    folder, _ = tiny_model_dir("llama", False)
    files = folder_files(folder)
    cache = hf_cache_dir()
    good = add_to_hf_cache(cache, "a/good", files)
    add_to_hf_cache(cache, "b/bad-config", {**files, "config.json": b"{not json"})
    unsupported = json.dumps({**json.loads(files["config.json"]), "model_type": "gpt2"})
    add_to_hf_cache(cache, "c/gpt2", {**files, "config.json": unsupported.encode()})
    add_to_hf_cache(cache, "d/no-weights", {"config.json": files["config.json"]})
    gptq = {**json.loads(files["config.json"]), "quantization_config": {"quant_method": "gptq"}}
    add_to_hf_cache(cache, "e/gptq", {**files, "config.json": json.dumps(gptq).encode()})
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    add_to_hf_cache(
        cache,
        "f/half-downloaded",
        {**files, "model.safetensors.index.json": json.dumps(index).encode()},
    )
    (cache / "models--g--no-snapshots").mkdir()  # the hub's own scanner calls this corrupted

    assert [m.path for m in discover_models()] == [good]


def test_lm_studio_skips_split_parts_vision_projectors_unreadable_and_unsupported_files(
    user_home: Path, tiny_gguf: tuple[Path, torch.nn.Module]
) -> None:
    gguf, hf = tiny_gguf
    lms = user_home / ".cache" / "lm-studio" / "models" / "pub" / "repo"  # the older location
    lms.mkdir(parents=True)
    for name in ("mmproj-tiny-f16.gguf", "tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"):
        shutil.copy(gguf, lms / name)
    (lms / "truncated.gguf").write_bytes(gguf.read_bytes()[:100])
    write_gguf(hf, lms / "neox.gguf", arch="gptneox", quant="F16")  # not one we import

    found = discover_models()
    assert [(m.name, m.path.name) for m in found] == [("tiny", "tiny-00001-of-00002.gguf")]
    assert lmstudio_dirs() == [user_home / ".cache" / "lm-studio" / "models"]


def test_a_split_gguf_counts_every_part_and_its_import_is_refused(
    user_home: Path, tmp_path: Path
) -> None:
    hf = build_tiny_hf("llama", tied=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    first = write_gguf(
        hf, mine / "big-00001-of-00002.gguf", arch="llama", quant="F16",
        extra_uint16={"split.count": 2},
    )  # fmt: skip
    second = write_gguf(hf, mine / "big-00002-of-00002.gguf", arch="llama", quant="F16")

    (model,) = discover_models([mine])
    assert (model.path, model.source) == (first, "folder")
    assert model.parameters == 2 * hf_parameters(hf, tied=True)
    assert model.disk_bytes == first.stat().st_size + second.stat().st_size
    with pytest.raises(UnsupportedModelError, match=r"split GGUF.*llama-gguf-split --merge"):
        import_gguf(first, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_store_and_the_users_folders_are_listed_once_each(
    user_home: Path,
    tmp_path: Path,
    tiny_model_dir: TinyDir,
    tiny_gguf: tuple[Path, torch.nn.Module],
) -> None:
    gguf, _ = tiny_gguf
    stored = import_into_store(gguf)
    folder, _ = tiny_model_dir("qwen2", True)
    mine = tmp_path / "mine"
    shutil.copytree(folder, mine / "deeper" / "qwen-tiny")
    shutil.copy(gguf, mine / "tiny-f16.gguf")

    found = discover_models([mine, mine])  # a folder added twice is scanned once
    assert [(m.source, m.format, m.architecture) for m in found] == [
        ("store", "safetensors", "llama"),
        ("folder", "gguf", "llama"),
        ("folder", "safetensors", "qwen2"),
    ]
    assert found[0].path == stored and found[0].parameters == read_gguf_header(gguf).parameters
    assert found[2].path == mine / "deeper" / "qwen-tiny"
    assert found[2].parameters == safetensors_parameters(folder)


def test_the_hub_cache_follows_the_hubs_environment_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hf_cache_dir() == tmp_path / "elsewhere"


def test_the_lm_studio_folder_can_be_overridden(
    user_home: Path, tmp_path: Path, monkeypatch
) -> None:
    (user_home / ".lmstudio" / "models").mkdir(parents=True)
    assert lmstudio_dirs() == [user_home / ".lmstudio" / "models"]
    (tmp_path / "moved" / "models").mkdir(parents=True)  # LM Studio's home, moved elsewhere
    (user_home / ".lmstudio-home-pointer").write_text(f"{tmp_path / 'moved'}\n")
    assert lmstudio_dirs() == [tmp_path / "moved" / "models", user_home / ".lmstudio" / "models"]
    monkeypatch.setenv("INFERSIGHT_LMSTUDIO_DIR", str(tmp_path / "lms"))
    assert lmstudio_dirs() == []  # the override alone, and it does not exist
    (tmp_path / "lms").mkdir()
    assert lmstudio_dirs() == [tmp_path / "lms"]


def test_a_gguf_header_gives_the_model_config(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    gguf, hf = tiny_gguf
    cfg = gguf_model_config(gguf)
    hc = hf.config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (
        "llama", hc.vocab_size, hc.hidden_size, hc.num_hidden_layers,
    )  # fmt: skip
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (8, 2, 112)
    assert cfg.rope_theta == pytest.approx(5000.0)


def test_each_model_gets_a_memory_plan_for_the_device(
    user_home: Path, tiny_gguf: tuple[Path, torch.nn.Module]
) -> None:
    gguf, _ = tiny_gguf
    lms = user_home / ".lmstudio" / "models" / "p" / "r"
    lms.mkdir(parents=True)
    shutil.copy(gguf, lms / "tiny.gguf")
    roomy = discover_and_plan([], "fp32", "cpu", memory=2**30)
    (row,) = roomy.models
    assert roomy.note == "" and row.plan is not None and row.plan.fits
    assert "fits" in row.plan.one_line()
    (cramped,) = discover_and_plan([], "fp32", "cpu", memory=2**10).models
    assert cramped.plan is not None and not cramped.plan.fits


# -- the import: disk space and cancellation ---------------------------------------------------


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def test_an_import_without_the_disk_space_is_refused_before_writing(
    user_home: Path, tiny_gguf: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf, hf = tiny_gguf
    probed: list[Path] = []

    def nearly_full(path: Any) -> Usage:
        probed.append(Path(path))
        return Usage(10 * 2**30, 10 * 2**30 - 3 * 2**20, 3 * 2**20)

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    with pytest.raises(ModelLoadError) as err:
        import_into_store(gguf)
    message = str(err.value)
    assert "not enough disk space" in message and str(models_dir()) in message
    assert "3.0 MiB is free" in message
    writes = re.search(r"writes ([\d.]+) MiB and needs ([\d.]+) MiB free", message)
    assert writes is not None, message
    fp16 = hf_parameters(hf, tied=True) * 2 / 2**20
    assert fp16 < float(writes[1]) < fp16 + 2 and float(writes[2]) >= float(writes[1]) + 64
    assert probed and models_dir().is_relative_to(probed[0])  # the nearest existing folder
    assert not models_dir().exists()  # nothing written, not even the folder


def test_a_cancelled_import_leaves_nothing_behind(
    user_home: Path, tiny_gguf: tuple[Path, torch.nn.Module]
) -> None:
    gguf, _ = tiny_gguf
    seen: list[tuple[str, int, int]] = []

    def cancel_after_two(stage: str, done: int, total: int) -> None:
        seen.append((stage, done, total))
        if done >= 2:
            raise CancelledError("the load was cancelled")

    with pytest.raises(CancelledError):
        import_into_store(gguf, progress=cancel_after_two)
    assert seen[0][:2] == ("dequantize", 0)
    assert list(models_dir().iterdir()) == []  # no partial folder, no temporary files
    assert import_into_store(gguf).is_dir()  # and the next import starts clean
