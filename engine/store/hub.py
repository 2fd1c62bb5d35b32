"""Models from the Hugging Face Hub, through ``huggingface_hub`` (``HF_ENDPOINT`` names another
server that speaks the Hub's API): search by name, a repo's weight files with their sizes,
each precision's verdict on this machine from the repo's config.json alone (the memory plan,
before a byte of weights is downloaded), and a download with progress, resume and cancel into
the Hugging Face cache, where the model picker finds it. A gated or private repo's token is
kept in the system keyring (``keyring``), or read from ``HF_TOKEN``."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CancelledError, InvalidRequestError, ModelPullError

#: what a model folder needs beside its weights (config, tokenizer, generation defaults)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model")  # fmt: skip
WEIGHTS = (".safetensors", ".gguf")
KEYRING_SERVICE, KEYRING_USER = "infersight", "huggingface"
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class HubFile:
    path: str
    size: int | None  # bytes; None where the server does not say


@dataclass(frozen=True, slots=True)
class HubRepo:
    repo_id: str
    revision: str
    gated: bool
    files: tuple[HubFile, ...]

    @property
    def weights(self) -> tuple[HubFile, ...]:
        return tuple(f for f in self.files if f.path.endswith(WEIGHTS))

    @property
    def safetensors_bytes(self) -> int:
        return sum(f.size or 0 for f in self.weights if f.path.endswith(".safetensors"))


@dataclass(frozen=True, slots=True)
class Verdict:
    precision: str
    fits: bool
    max_context: int
    text: str  # "fits", "fits, context up to 3,072 tokens", "does not fit: …"


def token() -> str | None:
    """The Hub token: ``HF_TOKEN``, else the one kept in the keyring (None: anonymous)."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    import keyring
    from keyring.errors import KeyringError

    try:
        return keyring.get_password(KEYRING_SERVICE, KEYRING_USER)
    except KeyringError:
        return None


def save_token(value: str | None) -> None:
    """Keep ``value`` in the system keyring (None or "": forget it)."""
    import keyring
    from keyring.errors import KeyringError, PasswordDeleteError

    try:
        if value:
            keyring.set_password(KEYRING_SERVICE, KEYRING_USER, value)
        else:
            with contextlib.suppress(PasswordDeleteError):  # none was kept
                keyring.delete_password(KEYRING_SERVICE, KEYRING_USER)
    except KeyringError as exc:
        raise InvalidRequestError(
            f"no system keyring to keep the token in ({exc}); set HF_TOKEN in your "
            "environment instead"
        ) from exc


def endpoint() -> str | None:
    """``HF_ENDPOINT`` as it is now (huggingface_hub reads it once, when first imported)."""
    return os.environ.get("HF_ENDPOINT") or None


def cache_dir() -> str | None:
    """``HF_HUB_CACHE`` as it is now, for the same reason (None: huggingface_hub's own)."""
    return os.environ.get("HF_HUB_CACHE") or None


def _api() -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token() or False)


def _explained(exc: Exception, repo_id: str) -> Exception:
    """The Hub's errors as what to do (never a traceback)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(exc, GatedRepoError):
        return ModelPullError(
            f"{repo_id} is gated: accept its terms on the Hub with your account, then give "
            "Infersight your access token (the token field, or HF_TOKEN)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelPullError(
            f"no model {repo_id} on the Hub (or it is private: give your access token); "
            "check the name, e.g. HuggingFaceTB/SmolLM2-360M-Instruct"
        )
    where = endpoint() or "the Hugging Face Hub"
    return ModelPullError(
        f"{where} did not answer for {repo_id} ({type(exc).__name__}: {exc}); check your "
        "network, or HF_ENDPOINT if you set one, and try again"
    )


def search(query: str, limit: int = 20) -> list[str]:
    """Repo ids whose name matches ``query``, most downloaded first."""
    if not query.strip():
        raise InvalidRequestError("give part of a model's name to search for, e.g. 'smollm2'")
    try:
        models = _api().list_models(search=query.strip(), limit=limit, sort="downloads")
        return [m.id for m in models]
    except Exception as exc:
        raise _explained(exc, query) from exc


def repo(repo_id: str, revision: str = "main") -> HubRepo:
    """A repo's files with their sizes, and whether it is gated."""
    try:
        info = _api().model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise _explained(exc, repo_id) from exc
    files = tuple(HubFile(s.rfilename, s.size) for s in info.siblings or ())
    return HubRepo(repo_id, info.sha or revision, bool(info.gated), files)


def config(repo_id: str, revision: str = "main") -> dict[str, Any]:
    """The repo's config.json (a few KB, the only file fetched for a verdict)."""
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(
            repo_id, "config.json", revision=revision, token=token(), endpoint=endpoint(),
            cache_dir=cache_dir(),
        )  # fmt: skip
    except Exception as exc:
        raise _explained(exc, repo_id) from exc
    raw: dict[str, Any] = json.loads(Path(path).read_text())
    return raw


def verdicts(raw: dict[str, Any], precisions: Iterable[str], device: str) -> list[Verdict]:
    """Each precision's memory plan of the config ``raw`` on ``device`` of this machine."""
    from engine.loader.memory_plan import plan_memory
    from engine.model.config import ModelConfig

    cfg = ModelConfig.from_dict(raw)
    out = []
    for precision in precisions:
        try:
            plan = plan_memory(cfg, precision, device, name=str(raw.get("_name_or_path", "")))
        except InvalidRequestError as exc:
            out.append(Verdict(precision, False, 0, f"not on {device}: {exc}"))
            continue
        if not plan.fits:
            out.append(Verdict(precision, False, 0, "does not fit"))
        elif plan.max_context >= cfg.max_position_embeddings:
            out.append(Verdict(precision, True, plan.max_context, "fits"))
        else:
            text = f"fits, context up to {plan.max_context:,} tokens"
            out.append(Verdict(precision, True, plan.max_context, text))
    return out


def pull(
    repo_id: str,
    *,
    revision: str = "main",
    weights: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Download the repo's model (its safetensors, or the one ``weights`` file, a GGUF say,
    with the side files) into the Hugging Face cache and return its folder: ``progress``
    told ``("download", bytes so far, bytes in all)``; raising from it (a cancel) stops the
    download. A connection dropped mid-file is resumed from where it broke (huggingface_hub
    asks for the rest); a cancelled file is fetched again by the next pull (huggingface_hub
    keeps no partial file since 2.0); the files already complete are not."""
    from huggingface_hub import hf_hub_download

    found = repo(repo_id, revision)
    chosen = [f for f in found.weights if f.path == weights] if weights else [
        f for f in found.weights if f.path.endswith(".safetensors")
    ]  # fmt: skip
    if not chosen:
        have = ", ".join(f.path for f in found.weights) or "none"
        raise ModelPullError(
            f"{repo_id} has no {weights or 'safetensors weights'} (its weight files: {have})"
        )
    side = [f for f in found.files if f.path in SIDE_FILES]
    todo = [*side, *chosen]  # the small files first: a cancel leaves a loadable config
    total = sum(f.size or 0 for f in todo)
    done = 0
    path = ""
    for file in todo:
        bar = _bar(progress, done, total) if progress else None
        try:
            path = hf_hub_download(
                repo_id, file.path, revision=found.revision, token=token(), tqdm_class=bar,
                endpoint=endpoint(), cache_dir=cache_dir(),
            )  # fmt: skip
        except CancelledError:
            raise
        except Exception as exc:
            raise _explained(exc, repo_id) from exc
        done += file.size or Path(path).stat().st_size
        if progress:
            progress("download", min(done, total), total)
    # the snapshot's folder: the last file's path less its path in the repo
    return Path(path).parents[len(Path(todo[-1].path).parts) - 1]


def _bar(progress: Progress, before: int, total: int) -> type:
    """A ``tqdm`` stand-in that ``hf_hub_download`` drives with each chunk's bytes (its
    ``initial`` the bytes a resumed download already had): it reports the bytes of every file
    so far (``before`` this one) of ``total`` to ``progress``, which may raise to cancel."""

    class Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = int(kwargs.get("initial") or 0)
            self.total = kwargs.get("total")
            progress("download", min(before + self.n, total), total)

        def update(self, n: float | None = 1) -> None:
            self.n += int(n or 0)
            progress("download", min(before + self.n, total), total)

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def close(self) -> None:
            pass

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            pass

    return Bar
