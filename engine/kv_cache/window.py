"""The cache window: which earlier tokens a query still sees.

A :class:`CacheWindow` keeps the ``sink`` first tokens and the last ``window`` tokens of each
sequence; the blocks that fall wholly between them are given back to the pool
(:meth:`~engine.kv_cache.block_manager.BlockManager.release_outside_window`).

A model with a sliding window of its own (Mistral's ``sliding_window``: query ``p`` sees keys
``> p - W``) is a hard limit under any cache window: both caches mask every key older than it,
whatever window a step asks for, and :func:`effective_window` is the window the engine runs
(and releases blocks) under.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class CacheWindow:
    """Keep the ``sink`` first tokens and the last ``window`` tokens of each sequence."""

    sink: int = 4
    window: int = 256

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 1:
            raise ValueError("cache window needs sink >= 0 and window >= 1")

    def visible(self, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Mask ``[Q, K]``: key visible to query (causal, sink or within the window)."""
        causal = key_pos[None, :] <= query_pos[:, None]
        recent = key_pos[None, :] > query_pos[:, None] - self.window
        return causal & ((key_pos[None, :] < self.sink) | recent)


def effective_window(user: CacheWindow | None, sliding_window: int | None) -> CacheWindow | None:
    """The cache window a model with ``sliding_window`` (None: none) runs under when its user
    asks for ``user``: the user's, which must lie within the model's (no sink: a Mistral never
    sees its first tokens again; at most ``sliding_window`` recent tokens), or, with none, the
    model's own, ``CacheWindow(sink=0, window=sliding_window)``."""
    if sliding_window is None:
        return user
    if user is None:
        return CacheWindow(sink=0, window=sliding_window)
    if user.sink or user.window > sliding_window:
        raise InvalidRequestError(
            f"this model attends to its last {sliding_window} tokens only (its sliding window); "
            f"a cache window can only narrow that: use sink 0 and a window of at most "
            f"{sliding_window} tokens (not sink {user.sink}, window {user.window}), or none"
        )
    return user


def _one_window(
    window: CacheWindow | None, model_window: CacheWindow | None
) -> tuple[bool, CacheWindow | None]:
    """``(True, w)`` where a chunk's cache ``window`` and the model's own come to one window
    ``w`` (None: causal only); ``(False, None)`` where both apply."""
    if window is None or model_window is None or window == model_window:
        return True, window if window is not None else model_window
    return False, None


def _visible(
    window: CacheWindow | None,
    model_window: CacheWindow | None,
    key_pos: Tensor,
    query_pos: Tensor,
) -> Tensor:
    """Mask ``[Q, K]``: causal, within a chunk's cache ``window`` and the model's own."""
    one, only = _one_window(window, model_window)
    if not one:
        assert window is not None and model_window is not None
        return window.visible(key_pos, query_pos) & model_window.visible(key_pos, query_pos)
    if only is None:
        return key_pos[None, :] <= query_pos[:, None]
    return only.visible(key_pos, query_pos)
