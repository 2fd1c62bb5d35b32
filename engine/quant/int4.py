"""The INT4 linear: group-wise INT4 weights packed for torch's INT4 kernels.

On CPU ``_weight_int4pack_mm_for_cpu``, on CUDA ``_weight_int4pack_mm`` (sm80+), both with bf16
activations. Where the input width K does not fit a kernel (it must be a multiple of the group
and of 32), K is padded with zero columns and the load report says so. There is no fallback: a
device without the kernel refuses INT4 by name when the spec is parsed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.formats import pack_int4_cuda, quantize_int4, row_chunks
from engine.hardware.cpu_paths import cpu_paths


def _inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"K={k} is not a multiple of 32")


def padded_width(k: int, group: int) -> int:
    """Smallest K' ≥ K that the INT4 kernels accept for ``group`` (a multiple of it and 32)."""
    step = max(group, 32)
    return -(-k // step) * step


class Int4Linear(nn.Module):
    quantized = True
    weight: Tensor
    scales_and_zeros: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None, group: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = group
        k = padded_width(self.in_features, group)
        self.padded_k = k - self.in_features
        # The CPU packing also wants N divisible by 16: extra zero rows, sliced off the output.
        self.padded_n = -(-self.out_features // 16) * 16 - self.out_features
        self.on_cuda = weight.device.type == "cuda"
        tiles = self.inner_k_tiles = _inner_k_tiles(k)
        packed, scale, zero = self._quantize_and_pack(weight, k, tiles)
        # [K/group, N, 2]: (scale, zero) per group and output channel, as the kernels want.
        sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def _quantize_and_pack(self, weight: Tensor, k: int, tiles: int) -> tuple[Tensor, ...]:
        """Quantize ``weight`` (padded to ``[N + padded_n, k]`` with zeros) a chunk of rows at a
        time and pack it for the kernel: beside ``weight``, only the packed result and one
        chunk's temporaries exist. The CPU packing lays rows out in independent blocks
        (``cpu_paths().int4_block_rows``), so chunks of whole blocks are packed one by one;
        for CUDA the 4-bit values are kept a byte each (a quarter of fp32) and packed once."""
        n = self.out_features + self.padded_n
        block = None if self.on_cuda else cpu_paths().int4_block_rows
        chunks = row_chunks(n, k, block or 1) if self.on_cuda or block else [slice(0, n)]
        values = None
        if self.on_cuda:
            values = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
        packed_rows: list[Tensor] = []
        scales: list[Tensor] = []
        zeros: list[Tensor] = []
        for rows in chunks:
            chunk = weight[rows].float()
            pad_rows = rows.stop - rows.start - chunk.shape[0]
            if self.padded_k or pad_rows:
                chunk = F.pad(chunk, (0, self.padded_k, 0, pad_rows))
            q, scale, zero = quantize_int4(chunk, self.group)
            if values is not None:
                values[rows] = q
            else:
                packed_rows.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles))
            scales.append(scale)
            zeros.append(zero)
        packed = pack_int4_cuda(values, tiles) if values is not None else torch.cat(packed_rows)
        return packed, torch.cat(scales), torch.cat(zeros)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.padded_k:
            x2 = F.pad(x2, (0, self.padded_k))
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                x2, self.weight, self.group, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight, self.group, self.scales_and_zeros
            )
        if self.padded_n:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_and_zeros))

    kernel = "int4 kernel"  # the only INT4 path: without it INT4 is refused at parse time

    def extra_repr(self) -> str:
        pad = f", K padded +{self.padded_k}" if self.padded_k else ""
        size = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{size}, int4 g{self.group}{pad}"
