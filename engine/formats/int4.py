"""INT4 weights: group-wise (32, 64 or 128 input channels), asymmetric:
``w ≈ (q − 8) · s + z``, ``q ∈ [0, 15]``, one bf16 ``(s, z)`` per group.

A kernel takes ``K`` padded with zero columns to a multiple of the group and of 32
(:func:`padded_width`). Three packings hold the values, one per backend (:class:`Packing`):

* :data:`OURS`: our C kernels' and our Triton kernels' (:func:`pack_int4`, llama.cpp's Q4
  order), each row by itself;
* :func:`torch_cpu`: ``_convert_weight_to_int4pack_for_cpu``'s, rows interleaved in blocks;
* :data:`TORCH_CUDA`: ``_convert_weight_to_int4pack``'s tiles.

Torch's two layouts are its own and change between builds, so where a weight's rows are read
back (a tied, quantized LM head serving the embedding) they are found by probing
(:func:`cpu_int4_block_rows`, :func:`probe_int4_layout`), never assumed. Each packing says the
bytes a weight holds in it and the temporaries its packing holds while loading: the memory
plan counts those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.formats import row_chunks

log = logging.getLogger(__name__)

# -- the values -------------------------------------------------------------------------------


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


def padded_width(k: int, group: int) -> int:
    """Smallest K' ≥ K that the INT4 kernels accept for ``group`` (a multiple of it and 32)."""
    step = max(group, 32)
    return -(-k // step) * step


def inner_k_tiles(k: int) -> int:
    """Torch's packing parameter for a padded width ``k``: the most 16-column tiles (8, 4 or
    2) a warp's load spans that divide it."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"K={k} is not a multiple of 32")


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


# -- one packing per backend -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Packing:
    """How one backend's kernels hold INT4 values: the packed matrix, with its bf16
    ``(scale, zero)`` pairs, packed and read back here alone.

    ``K`` is padded to :func:`padded_width`; torch's packings also pad ``N`` with zero rows to
    a multiple of 16 (``row_multiple``), sliced off the output. ``temporary_bytes_per_value``:
    what packing holds beside the weights while a matrix loads, per value of the padded matrix
    (ours and torch's CPU layout pack a chunk of rows at a time, whose packed chunks are joined
    at the end: half a byte a value; torch's CUDA packing takes the whole matrix's values a byte
    each, and its own temporaries: three bytes a value).
    """

    name: str
    row_multiple: int
    temporary_bytes_per_value: float
    #: rows per interleaved block of torch's CPU layout (:func:`cpu_int4_block_rows`; None where
    #: the probe found none: it then packs the matrix in one piece and its rows cannot be read)
    block: int | None = field(default=None, compare=False)

    def rows(self, n: int) -> int:
        """The packed matrix's rows for ``n`` output features."""
        return -(-n // self.row_multiple) * self.row_multiple

    def bytes_held(self, n: int, k: int, group: int) -> int:
        """Bytes of an ``[n, k]`` weight packed here: two values a byte of the padded matrix and
        a bf16 (scale, zero) pair per group and padded row."""
        rows, width = self.rows(n), padded_width(k, group)
        return rows * width // 2 + (width // group) * rows * 2 * 2

    def load_temporaries(self, n: int, k: int, group: int) -> int:
        """Bytes packing an ``[n, k]`` weight holds beside the weights while it loads, past the
        quantization's one chunk of fp32 rows (the memory plan's own term)."""
        return int(self.rows(n) * padded_width(k, group) * self.temporary_bytes_per_value)

    def pack(self, weight: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
        """Quantize ``weight [N, K]`` (any float dtype) and pack it: ``(packed, scale, zero)``,
        the scales and zeros ``[rows, K'/group]``. A chunk of rows at a time
        (:func:`engine.formats.row_chunks`; whole blocks of torch's CPU layout), so beside
        ``weight`` only the result and one chunk's temporaries exist; torch's CUDA packing
        keeps the values a byte each and packs them once."""
        n, k = weight.shape
        rows, width = self.rows(n), padded_width(k, group)
        cuda = self is TORCH_CUDA
        values = (
            torch.empty((rows, width), dtype=torch.uint8, device=weight.device) if cuda else None
        )
        multiple = self.block or 1
        whole = self.name == TORCH_CPU_NAME and self.block is None
        chunks = [slice(0, rows)] if whole else row_chunks(rows, width, multiple)
        packed: list[Tensor] = []
        scales: list[Tensor] = []
        zeros: list[Tensor] = []
        for chunk_rows in chunks:
            chunk = weight[chunk_rows].float()
            pad_rows = chunk_rows.stop - chunk_rows.start - chunk.shape[0]
            if width != k or pad_rows:
                chunk = torch.nn.functional.pad(chunk, (0, width - k, 0, pad_rows))
            q, scale, zero = quantize_int4(chunk, group)
            if values is not None:
                values[chunk_rows] = q
            elif self is OURS:
                packed.append(pack_int4(q))
            else:
                packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    q, inner_k_tiles(width)))  # fmt: skip
            scales.append(scale)
            zeros.append(zero)
        if values is not None:
            packed = [pack_int4_cuda(values, inner_k_tiles(width))]
        return torch.cat(packed), torch.cat(scales), torch.cat(zeros)

    def unreadable(self, device: torch.device, k: int, n: int) -> str:
        """Why rows of a weight packed here (``k``: its padded width, ``n``: its packed rows)
        cannot be read back on this torch build ("" where they can)."""
        if self is TORCH_CUDA and cuda_int4_layout(device, inner_k_tiles(k)) is None:
            return "this torch build packs CUDA INT4 weights in a layout Infersight cannot read"
        if self.name == TORCH_CPU_NAME and (self.block is None or n % self.block):
            return "this torch build packs INT4 weights in a layout Infersight cannot read"
        return ""

    def read_rows(self, packed: Tensor, rows: Tensor, k: int) -> Tensor:
        """Rows ``rows`` of the 4-bit values (0..15) packed in ``packed`` (``k``: the padded
        width): int32 ``[T, k]``."""
        if self is OURS:
            return unpack_int4(packed[rows])
        if self is TORCH_CUDA:
            layout = cuda_int4_layout(packed.device, inner_k_tiles(k))
            if layout is None:
                raise ValueError(self.unreadable(packed.device, k, 0))
            return layout.read_rows(packed, rows, k)
        if self.block is None:
            raise ValueError(self.unreadable(packed.device, k, 0))
        return _read_int4_rows(packed, rows, self.block, k)


TORCH_CPU_NAME = "torch's CPU INT4 packing"
#: our C and Triton kernels' layout (:func:`pack_int4`)
OURS = Packing("our INT4 layout", 1, 0.5)
#: ``_convert_weight_to_int4pack``'s tiles (:class:`Int4TileLayout`)
TORCH_CUDA = Packing("torch's CUDA INT4 packing", 16, 3.0)


def torch_cpu(block: int | None) -> Packing:
    """``_convert_weight_to_int4pack_for_cpu``'s layout, whose blocks of ``block`` rows
    interleave (:func:`cpu_int4_block_rows`)."""
    return Packing(TORCH_CPU_NAME, 16, 0.5, block)
