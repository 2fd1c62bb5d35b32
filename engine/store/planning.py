"""The models found on this machine, each with its memory plan at a precision: the model
picker's one call (:func:`discover_and_plan`). Apart from the finding
(:mod:`engine.store.discovery`), which imports no torch, so that the picker's widgets do not
either."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from engine.loader.memory_plan import plan_memory
from engine.store.catalog import DiscoveredModel, Discovery, PlannedModel
from engine.store.discovery import discover_models

log = logging.getLogger(__name__)


def plan_models(
    models: Iterable[DiscoveredModel],
    precision: str,
    device: str,
    *,
    memory: int | None = None,
    reclaimable: int = 0,
) -> list[PlannedModel]:
    """Each model with its memory plan on ``device`` (``"cpu"``, ``"cuda:0"`` …; not
    ``"auto"``) at ``precision`` (:func:`engine.loader.memory_plan.plan_memory`). A model
    whose plan fails gets ``plan=None`` and the reason. ``reclaimable``: bytes the model loaded
    now would give back (the app unloads it first when a new one fits only alone)."""
    out = []
    for model in models:
        if model.config is None:
            out.append(PlannedModel(model, None, "no config to plan from"))
            continue
        try:
            plan = plan_memory(
                model.config, precision, device, memory=memory, name=model.name,
                reclaimable=reclaimable,
            )  # fmt: skip
        except Exception as exc:  # one model's plan failing must not hide the others
            log.debug("discovery: no plan for %s: %s", model.name, exc)
            out.append(PlannedModel(model, None, str(exc)))
        else:
            out.append(PlannedModel(model, plan))
    return out


def discover_and_plan(
    folders: Iterable[Path],
    precision: str,
    device: str,
    *,
    memory: int | None = None,
    reclaimable: int = 0,
) -> Discovery:
    """:func:`~engine.store.discovery.discover_models` then :func:`plan_models`: the model
    picker's one call, made off the UI thread."""
    models = discover_models(folders)
    planned = plan_models(models, precision, device, memory=memory, reclaimable=reclaimable)
    return Discovery(planned, precision, device)
