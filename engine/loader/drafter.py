"""Speculative decoding wired into an engine: the drafter a ``--speculative`` setting names
(a self-draft or a draft model is loaded here, which is why this lives with the loader), its
costs measured on this machine, and the speculator the engine's step then asks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.speculative.adaptive import measure_costs
from engine.speculative.config import SpeculativeConfig, same_drafter
from engine.speculative.drafters import Drafter, LookupDrafter, ModelDrafter
from engine.speculative.speculator import Speculator

log = logging.getLogger(__name__)

#: loads a model folder into an engine: :func:`engine.loader.load.load_model`, handed in by it
#: (this module is what it wires into the engines it makes)
Loader = Callable[..., LLMEngine]


def speculation(
    config: SpeculativeConfig, target: LLMEngine, old: Speculator | None, *, load: Loader
) -> Speculator:
    """The speculator for ``config`` on ``target`` (its ``speculation`` factory): ``old``'s
    drafter kept where only k or the adaptive settings change, else a new drafter built
    (with ``load`` where it needs a model) and its costs measured first, so that a failure
    leaves ``old`` in place; ``old`` is closed once replaced."""
    if old is not None and same_drafter(old.config, config):
        return old.with_config(config)
    drafter = build_drafter(config, target, load)
    try:
        verify, draft = measure_costs(
            target.model, target.kv, drafter, config.k, config.verify_cost
        )
    except BaseException:
        drafter.close()
        raise
    if old is not None:
        old.close()
    log.info(
        "speculative decoding: %s, k up to %d; here verifying k drafts costs %.2f + "
        "%.3f·k of a decode step, a draft token %.2f", config.label, config.k,
        verify.fixed, verify.per_token, draft,
    )  # fmt: skip
    return Speculator(config, drafter, verify, draft)


def build_drafter(config: SpeculativeConfig, target: LLMEngine, load: Loader) -> Drafter:
    """The drafter ``config`` names, for ``target``: a self-draft loads the target's folder
    once more at the draft precision; a draft model loads its folder at the target's
    precision. Raises :class:`InvalidRequestError` / ``ModelLoadError`` with what to do."""
    if config.method == "lookup":
        return LookupDrafter(config.ngram_min, config.ngram_max)
    if config.method == "self":
        if target.folder is None:
            raise InvalidRequestError(
                "self-speculation loads the target's folder again, and this engine was not "
                "loaded from one; use lookup or model:DIR"
            )
        folder, precision = target.folder, config.precision or ""
    else:
        assert config.model_dir is not None
        folder, precision = Path(config.model_dir).expanduser(), target.precision.text
        if not (folder / "config.json").is_file():
            raise InvalidRequestError(
                f"the draft model folder {folder} has no config.json; give model:DIR with a "
                "Hugging Face folder of a smaller model that uses this model's tokenizer"
            )
    # The draft engine only lends its model: a one-block pool, no prefix caching.
    draft = load(
        folder, precision=precision, device=str(target.device),
        config=EngineConfig(num_blocks=1, prefix_caching=False,
                            decode_graph=target.config.decode_graph,
                            cpu_experts=target.config.cpu_experts),
    )  # fmt: skip
    return ModelDrafter.from_engine(config.label, draft, target, config.draft_blocks)
