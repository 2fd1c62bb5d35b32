"""The KV cache's formats: what a slot of the paged pool holds, and how K/V become it.

A float pool holds each token's K heads then V heads in the model's compute dtype,
``[slots, 2·Hkv, D]``. A quantized pool (``int8``, ``fp8`` e4m3) holds each head's row of
``D`` values in one byte each, followed by that row's fp32 scale in the next four bytes:
``[slots, 2·Hkv, D + 4]`` of the storage dtype. So K and V of every token and head are
scaled apart (the scale of a row is its absolute maximum over ``qmax``), the scale sits in
the same cache line as the values it scales, and the pool stays one tensor per layer that
every path already passes (block tables, CUDA graphs' static tables, tensor-parallel ranks,
the C step's pool pointers). A quantized row dequantizes as ``value · scale`` in fp32.

Quantizing is :func:`quantize` (the torch paths' write, and the reference of the C and Triton
writes): the row's fp32 maximum of ``|x|``, ``scale = amax / qmax``, each value
``x / scale`` rounded to nearest even (int8) or cast (fp8, saturating at ±448). A row of
zeros has scale 0 and holds zeros, as the pad slot does.

Which format a load takes (``--kv-dtype``) is :mod:`engine.kv_cache.dtypes`'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: the bytes of a quantized row's scale (fp32), after its values
SCALE_BYTES = 4

_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """A pool's storage: its ``name`` (``fp32``, ``fp16``, ``bf16``, ``int8``, ``fp8``), the
    tensor's dtype, and for a quantized one the largest magnitude a scaled value takes."""

    name: str
    storage: torch.dtype
    qmax: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    def width(self, head_dim: int) -> int:
        """Elements of one head's row in a slot: ``D``, or ``D`` values and the scale's bytes."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_head(self, head_dim: int) -> int:
        """The bytes one token's K (or V) of one KV head takes in the pool."""
        return self.width(head_dim) * self.storage.itemsize

    def empty(self, slots: int, kv_heads: int, head_dim: int, device: torch.device | str) -> Tensor:
        """A pool of ``slots`` slots, uninitialised but for its last (the pad slot: zeros,
        read by masked gathers, where 0 × garbage may be NaN)."""
        pool = torch.empty(
            (slots, 2 * kv_heads, self.width(head_dim)), dtype=self.storage, device=device
        )
        pool[-1].view(torch.uint8).zero_()
        return pool


INT8 = KVFormat("int8", torch.int8, 127.0)
FP8 = KVFormat("fp8", torch.float8_e4m3fn, 448.0)
_QUANTIZED = {f.storage: f for f in (INT8, FP8)}
QUANTIZED = tuple(_QUANTIZED.values())


def named(name: str) -> KVFormat:
    """The format called ``name`` (:attr:`KVFormat.name`)."""
    for fmt in QUANTIZED:
        if fmt.name == name:
            return fmt
    return KVFormat(name, _FLOATS[name])


def float_format(dtype: torch.dtype) -> KVFormat:
    """The float pool of the compute dtype ``dtype``."""
    name = next(n for n, d in _FLOATS.items() if d == dtype)
    return KVFormat(name, dtype)


def of_pool(pool: Tensor) -> KVFormat:
    """The format of ``pool`` (a float pool's is its dtype's)."""
    return _QUANTIZED.get(pool.dtype) or float_format(pool.dtype)


def quantized(pool: Tensor) -> bool:
    """Whether ``pool`` holds quantized rows (values, then their scale)."""
    return pool.dtype in _QUANTIZED


def head_dim(pool: Tensor) -> int:
    """The head size of the rows ``pool`` holds."""
    return pool.shape[-1] - SCALE_BYTES if quantized(pool) else pool.shape[-1]


def quantize(kv: Tensor, fmt: KVFormat) -> Tensor:
    """Rows ``kv: [..., D]`` (any float dtype) as ``fmt`` stores them, ``[..., D + 4]``."""
    x = kv.float()
    scale = x.abs().amax(-1, keepdim=True) / fmt.qmax
    scaled = x / torch.where(scale > 0, scale, 1.0)
    if fmt is INT8:
        values = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    packed = torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
    return packed.view(fmt.storage)


def dequantize(rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Quantized rows ``[..., D + 4]`` as their values ``[..., D]`` in ``dtype`` (each
    ``value · scale`` in fp32, then cast)."""
    dim = rows.shape[-1] - SCALE_BYTES
    scales = rows[..., dim:].contiguous().view(torch.float32)
    out = rows[..., :dim].float().mul_(scales)  # one fp32 copy, scaled in place
    return out if dtype == torch.float32 else out.to(dtype)


def gathered_bytes(fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> int:
    """The bytes :func:`gather` holds at once for one head's row into ``dtype``: the row,
    and where it is quantized its fp32 values and their cast."""
    if not fmt.quantized:
        return head_dim * dtype.itemsize
    cast = 0 if dtype == torch.float32 else head_dim * dtype.itemsize
    return fmt.bytes_per_head(head_dim) + 4 * head_dim + cast


def store(pool: Tensor, slots: Tensor, kv: Tensor) -> None:
    """Write this step's ``kv: [T, 2·Hkv, D]`` at ``slots`` of ``pool``, quantized as it goes
    in where the pool is."""
    fmt = _QUANTIZED.get(pool.dtype)
    if fmt is None:
        pool.index_copy_(0, slots, kv)
    else:  # as bytes: torch copies no fp8 by index on every device
        pool.view(torch.uint8).index_copy_(0, slots, quantize(kv, fmt).view(torch.uint8))


def gather(pool: Tensor, index: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows of ``pool`` at ``index`` (a slot index of any shape), as values in ``dtype``:
    only the gathered rows are dequantized, never the pool."""
    if quantized(pool):  # as bytes, as store writes them
        return dequantize(pool.view(torch.uint8)[index].view(pool.dtype), dtype)
    rows = pool.index_select(0, index) if index.dim() == 1 else pool[index]
    return rows if rows.dtype == dtype else rows.to(dtype)
