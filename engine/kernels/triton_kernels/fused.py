"""Two memory-bound steps of every decoder layer, each fused into one pass over its tensors.

**Residual add + RMSNorm** (:func:`add_rms_norm`; :func:`rms_norm` without the add, for the
first layer's first norm): ``summed = x + residual`` and ``normed = RMSNorm(summed) · weight``,
one read of each input and one write of each output, where the torch path runs the add, the
fp32 copy, the mean of squares, the scaling and the casts as kernels of their own. Rows are
``[rows, hidden]`` with any row stride. The grid is one program per row, the whole row held in
registers (``BLOCK`` = the hidden size rounded up to a power of two, 1024 to 8192, masked past
the end: every model up to Llama-70B's 8192), as the Triton tutorial's fused layer norm and
Liger's and Unsloth's RMSNorm do, with their warps: 4 for 1024 columns, 8 for 2k–4k, 16 for 8k
(8 or 16 elements a thread: one or two 16-byte loads of fp16/bf16).

Its numerics are the model's (:func:`engine.model.transformer.rms_norm`): the sum is rounded to
the activation dtype first (as ``x + attn(x)`` is), the mean square is accumulated in fp32, and
``rstd = 1 / sqrt(mean + eps)`` is computed with a correctly rounded square root and divisions
(Triton's ``/`` is the approximate ``div.full.f32``). fp32 rows are then ``(s·rstd)·w``; half
rows are ``fl(fl(s·rstd)·w)``, normalised in fp32, rounded, and scaled in the activation dtype
(the product of two fp16/bf16 values is exact in fp32, so one rounding, as torch's). The one
difference from torch is the order of the sum of squares (a tree here): fp32 agrees to an ulp
or two, fp16/bf16 bit for bit but for a rare one-ulp flip where ``rstd``'s last bit differs.

**RoPE + KV-cache write** (:func:`rope_store`): rotates the q and k heads of the fused qkv
projection output ``[T, (H + 2·Hkv)·D]`` by the model's angles (``cos`` and the signed ``sin``
of :class:`engine.model.transformer.RotaryEmbedding`, ``[T, 1, D]`` or ``[T, D]``), writes q
back in place (returned as the ``[T, H, D]`` view ``Attention.forward`` hands to attention)
and stores the rotated k heads and the v heads at ``pool[write_slots[t]]`` (``[slots, 2·Hkv,
D]``: K heads, then V heads): ``rotate_`` plus ``pool.index_copy_(0, write_slots, kv)`` in one
pass. The rotated keys go to the pool only: ``qkv``'s k and v columns are left as they came.
The rotation ``x·cos + roll(x, D/2)·sin`` runs on the two halves of each head, so each element
is read once. Each product and the sum is rounded to the activation dtype as torch's three ops
round them (fp16/bf16 products are exact in fp32; one fp32 sum rounded once is the correctly
rounded sum), and the kernel is built and launched with ``enable_fp_fusion=False``, without
which the compiler contracts a product and the sum into one FMA (it does by default, even
through the fp32 round trip of a half product): the result is **bit-equal to the torch path in
fp32, fp16 and bf16**. The grid is ``(T, ceil((H + 2·Hkv) / HEADS))``: each program takes
``HEADS`` consecutive heads of one token, q, k or v alike (a row's kind only picks where it
goes and whether it rotates), ``HEADS × D`` = 1024 elements over 4 warps, the tile of Liger's
and Unsloth's RoPE kernels: a decode token is one to six programs for the models this engine
runs on a 12 GB card, and a long prefill has blocks big enough to stream at bandwidth. Head
dims up to 64 share the ``D/2 = 32`` block (only the tiny test models have smaller heads).

Values are rounded from fp32 by :func:`~engine.kernels.triton_kernels.rounding.round_to`, to
nearest even, as the GPU's ``cvt.rn`` does (with integer ops under Triton's interpreter, whose
own bf16 cast truncates: so the interpreter tests check the bits the GPU computes).

``configs()`` lists every configuration the launchers pick: three dtypes × each ``BLOCK``, with
and without the residual, for the norm; three dtypes × each ``D/2`` block (rounded up to a power
of two, 32 to 128: head dims up to 256) for RoPE: 33 builds for each architecture.
"""

from __future__ import annotations

from itertools import product

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_kernels.kv_rows import quantize_rows
from engine.kernels.triton_kernels.rounding import round_to
from engine.kernels.triton_support import GPU_DTYPES, KernelConfig

#: The activation dtypes the kernels take, by their Triton names.
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: Row blocks of the norm: hidden sizes up to the last one (Llama-70B's 8192).
NORM_BLOCKS = (1024, 2048, 4096, 8192)
#: Half head-dim blocks of RoPE: head dims up to 256.
ROPE_HALF_BLOCKS = (32, 64, 128)
#: Elements of qkv one RoPE program rotates (``HEADS × D``).
ROPE_TILE = 1024
ROPE_WARPS = 4


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    summed_ptr,
    x_row_stride,
    residual_row_stride,
    normed_row_stride,
    summed_row_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row: ``summed = x + residual`` (rounded to the row's dtype), then the RMSNorm of
    ``summed`` (of ``x`` without a residual) scaled by ``weight``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    dtype = normed_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + row * residual_row_stride + cols, mask=inside, other=0.0
        ).to(tl.float32)
        # One fp32 sum and one rounding: the correctly rounded fp16/bf16 sum, as torch's.
        summed = round_to(x + residual, dtype)
        tl.store(summed_ptr + row * summed_row_stride + cols, summed, mask=inside)
        x = summed.to(tl.float32)
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=0), n_cols.to(tl.float32))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if dtype == tl.float32:
        normed = (x * rstd) * weight
    else:  # normalised in fp32 and rounded, then scaled in the activation dtype
        normed = round_to(x * rstd, dtype).to(tl.float32) * weight
    tl.store(normed_ptr + row * normed_row_stride + cols, round_to(normed, dtype), mask=inside)


@triton.jit
def _rotate(x, partner, cos, sin, dtype: tl.constexpr):
    """``x·cos + partner·sin`` with each product and the sum rounded to ``dtype``, as torch's
    ``x * cos``, ``roll(x) * sin`` and their sum are (given ``enable_fp_fusion=False``)."""
    if dtype == tl.float32:
        return x * cos + partner * sin
    x_cos = round_to(x.to(tl.float32) * cos.to(tl.float32), dtype)
    partner_sin = round_to(partner.to(tl.float32) * sin.to(tl.float32), dtype)
    return round_to(x_cos.to(tl.float32) + partner_sin.to(tl.float32), dtype)


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pool_ptr,
    slots_ptr,
    qkv_row_stride,
    cos_row_stride,
    sin_row_stride,
    pool_slot_stride,
    pool_head_stride,
    num_heads,
    num_kv_heads,
    head_dim,
    HALF_BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    """``HEADS`` heads of one token: q heads rotated in place in ``qkv``, k heads rotated and
    v heads copied into the token's pool slot; with ``KV_INT8``, each as an int8 row and its
    scale (:func:`.kv_rows.quantize_rows`)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    half = head_dim // 2
    cols = tl.arange(0, HALF_BLOCK)
    col_inside = cols < half
    inside = (heads < num_heads + 2 * num_kv_heads)[:, None] & col_inside[None, :]
    dtype = qkv_ptr.dtype.element_ty

    src = qkv_ptr + token * qkv_row_stride + heads[:, None] * head_dim + cols[None, :]
    first = tl.load(src, mask=inside, other=0.0)
    second = tl.load(src + half, mask=inside, other=0.0)
    angles = token * cos_row_stride + cols
    cos_first = tl.load(cos_ptr + angles, mask=col_inside, other=0.0)[None, :]
    cos_second = tl.load(cos_ptr + angles + half, mask=col_inside, other=0.0)[None, :]
    angles = token * sin_row_stride + cols
    sin_first = tl.load(sin_ptr + angles, mask=col_inside, other=0.0)[None, :]
    sin_second = tl.load(sin_ptr + angles + half, mask=col_inside, other=0.0)[None, :]
    # roll(x, D/2) = [x₂, x₁]; the sign of rotate_half lives in the sin table
    out_first = _rotate(first, second, cos_first, sin_first, dtype)
    out_second = _rotate(second, first, cos_second, sin_second, dtype)

    is_q = (heads < num_heads)[:, None]
    is_v = (heads >= num_heads + num_kv_heads)[:, None]
    out_first = tl.where(is_v, first, out_first)
    out_second = tl.where(is_v, second, out_second)
    tl.store(src, out_first, mask=inside & is_q)
    tl.store(src + half, out_second, mask=inside & is_q)
    slot = tl.load(slots_ptr + token)
    # the pool's heads are qkv's k heads then its v heads: pool head = qkv head − H
    row = pool_ptr + slot * pool_slot_stride + (heads - num_heads) * pool_head_stride
    dst = row[:, None] + cols[None, :]
    if KV_INT8:  # the row's values and its scale, as engine.formats.kv.quantize writes them
        first_q, second_q, scale = quantize_rows(out_first, out_second, inside)
        tl.store(dst, first_q, mask=inside & ~is_q)
        tl.store(dst + half, second_q, mask=inside & ~is_q)
        kv_head = (heads >= num_heads) & (heads < num_heads + 2 * num_kv_heads)
        at = (row + head_dim).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(at, scale, mask=kv_head)
    else:
        tl.store(dst, out_first, mask=inside & ~is_q)
        tl.store(dst + half, out_second, mask=inside & ~is_q)


def _norm_block(hidden: int) -> int:
    block = max(NORM_BLOCKS[0], triton.next_power_of_2(hidden))
    if block > NORM_BLOCKS[-1]:
        raise ValueError(
            f"the fused RMSNorm holds a row of at most {NORM_BLOCKS[-1]} values in registers, "
            f"not {hidden}: run the torch kernels (INFERSIGHT_KERNELS=torch)"
        )
    return block


def _norm_warps(block: int) -> int:
    return {1024: 4, 2048: 8, 4096: 8, 8192: 16}[block]


def _rope_heads(half_block: int) -> int:
    """Heads one RoPE program takes: ``ROPE_TILE`` elements."""
    return ROPE_TILE // (2 * half_block)


def _rope_half_block(head_dim: int) -> int:
    if head_dim % 2:
        raise ValueError(f"RoPE rotates halves of each head: head_dim must be even, not {head_dim}")
    block = max(ROPE_HALF_BLOCKS[0], triton.next_power_of_2(head_dim // 2))
    if block > ROPE_HALF_BLOCKS[-1]:
        raise ValueError(
            f"the fused RoPE handles head dims up to {2 * ROPE_HALF_BLOCKS[-1]}, not {head_dim}: "
            "run the torch kernels (INFERSIGHT_KERNELS=torch)"
        )
    return block


def _check_dtype(what: str, t: Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{what} must be float32, float16 or bfloat16, not {t.dtype}")


def _check_rows(what: str, t: Tensor) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{what} must be [rows, hidden] with contiguous rows, got shape {tuple(t.shape)} "
            f"with strides {t.stride()}"
        )


def _launch_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor | None]:
    _check_dtype("x", x)
    _check_rows("x", x)
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual must be {tuple(x.shape)} {x.dtype} on {x.device} like x, got "
                f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
            )
    hidden = x.shape[1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight must be [{hidden}] {x.dtype} on {x.device} like x, got "
            f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    block = _norm_block(hidden)
    normed = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = None if residual is None else torch.empty_like(normed)
    if x.shape[0] == 0:
        return normed, summed
    _rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight.contiguous(), normed,
        normed if summed is None else summed,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0),
        normed.stride(0), normed.stride(0),
        hidden, eps,
        BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=_norm_warps(block), num_stages=1,
    )  # fmt: skip
    return normed, summed


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(normed, summed)``: ``summed = x + residual`` in their dtype and ``normed`` =
    ``engine.model.transformer.rms_norm(summed, weight, eps)``, in one pass. ``x`` and
    ``residual``: ``[rows, hidden]`` of one dtype (rows may be strided); ``weight``: ``[hidden]``
    of that dtype. Both results are new contiguous tensors."""
    normed, summed = _launch_norm(x, residual, weight, eps)
    assert summed is not None
    return normed, summed


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``engine.model.transformer.rms_norm(x, weight, eps)`` of ``x: [rows, hidden]`` (the first
    norm of a model, which has no residual to add yet), in one pass."""
    return _launch_norm(x, None, weight, eps)[0]


def rope_store(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    pool: Tensor,
    write_slots: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Tensor:
    """Rotate the q and k heads of ``qkv: [T, (H + 2·Hkv)·D]`` by ``cos``/``sin`` (``[T, 1, D]``
    as :meth:`RotaryEmbedding.angles` gives them, or ``[T, D]``), store the rotated k heads and
    the v heads at ``pool[write_slots]`` (``pool: [slots, 2·Hkv, D]``, ``write_slots: [T]``
    int64) and return the rotated q, rotated in place in ``qkv``: its ``[T, H, D]`` view. ``qkv``'s
    k and v columns are left as they were."""
    _check_dtype("qkv", qkv)
    tokens = qkv.shape[0]
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] != heads * head_dim or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, (H + 2·Hkv)·D] = [T, {heads * head_dim}] with contiguous rows, got "
            f"{tuple(qkv.shape)} with strides {qkv.stride()}"
        )
    angles = []
    for name, table in (("cos", cos), ("sin", sin)):
        if (
            table.shape not in ((tokens, 1, head_dim), (tokens, head_dim))
            or table.dtype != qkv.dtype
            or table.device != qkv.device
        ):
            raise ValueError(
                f"{name} must be [T, 1, D] or [T, D] = [{tokens}, {head_dim}] of {qkv.dtype} on "
                f"{qkv.device}, got {tuple(table.shape)} {table.dtype} on {table.device}"
            )
        angles.append(table.reshape(tokens, head_dim))  # a view of the model's tables
    int8 = pool.dtype == torch.int8  # rows of D values and their scale (engine/formats/kv.py)
    width = head_dim + 4 if int8 else head_dim
    if (
        pool.dim() != 3
        or pool.shape[1:] != (2 * num_kv_heads, width)
        or pool.dtype not in (qkv.dtype, torch.int8)
        or (int8 and head_dim % 4)
        or pool.device != qkv.device
        or pool.stride(2) != 1
    ):
        raise ValueError(
            f"pool must be [slots, 2·Hkv, D] = [slots, {2 * num_kv_heads}, {head_dim}] of "
            f"{qkv.dtype} (or int8 rows, [slots, 2·Hkv, D + 4], D a multiple of 4) on "
            f"{qkv.device} with contiguous heads, got {tuple(pool.shape)} {pool.dtype} on "
            f"{pool.device}"
        )
    if write_slots.shape != (tokens,) or write_slots.dtype != torch.int64:
        raise ValueError(
            f"write_slots must be [{tokens}] int64 (one pool slot per token), got "
            f"{tuple(write_slots.shape)} {write_slots.dtype}"
        )
    if write_slots.device != qkv.device:
        raise ValueError(f"write_slots must be on {qkv.device}, not {write_slots.device}")
    half_block = _rope_half_block(head_dim)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    if tokens == 0:
        return q
    per_program = _rope_heads(half_block)
    _rope_store_kernel[(tokens, triton.cdiv(heads, per_program))](
        qkv, angles[0], angles[1], pool, write_slots.contiguous(),
        qkv.stride(0), angles[0].stride(0), angles[1].stride(0), pool.stride(0), pool.stride(1),
        num_heads, num_kv_heads, head_dim,
        HALF_BLOCK=half_block, HEADS=per_program, KV_INT8=int8, num_warps=ROPE_WARPS,
        num_stages=1, enable_fp_fusion=False,
    )  # fmt: skip
    return q


def configs() -> list[KernelConfig]:
    """Every configuration :func:`add_rms_norm`, :func:`rms_norm` and :func:`rope_store`
    launch on a GPU: they run where our attention does, so in
    :data:`~engine.kernels.triton_support.GPU_DTYPES` from each one's oldest architecture on
    (fp32 only under the interpreter)."""
    out = []
    for dtype, min_target in GPU_DTYPES.values():
        pointer = f"*{dtype}"
        for block in NORM_BLOCKS:
            for has_residual in (True, False):
                name = "add_rms_norm" if has_residual else "rms_norm"
                out.append(
                    KernelConfig(
                        name=f"fused.{name}[{dtype},BLOCK={block}]",
                        fn=_rms_norm_kernel,
                        signature={
                            "x_ptr": pointer,
                            "residual_ptr": pointer,
                            "weight_ptr": pointer,
                            "normed_ptr": pointer,
                            "summed_ptr": pointer,
                            "x_row_stride": "i32",
                            "residual_row_stride": "i32",
                            "normed_row_stride": "i32",
                            "summed_row_stride": "i32",
                            "n_cols": "i32",
                            "eps": "fp32",
                            "BLOCK": "constexpr",
                            "HAS_RESIDUAL": "constexpr",
                        },
                        constants={"BLOCK": block, "HAS_RESIDUAL": has_residual},
                        num_warps=_norm_warps(block),
                        num_stages=1,
                        min_target=min_target,
                    )
                )
        for half_block, int8 in product(ROPE_HALF_BLOCKS, (False, True)):
            kv = ",KV_INT8" if int8 else ""
            out.append(
                KernelConfig(
                    name=f"fused.rope_store[{dtype},HALF_BLOCK={half_block}{kv}]",
                    fn=_rope_store_kernel,
                    signature={
                        "qkv_ptr": pointer,
                        "cos_ptr": pointer,
                        "sin_ptr": pointer,
                        "pool_ptr": "*i8" if int8 else pointer,
                        "slots_ptr": "*i64",
                        "qkv_row_stride": "i32",
                        "cos_row_stride": "i32",
                        "sin_row_stride": "i32",
                        "pool_slot_stride": "i32",
                        "pool_head_stride": "i32",
                        "num_heads": "i32",
                        "num_kv_heads": "i32",
                        "head_dim": "i32",
                        "HALF_BLOCK": "constexpr",
                        "HEADS": "constexpr",
                        "KV_INT8": "constexpr",
                    },
                    constants={
                        "HALF_BLOCK": half_block,
                        "HEADS": _rope_heads(half_block),
                        "KV_INT8": int8,
                    },
                    num_warps=ROPE_WARPS,
                    num_stages=1,
                    min_target=min_target,
                    enable_fp_fusion=False,
                )
            )
    return out
