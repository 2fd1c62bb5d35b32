"""What the model picker lists: a model found on disk, its memory plan, a scan's result.
Plain records, no torch: the picker's widgets import them (:mod:`engine.store.discovery`
finds the models, :mod:`engine.store.planning` plans them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.loader.memory_plan import MemoryPlan
    from engine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class DiscoveredModel:
    """One model found on disk. ``path`` is what the loader takes: a model folder (a store
    folder or a snapshot folder) or a ``.gguf`` file (imported once into the store)."""

    name: str
    path: Path
    source: str  # one of engine.store.discovery.SOURCES
    format: str  # "safetensors" or "gguf"
    architecture: str
    parameters: int
    disk_bytes: int
    config: ModelConfig | None = None


@dataclass(frozen=True, slots=True)
class PlannedModel:
    """A discovered model and its memory plan on one device at one precision (``None`` when
    it has no config to plan from, or the plan failed: ``plan_error`` says why)."""

    model: DiscoveredModel
    plan: MemoryPlan | None
    plan_error: str = ""


@dataclass(frozen=True, slots=True)
class Discovery:
    """What :func:`engine.store.planning.discover_and_plan` found, planned on ``device`` at
    ``precision``; ``note`` says why there are no plans at all, if there are none."""

    models: list[PlannedModel]
    precision: str
    device: str
    note: str = ""
