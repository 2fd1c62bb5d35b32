"""Loading a model, the same way for every front end (the app's worker, every CLI command).

:func:`load_engine` takes a :class:`LoadSpec`: the model (``"default"``, pulled once; a model
folder; or a ``.gguf`` file, imported once into the model store), a precision and a device.
Device ``"auto"`` is CUDA when torch sees one, else the CPU; an explicit device that is not
there is refused with a message before anything is downloaded or read.

Importing this module is cheap (no torch): ``infersight --help`` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.loader.memory_plan import MemoryPlan
    from engine.store.catalog import Discovery

#: ``progress(stage, done, total)``: download, dequantize, write, load
Progress = Callable[[str, int, int], None]

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A model to load: ``"default"``, a model folder or a ``.gguf`` file."""

    model: str = "default"
    precision: str = "fp32"
    device: str = AUTO  # "auto", "cpu", "cuda", "cuda:1" …
    #: size of the paged KV pool; None: the load's choice (a GPU's pool profiled,
    #: :mod:`engine.core.pool_profile`; :data:`CPU_POOL_MIB` on a CPU)
    kv_memory_mib: float | None = 512.0
    #: processes the model is split over (tensor parallelism, :mod:`engine.loader.parallel`)
    tensor_parallel: int = 1
    #: what the KV cache holds (``--kv-dtype``: :mod:`engine.kv_cache.dtypes`)
    kv_dtype: str = "auto"


#: the KV pool of a load on a CPU that leaves its size to the load
CPU_POOL_MIB = 512.0


def resolve_device(device: str) -> str:
    """``"auto"`` → ``"cuda"`` when torch sees a CUDA device, else ``"cpu"``. Any other name is
    checked: a device that does not exist raises :class:`InvalidRequestError`."""
    import torch

    name = device.strip().lower()
    if name == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(name)
    except RuntimeError:
        raise InvalidRequestError(
            f"unknown device {device!r}; use auto, cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cpu":
        return name
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidRequestError(
                f"device {device!r} is not available: torch sees no CUDA device (a CPU build "
                "of torch, or no driver); use --device auto or cpu"
            )
        if parsed.index is not None and parsed.index >= count:
            raise InvalidRequestError(
                f"device {device!r} does not exist: torch sees {count} CUDA device(s), "
                f"cuda:0 … cuda:{count - 1}"
            )
        return name
    raise InvalidRequestError(f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N")


def resolve_model_folder(model: str, progress: Progress | None = None) -> Path:
    """The model folder for ``model``: ``"default"`` (pulled on first use), a folder, or a
    ``.gguf`` file (imported into the model store once, reused after)."""
    from engine.store.model_store import import_into_store, resolve_model

    path = Path(model).expanduser()
    if model != "default" and path.suffix.lower() == ".gguf":
        return import_into_store(path, progress=progress)
    return resolve_model(model, progress=progress)


def needs_download(model: str) -> bool:
    """Whether resolving ``model`` would download it first (the default model, not pulled)."""
    from engine.store.model_store import default_model_path

    return model == "default" and not (default_model_path() / "config.json").is_file()


def engine_config(spec: LoadSpec) -> EngineConfig:
    """The engine config a load of ``spec`` uses: a KV pool of ``spec.kv_memory_mib``, or
    where that is None, a GPU's profiled pool (no size given) and :data:`CPU_POOL_MIB` on a
    CPU."""
    from engine.core.config import EngineConfig

    mib = spec.kv_memory_mib
    if mib is None and not resolve_device(spec.device).startswith("cuda"):
        mib = CPU_POOL_MIB
    return EngineConfig(kv_memory=None if mib is None else mib * 2**20, kv_dtype=spec.kv_dtype)


def plan_load(
    spec: LoadSpec,
    progress: Progress | None = None,
    *,
    config: EngineConfig | None = None,
    reclaimable: int = 0,
) -> MemoryPlan:
    """The memory plan of loading ``spec`` here
    (:func:`engine.loader.memory_plan.plan_memory`), with ``reclaimable`` bytes added to what
    the device has free (a model that would be unloaded first). Reads only the model's config:
    a GGUF file's header (so that a model that cannot fit is refused before it is imported), a
    folder's ``config.json`` (the default model is pulled once)."""
    from engine.loader.memory_plan import plan_memory
    from engine.model.config import ModelConfig
    from engine.quant.spec import parse_precision_spec
    from engine.store.gguf_reader import gguf_model_config

    device = resolve_device(spec.device)
    parse_precision_spec(spec.precision, device)  # fail on a bad precision before any download
    path = Path(spec.model).expanduser()
    if spec.model != "default" and path.suffix.lower() == ".gguf":
        cfg, name = gguf_model_config(path), path.stem
    else:
        folder = resolve_model_folder(spec.model, progress)
        cfg, name = ModelConfig.from_file(folder / "config.json"), folder.name
    return plan_memory(
        cfg,
        spec.precision,
        device,
        config=config or engine_config(spec),
        reclaimable=reclaimable,
        name=name,
    )


def load_engine(
    spec: LoadSpec,
    progress: Progress | None = None,
    *,
    config: EngineConfig | None = None,
) -> LLMEngine:
    """Resolve the device and the model, plan its memory, then load. ``config`` (KV pool,
    limits, window) defaults to a pool of ``spec.kv_memory_mib``. The precision and device are
    checked before any download or conversion, and a load that the plan says cannot fit is
    refused before it starts (:class:`engine.errors.OutOfMemoryError`, with the numbers and
    a precision or context that would fit)."""
    from engine.loader.memory_plan import check_plan

    config = config or engine_config(spec)
    check_plan(plan_load(spec, progress, config=config))
    folder = resolve_model_folder(spec.model, progress)
    if progress:
        progress("load", 0, 1)
    device = resolve_device(spec.device)
    from engine.loader.load import load_model

    engine = load_model(
        folder, precision=spec.precision, device=device, config=config,
        tensor_parallel=spec.tensor_parallel, progress=progress,
    )  # fmt: skip
    if progress:
        progress("load", 1, 1)
    return engine


def sampling_kwargs(
    model_default: Mapping[str, Any], overrides: Mapping[str, Any | None]
) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments: the model's defaults (``engine.default_sampling``),
    then every override that is not ``None``."""
    out = dict(model_default)
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


def gpu_count() -> int:
    """The CUDA devices torch sees (a query, no work on a device)."""
    import torch

    return torch.cuda.device_count()


def available_devices() -> list[str]:
    """``auto`` (CUDA when torch sees one, else the CPU), ``cpu`` and every CUDA device torch
    can see (a query, no work on a device)."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["auto", "cpu"] + [f"cuda:{i}" for i in range(cuda)]


def scan_models(
    folders: list[Path], precision: str, device: str, reclaimable: int = 0
) -> Discovery:
    """The model picker's scan (off the UI thread): every model found, planned on the device
    as chosen (``auto`` resolved), counting the memory that unloading the current model
    (``reclaimable`` bytes) would give back, as a load does."""
    from engine.store.planning import discover_and_plan

    return discover_and_plan(folders, precision, resolve_device(device), reclaimable=reclaimable)
