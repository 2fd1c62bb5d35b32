"""The INT8 and INT4 formats: the arithmetic that makes and reads the low-bit values, and
where torch's packed INT4 tensors keep each value.

* **INT8**: per output channel, symmetric: ``w ≈ q · s``, ``q ∈ [-127, 127]``, ``s = max|w| / 127``.
* **INT4**: group-wise (32, 64 or 128 input channels), asymmetric: ``w ≈ (q − 8) · s + z``,
  ``q ∈ [0, 15]``, one ``(s, z)`` per group.

The packed INT4 layouts (CPU and CUDA) are torch's own and change between builds, so they are
found by probing (:func:`cpu_int4_block_rows`, :func:`probe_int4_layout`), never assumed: a
tied, quantized LM head reads its embedding rows straight from them. This module is pure math
on tensors, below everything else in the engine: the CPU probes
(:mod:`engine.hardware.cpu_paths`) and the quantized layers (:mod:`engine.quant`) both build
on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# -- INT8 -------------------------------------------------------------------------------------


def quantize_int8(w: Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per-row symmetric INT8: ``(q int8 [N, K], scale [N])`` with ``w ≈ q · scale``.

    The scale is rounded to ``scale_dtype`` *before* ``q`` is computed against it, so that
    dequantization in that dtype is exactly ``q · scale``. Rows are quantized a chunk at a
    time (:func:`row_chunks`): beside ``w``, only the int8 result and one chunk's fp32
    temporaries exist."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=scale_dtype, device=w.device)
    for rows in row_chunks(n, w.shape[1]):
        chunk = w[rows].float()
        s = (chunk.abs().amax(dim=1) / 127).clamp(min=1e-12).to(scale_dtype)
        q[rows] = torch.round(chunk / s.float()[:, None]).clamp_(-127, 127)
        scale[rows] = s
    return q, scale


#: fp32 bytes of weight rows quantized at once: bounds a quantization's temporaries
QUANT_CHUNK_BYTES = 32 * 2**20


def row_chunks(n: int, k: int, multiple: int = 1) -> list[slice]:
    """Slices of ``n`` rows of width ``k``, each about :data:`QUANT_CHUNK_BYTES` in fp32 and
    a multiple of ``multiple`` rows long (the last one may be shorter)."""
    rows = max(multiple, QUANT_CHUNK_BYTES // (4 * k) // multiple * multiple)
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


# -- INT4 -------------------------------------------------------------------------------------


def quantize_int4(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise asymmetric INT4 of ``w [N, K]`` (K divisible by ``group``):
    ``(q int32 [N, K] in 0..15, scale bf16 [N, K/group], zero bf16 [N, K/group])``,
    ``w ≈ (q − 8) · scale + zero`` (the convention of torch's int4 kernels)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    # A hair of slack before bf16 rounding keeps the grid covering [lo, hi] afterwards.
    scale = ((hi - lo) / 15 * (1 + 2**-7)).clamp(min=1e-8).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8)
    return q.clamp(0, 15).to(torch.int32).reshape(n, k), scale, zero


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor, group: int) -> Tensor:
    n, k = q.shape
    g = q.float().reshape(n, k // group, group) - 8
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


# -- our INT4 layout (the C kernels' and the Triton kernels') -------------------------------

#: the columns one packed block holds (llama.cpp's Q4 block)
INT4_BLOCK = 32


def pack_int4(q: Tensor) -> Tensor:
    """Our INT4 layout of ``q`` (``[N, K]`` integers in 0..15, K a multiple of 32, as
    :func:`quantize_int4` gives them): uint8 ``[N, K/2]`` in blocks of 32 columns, byte ``j``
    of block ``c`` holding column ``32c + j`` in its low nibble and ``32c + 16 + j`` in its
    high one (llama.cpp's Q4 order): either nibble's 16 columns of ``x`` are then contiguous.
    Our C kernels (:mod:`engine.kernels.lowbit`) and our Triton kernels
    (:mod:`engine.kernels.triton_kernels.quant_gemm`) both read it; each row packs by itself,
    so rows can be packed a chunk at a time and read back one by one."""
    n, k = q.shape if q.dim() == 2 else (0, 1)
    if k % INT4_BLOCK:
        raise ValueError(f"pack_int4 takes [N, K] values with K a multiple of 32, not {q.shape}")
    halves = q.to(torch.uint8).view(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """The values of rows packed by :func:`pack_int4`: int32 ``[T, K]`` in 0..15."""
    v = packed.to(torch.int32).view(packed.shape[0], -1, 1, INT4_BLOCK // 2)
    return torch.cat([v & 15, v >> 4], dim=2).reshape(packed.shape[0], -1)


# -- reading rows back from the CPU INT4 layout -----------------------------------------------


def cpu_int4_block_rows() -> int | None:
    """Rows per block of ``_convert_weight_to_int4pack_for_cpu``'s layout, found by probing.

    The CPU packing interleaves blocks of rows: byte ``[b, k, j]`` of ``packed.view(N / B, K,
    B / 2)`` holds row ``b·B + j`` in its low nibble and row ``b·B + B/2 + j`` in its high one.
    B depends on the build (64 with AVX-512). ``None`` if no B matches: then a tied embedding
    keeps its own 4-bit copy.
    """
    gen = torch.Generator().manual_seed(0)
    for block in (64, 32, 16):
        q = torch.randint(0, 16, (2 * block, 64), generator=gen, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        rows = torch.arange(2 * block)
        if packed.shape == (2 * block, 32) and torch.equal(
            _read_int4_rows(packed, rows, block, 64), q
        ):
            return block
    return None


def _read_int4_rows(packed: Tensor, rows: Tensor, block: int, k: int) -> Tensor:
    half = block // 2
    view = packed.view(-1, k, half)
    within = rows % block
    data = view[rows // block, :, within % half].to(torch.int32)  # [T, K]
    return torch.where((within < half)[:, None], data & 15, data >> 4)


# -- reading rows back from the CUDA INT4 layout ----------------------------------------------


def pack_int4_cuda(q: Tensor, tiles: int) -> Tensor:
    """``_convert_weight_to_int4pack`` of ``q`` (int32 [N, K], 0..15): it takes two values a
    byte, the even column in the high nibble."""
    return torch.ops.aten._convert_weight_to_int4pack(
        (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles
    )


@dataclass(frozen=True, slots=True)
class Int4TileLayout:
    """Where torch's CUDA INT4 packing keeps each value, so embedding rows can be read from it.

    The packed int32 tensor is a run of tiles of ``tile_rows × tile_cols`` values, ordered by
    row tile, then column tile (a tile is what one warp loads: 8 × 16·inner-k-tiles values with
    NVIDIA's m16n8k16 layout, 16 rows on ROCm). Inside a tile, value ``(r, c)`` is the 4 bits
    at ``shift[r, c]`` of int32 word ``word[r, c]``. Found by :func:`cuda_int4_layout`.
    """

    tile_rows: int
    tile_cols: int
    word: Tensor  # int64 [tile_rows, tile_cols]
    shift: Tensor  # int32 [tile_rows, tile_cols]

    def read_rows(self, packed: Tensor, rows: Tensor, k: int) -> Tensor:
        """Rows ``rows`` (int [T]) of the [N, k] matrix packed in ``packed``: int32 [T, k]."""
        col_tiles = k // self.tile_cols
        words = packed.reshape(-1, col_tiles, self.tile_rows * self.tile_cols // 8)
        within = rows % self.tile_rows
        index = self.word[within][:, None, :].expand(-1, col_tiles, -1)
        data = words[rows // self.tile_rows].gather(2, index) >> self.shift[within][:, None, :]
        return (data & 15).reshape(len(rows), k)


def _nibbles(packed: Tensor) -> Tensor:
    """Every 4-bit value of an int32 tensor, word by word, lowest bits first."""
    words = packed.reshape(-1, 1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=packed.device)
    return ((words >> shifts) & 15).reshape(-1)


def _layout_from(location: Tensor, tile_rows: int, tile_cols: int) -> Int4TileLayout | None:
    """The tile layout that explains ``location`` (value (r, c) → its nibble), if tiles of
    ``tile_rows × tile_cols`` in row-tile-major order do."""
    rows, cols = location.shape
    size = tile_rows * tile_cols
    tile = location[:tile_rows, :tile_cols]
    if rows % tile_rows or cols % tile_cols or int(tile.max()) >= size:
        return None
    r = torch.arange(rows, device=location.device)[:, None]
    c = torch.arange(cols, device=location.device)[None, :]
    start = ((r // tile_rows) * (cols // tile_cols) + c // tile_cols) * size
    if not torch.equal(start + tile[r % tile_rows, c % tile_cols], location):
        return None
    return Int4TileLayout(tile_rows, tile_cols, tile // 8, ((tile % 8) * 4).to(torch.int32))


def probe_int4_layout(
    device: torch.device, tiles: int, pack: Callable[[Tensor, int], Tensor] = pack_int4_cuda
) -> Int4TileLayout | None:
    """Find the packing's layout by packing a probe matrix whose values spell, hex digit by hex
    digit, their own position; then check it by reading a random matrix back exactly.

    Nothing about the kernel's layout is assumed beyond "a permutation of 4-bit values in
    tiles", so a torch that changes it gets ``None`` (and a clear refusal), never wrong rows.
    """
    rows, cols = 64, 2 * 16 * tiles  # several row tiles of any plausible height, 2 column tiles
    count = rows * cols  # ≤ 16 384: four hex digits
    position = torch.arange(count, device=device, dtype=torch.int32).view(rows, cols)
    source = torch.zeros(count, dtype=torch.int64, device=device)
    for digit in range(4):
        nibbles = _nibbles(pack((position >> (4 * digit)) & 15, tiles))
        if nibbles.numel() != count:
            return None
        source += nibbles << (4 * digit)  # source[n]: the position nibble n came from
    everything = torch.arange(count, device=device)
    if not torch.equal(source.sort().values, everything):
        return None
    location = torch.empty_like(source)
    location[source] = everything
    gen = torch.Generator().manual_seed(0)
    check = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int32).to(device)
    packed, ids = pack(check, tiles), torch.arange(rows, device=device)
    for tile_rows in (8, 16, 32):
        layout = _layout_from(location.view(rows, cols), tile_rows, 16 * tiles)
        if layout is not None and torch.equal(layout.read_rows(packed, ids, cols), check):
            return layout
    return None


_CUDA_INT4_LAYOUTS: dict[tuple[str, int], Int4TileLayout | None] = {}


def cuda_int4_layout(device: torch.device, tiles: int) -> Int4TileLayout | None:
    """:func:`probe_int4_layout` once per device and inner-k-tile count."""
    key = (str(device), tiles)
    if key not in _CUDA_INT4_LAYOUTS:
        _CUDA_INT4_LAYOUTS[key] = probe_int4_layout(device, tiles, pack_int4_cuda)
        if _CUDA_INT4_LAYOUTS[key] is None:
            log.warning("cannot read rows from the CUDA INT4 layout on %s", device)
    return _CUDA_INT4_LAYOUTS[key]
