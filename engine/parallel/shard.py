"""Megatron-style tensor parallelism: which part of each weight one rank of N holds.

A decoder layer splits along the heads and the MLP's intermediate channels, so that each rank
computes its part of a layer from the whole hidden state and one sum across the ranks joins
the parts, twice a layer:

* ``qkv_proj`` and ``gate_up_proj`` are column-parallel: a rank holds the rows of its query
  heads, of the KV heads they read, and of its slice of the intermediate channels (gate and
  up alike). Its attention and SiLU · up run on its heads and channels alone.
* ``o_proj`` and ``down_proj`` are row-parallel: a rank holds the columns of the same heads
  and channels, so its product is a partial sum of the layer's output; an all-reduce adds the
  ranks' parts (:attr:`engine.model.transformer.Transformer.all_reduce`).
* The embedding and the LM head (float or quantized) split by vocabulary rows, in whole
  blocks of :data:`VOCAB_UNIT`: a rank looks up the tokens in its rows (zeros for the
  others) and an all-reduce joins the rows; it computes the logits of its rows and an
  all-gather joins them. The norms are whole on every rank.

Heads go to ranks whole and in order, KV head by KV head with its group of query heads (GQA
stays local): with fewer KV heads than ranks, each KV head is held by ``N / Hkv`` ranks, which
share its query heads. Counts need not divide: SmolLM2's 3 KV heads over 2 ranks give 2 and 1
(6 and 3 query heads). The intermediate channels split in blocks of ``align`` (an INT4 group,
so that no group straddles two ranks), as evenly as the blocks allow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig


def _split(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``total`` split into ``parts`` runs of whole
    ``unit``s, the first ones a unit longer where they do not divide."""
    units = total // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return start * unit, min(stop * unit, total) if index < parts - 1 else total


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``world``: its KV heads, query heads and intermediate channels."""

    rank: int
    world: int
    kv_heads: tuple[int, ...]
    heads: tuple[int, ...]
    inter: tuple[int, int]
    head_dim: int
    full: ModelConfig
    #: ``[start, stop)`` of the vocabulary whose embedding rows and LM head rows this rank
    #: holds (vocabulary parallelism), or None: both whole on every rank
    vocab: tuple[int, int] | None = None

    @property
    def local(self) -> ModelConfig:
        """The config of this rank's part: its head counts and intermediate size (the rest,
        the hidden size and vocabulary among it, whole)."""
        return replace(
            self.full,
            num_heads=len(self.heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=self.inter[1] - self.inter[0],
        )

    def _rows(self, heads: tuple[int, ...]) -> Tensor:
        d = self.head_dim
        return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])

    def qkv_rows(self) -> Tensor:
        """Rows of the fused ``[q; k; v]`` weight (and bias) this rank holds."""
        full = self.full
        q = self._rows(self.heads)
        k = self._rows(self.kv_heads) + full.q_size
        v = self._rows(self.kv_heads) + full.q_size + full.kv_size
        return torch.cat([q, k, v])

    def gate_up_rows(self) -> Tensor:
        start, stop = self.inter
        gate = torch.arange(start, stop)
        return torch.cat([gate, gate + self.full.intermediate_size])

    def slice(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the parameter ``name`` (our name, whole as the checkpoint
        gives it): rows of a column-parallel product, columns of a row-parallel one, the
        tensor itself where every rank holds all of it."""
        if name.endswith("attn.qkv_proj.weight") or name.endswith("attn.qkv_proj.bias"):
            return tensor.index_select(0, self.qkv_rows().to(tensor.device))
        if name.endswith("attn.o_proj.weight"):
            return tensor.index_select(1, self._rows(self.heads).to(tensor.device))
        if name.endswith("mlp.gate_up_proj.weight"):
            return tensor.index_select(0, self.gate_up_rows().to(tensor.device))
        if name.endswith("mlp.down_proj.weight"):
            return tensor[:, self.inter[0] : self.inter[1]]
        if self.vocab is not None and name in ("embed.weight", "lm_head.weight"):
            return tensor[self.vocab[0] : self.vocab[1]]
        return tensor


#: the vocabulary splits in runs of whole blocks of this many rows: the rows a CPU INT4
#: layout packs together (64, 32 or 16: :func:`engine.formats.int4.cpu_int4_block_rows`), so
#: that a tied INT4 head's rows of one rank still serve its embedding lookups
VOCAB_UNIT = 64


def vocab_per_rank(vocab_size: int, world: int) -> int:
    """Rows each rank holds of a vocabulary split ``world`` ways (the last one fewer):
    ``⌈V / N⌉`` rounded up to whole :data:`VOCAB_UNIT` blocks."""
    per = -(-vocab_size // world)
    return -(-per // VOCAB_UNIT) * VOCAB_UNIT


def vocab_rows(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of a vocabulary split ``world`` ways: runs of
    :func:`vocab_per_rank`, the last one shorter (a gather of the ranks' logits pads it)."""
    per = vocab_per_rank(vocab_size, world)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def plan(cfg: ModelConfig, rank: int, world: int, align: int = 1, *, vocab: bool = False) -> Shard:
    """Rank ``rank``'s part of ``cfg``'s model split ``world`` ways (``align``: the block the
    intermediate channels split in; ``vocab``: the embedding and LM head split by vocabulary
    rows too). Refused with what to do where a rank would get no query head or no channel,
    or where KV heads cannot be shared out evenly."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}")
    if cfg.num_experts and world > 1:
        raise InvalidRequestError(
            "tensor parallelism does not split a mixture of experts yet; load it on one "
            "device (without --tensor-parallel)"
        )
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    group = heads // kv_heads
    if world <= kv_heads:
        start, stop = _split(kv_heads, world, rank)
        kv = tuple(range(start, stop))
        q = tuple(h for k in kv for h in range(k * group, (k + 1) * group))
    else:
        if world % kv_heads or group < world // kv_heads:
            raise InvalidRequestError(
                f"--tensor-parallel {world} cannot share this model's {kv_heads} KV heads "
                f"({heads} query heads) out evenly: use a divisor or a multiple of {kv_heads} "
                f"up to {heads}"
            )
        sharing = world // kv_heads  # ranks per KV head
        k = rank // sharing
        start, stop = _split(group, sharing, rank % sharing)
        kv = (k,)
        q = tuple(range(k * group + start, k * group + stop))
    # blocks of whole INT4 groups (the last one may be short: the whole model pads it too)
    unit = align if cfg.intermediate_size // align >= world else 1
    if cfg.intermediate_size // unit < world:
        raise InvalidRequestError(
            f"--tensor-parallel {world} leaves a rank without MLP channels "
            f"({cfg.intermediate_size} in blocks of {unit}); use fewer ranks"
        )
    inter = _split(cfg.intermediate_size, world, rank, unit)
    rows = vocab_rows(cfg.vocab_size, rank, world) if vocab and world > 1 else None
    return Shard(rank, world, kv, q, inter, cfg.head_dim, cfg, rows)
