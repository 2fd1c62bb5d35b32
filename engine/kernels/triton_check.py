"""Each of our Triton kernels checked against its torch reference before the engine uses it,
once per device and dtype (as the paged C kernel is checked once per machine).

A kernel can build and still be wrong on a GPU its author never ran: another architecture,
another Triton or driver. Before a load hands its attention or its quantized linears to our
kernels, each runs once on small random inputs of the model's head size and dtype (a ragged
batch, a cached prefix, a shuffled block table; a GEMV row and a tile of rows) and is compared
with the torch path it replaces. A kernel that fails, or raises, is not used: the load runs
the torch path and its report says why. ``INFERSIGHT_KERNELS=triton`` turns the failure into
an error.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from engine.formats import kv as kv_format
from engine.kernels import triton_support, verify

log = logging.getLogger(__name__)

#: The roundings to the dtype between a kernel and the torch path (:func:`_verdict`): both
#: outputs', one between (the attention's probabilities rounded to V's dtype, INT4 weights
#: dequantized to the activations', a normalised value before its weight, RoPE's products before
#: their sum), and one more that no GPU has confirmed the checks may drop (they allowed four).
ROUNDINGS = 4
#: The finest the Triton checks resolve (:func:`engine.kernels.verify.tolerance`'s floor),
#: binding fp32 only: the 1e-4 fp32 had before the policy, kept as a stated exception. On a
#: GPU fp32 reaches our Triton kernels only in the quantized GEMMs (attention and the fused
#: norms refuse it there), whose tiles' ``tl.dot`` rounds fp32 operands to TF32 from sm_80:
#: 2–5e-4 on these inputs (simulated), over either bound, so those layers keep torch's exact
#: products; sm_75's FMAs are exact, but no GPU has confirmed them under the policy's 2.4e-5.
FINEST = 1e-4
BLOCK = 16


def attention(
    device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int,
    *, rows: str = "",
) -> str:  # fmt: skip
    """Why our attention kernels must not run here ("" where both pass their check): over a
    float pool, and with ``rows`` (a quantized format's name: ``int8``, ``fp8``) over such
    rows too (a failure there leaves float pools' attention to our kernels)."""
    return _attention(str(device), dtype, head_dim, heads, kv_heads, rows)


def fused(
    device: torch.device, dtype: torch.dtype, hidden: int, heads: int, kv_heads: int,
    head_dim: int, *, int8: bool = False,
) -> str:  # fmt: skip
    """Why our fused norm and RoPE kernels must not run here ("" where they pass): the
    K/V write into a float pool, and with ``int8`` into int8 rows too."""
    return _fused(str(device), dtype, hidden, heads, kv_heads, head_dim, int8)


def gemms(device: torch.device, dtype: torch.dtype) -> str:
    """Why our INT8/INT4 GEMMs must not run here ("" where they pass their check)."""
    return _gemms(str(device), dtype)


def grouped(device: torch.device, dtype: torch.dtype) -> str:
    """Why our grouped INT4 GEMM of a mixture of experts must not run here ("" where it passes
    its check), asked once per device and dtype (every layer of experts asks)."""
    return _grouped_verdict(str(device), dtype)


@functools.cache
def _grouped_verdict(device: str, dtype: torch.dtype) -> str:
    return _guarded("grouped INT4 GEMM", functools.partial(_grouped, device, dtype))


def _verdict(name: str, got: Tensor, want: Tensor, reduction: int) -> str:
    """``got`` against the torch path's ``want``, within the policy's bound for the kernel's
    dtype and the longest sum behind a result (:func:`engine.kernels.verify.tolerance`)."""
    tolerance = verify.tolerance(got.dtype, reduction, roundings=ROUNDINGS, finest=FINEST)
    return verify.differs(f"our {name} kernel", got, want, tolerance, "the torch path")


def _guarded(name: str, check: functools.partial[str]) -> str:
    return verify.guarded(name, check, what_to_do=f"start again with {triton_support.ENV}=torch")


@functools.cache
def _attention(
    device: str, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, rows: str
) -> str:
    """Decode and prefill, over a float pool and over ``rows`` (what ``--kv-dtype`` names)."""
    for name, check in (("decode attention", _decode), ("prefill attention", _prefill)):
        for fmt in ("", rows) if rows else ("",):
            shape = (torch.device(device), dtype, head_dim, heads, kv_heads, fmt)
            why = _guarded(f"{name}{f' over {fmt} KV' if fmt else ''}",
                           functools.partial(check, *shape))  # fmt: skip
            if why:
                return why
    return ""


@functools.cache
def _gemms(device: str, dtype: torch.dtype) -> str:
    for name, check in (("INT8 GEMM", _int8), ("INT4 GEMM", _int4)):
        why = _guarded(name, functools.partial(check, torch.device(device), dtype))
        if why:
            return why
    return ""


def _pool(
    dev: torch.device,
    dtype: torch.dtype,
    kv_heads: int,
    head_dim: int,
    blocks: int,
    gen: torch.Generator,
    rows: str = "",
) -> Tensor:
    """A pool of random K/V in ``dtype``, or as ``rows`` (:func:`engine.formats.kv.named`)."""
    pool = torch.randn(blocks * BLOCK + 1, 2 * kv_heads, head_dim, generator=gen).to(dtype)
    return (kv_format.quantize(pool, kv_format.named(rows)) if rows else pool).to(dev)


def _tables(lengths: list[int], blocks: int, gen: torch.Generator) -> list[list[int]]:
    """Each sequence's blocks, drawn without repeats from a shuffled pool."""
    order = torch.randperm(blocks, generator=gen).tolist()
    out, at = [], 0
    for n in lengths:
        count = -(-n // BLOCK)
        out.append(order[at : at + count])
        at += count
    return out


def _padded(tables: list[list[int]], dev: torch.device) -> Tensor:
    width = max(len(t) for t in tables)
    rows = [t + [-1] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32).to(dev)


def _keys(pool: Tensor, table: list[int], n: int, kv_heads: int) -> tuple[Tensor, Tensor]:
    """Positions ``0 .. n-1`` of a sequence, as ``[Hkv, n, D]`` keys and values."""
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    rows = kv_format.gather(pool, slots.to(pool.device), torch.float32).transpose(0, 1)
    return rows[:kv_heads], rows[kv_heads:]


def _reference(q: Tensor, keys: Tensor, values: Tensor, first: int) -> Tensor:
    """Causal GQA attention of queries at ``first …`` over keys ``0 …``, in fp32."""
    length, heads, dim = q.shape
    group = heads // keys.shape[0]
    k = keys.repeat_interleave(group, 0)
    v = values.repeat_interleave(group, 0)
    scores = torch.einsum("lhd,htd->hlt", q.float(), k) / dim**0.5
    pos = torch.arange(keys.shape[1], device=q.device)
    visible = pos[None, :] <= (first + torch.arange(length, device=q.device))[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hlt,htd->lhd", scores.softmax(-1), v).reshape(length, heads * dim)


def _decode(
    dev: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, rows: str
) -> str:
    from engine.kernels.triton_kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    lengths, blocks = [1, 20, 37], 8
    pool = _pool(dev, dtype, kv_heads, head_dim, blocks, gen, rows)
    tables = _tables(lengths, blocks, gen)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dev, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32).to(dev)
    want = torch.cat([
        _reference(q[b : b + 1], *_keys(pool, tables[b], n, kv_heads), n - 1)
        for b, n in enumerate(lengths)
    ]).to(dtype)  # fmt: skip
    # one pass, and the context split in three (a CUDA graph's wide tables split it so)
    for splits, name in ((None, "decode attention"), (3, "split decode attention")):
        got = paged_decode_attention(
            q, pool, _padded(tables, dev), lens, block_size=BLOCK, splits=splits
        )
        why = _verdict(name, got, want, head_dim + max(lengths))  # q·k, then p·v
        if why:
            return why
    return ""


def _prefill(
    dev: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, rows: str
) -> str:
    from engine.kernels.triton_kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(1)
    firsts, chunks, blocks = [0, 21], [9, 14], 8  # a fresh prompt, and an extend of a prefix
    pool = _pool(dev, dtype, kv_heads, head_dim, blocks, gen, rows)
    tables = _tables([f + c for f, c in zip(firsts, chunks, strict=True)], blocks, gen)
    q = torch.randn(sum(chunks), heads, head_dim, generator=gen).to(dev, dtype)
    starts = torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32).to(dev)
    first = torch.tensor(firsts, dtype=torch.int32).to(dev)
    got = paged_prefill_attention(
        q, pool, _padded(tables, dev), starts, first, max_query_len=max(chunks), block_size=BLOCK
    )
    want, at = [], 0
    for table, f, c in zip(tables, firsts, chunks, strict=True):
        want.append(_reference(q[at : at + c], *_keys(pool, table, f + c, kv_heads), f))
        at += c
    keys = max(f + c for f, c in zip(firsts, chunks, strict=True))
    return _verdict("prefill attention", got, torch.cat(want).to(dtype), head_dim + keys)


def _int8(dev: torch.device, dtype: torch.dtype) -> str:
    from engine.kernels.triton_kernels.quant_gemm import int8_linear, int8_reference

    gen = torch.Generator().manual_seed(2)
    weight = torch.randint(-127, 128, (96, 160), generator=gen, dtype=torch.int8).to(dev)
    scales = (torch.rand(96, generator=gen) * 0.01).to(dev, dtype)
    bias = torch.randn(96, generator=gen).to(dev, dtype)
    # a GEMV row and a decode tile of 16 rows, each unsplit and split over K, and a prefill tile
    for rows, splits in ((1, None), (1, 2), (16, None), (16, 2), (20, None)):
        x = torch.randn(rows, 160, generator=gen).to(dev, dtype)
        why = _verdict(
            "INT8 GEMM" if splits is None else f"INT8 GEMM split over K ({rows} rows)",
            int8_linear(x, weight, scales, bias, splits=splits),
            int8_reference(x, weight, scales, bias),
            weight.shape[1],
        )
        if why:
            return why
    return ""


def _int4(dev: torch.device, dtype: torch.dtype) -> str:
    from engine.formats.int4 import pack_int4
    from engine.kernels.triton_kernels.quant_gemm import int4_linear, int4_reference

    gen = torch.Generator().manual_seed(3)
    group, n, k = 32, 96, 160
    weight = pack_int4(torch.randint(0, 16, (n, k), generator=gen)).to(dev)
    sz = torch.stack([torch.rand(k // group, n, generator=gen) * 0.02,
                      torch.randn(k // group, n, generator=gen) * 0.01], dim=-1)  # fmt: skip
    sz = sz.to(dev, torch.bfloat16).contiguous()
    for rows, splits in ((1, None), (1, 2), (16, None), (16, 2), (20, None)):
        x = torch.randn(rows, k, generator=gen).to(dev, dtype)
        got = int4_linear(x, weight, sz, group, splits=splits)
        name = "INT4 GEMM" if splits is None else f"INT4 GEMM split over K ({rows} rows)"
        why = _verdict(name, got, int4_reference(x, weight, sz, group, None), k)
        if why:
            return why
    return ""


def _grouped(device: str, dtype: torch.dtype) -> str:
    """Every (token, expert) pair of a routed step, tokens sharing experts and experts left
    out, against each pair's own product (:func:`int4_reference`), K off the group."""
    from engine.formats.int4 import pack_int4
    from engine.kernels.triton_kernels.grouped_gemm import Layout, int4_grouped
    from engine.kernels.triton_kernels.quant_gemm import int4_reference

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(4)
    experts, group, n, k, kp, tokens = 6, 32, 80, 150, 160, 24
    weight = pack_int4(torch.randint(0, 16, (experts * n, kp), generator=gen)).view(experts, n, -1)
    shape = (experts, kp // group, n)
    sz = torch.stack([torch.rand(shape, generator=gen) * 0.02,
                      torch.randn(shape, generator=gen) * 0.01], dim=-1)  # fmt: skip
    weight, sz = weight.to(dev).contiguous(), sz.to(dev, torch.bfloat16).contiguous()
    x = torch.randn(tokens, k, generator=gen).to(dev, dtype)
    chosen = torch.stack([torch.randperm(experts - 1, generator=gen)[:2] for _ in range(tokens)])
    chosen[:18] = torch.tensor([0, 1])  # experts 0 and 1: pairs over two tiles of slots
    layout = Layout(chosen.to(dev), experts)
    got = int4_grouped(x, layout.rows, layout.tile_expert, weight, sz, group)[layout.slot]
    token = torch.arange(tokens).repeat_interleave(2)
    want = torch.cat([
        int4_reference(x[t : t + 1], weight[e], sz[e], group, None)
        for t, e in zip(token.tolist(), chosen.flatten().tolist(), strict=True)
    ])  # fmt: skip
    return _verdict("grouped INT4 GEMM", got, want, k)


@functools.cache
def _fused(
    device: str, dtype: torch.dtype, hidden: int, heads: int, kv_heads: int, head_dim: int,
    int8: bool,
) -> str:  # fmt: skip
    dev = torch.device(device)
    for name, check in (("fused norm", _norms), ("fused RoPE", _rope)):
        why = _guarded(
            name, functools.partial(check, dev, dtype, hidden, heads, kv_heads, head_dim, int8)
        )
        if why:
            return why
    return ""


def _norms(dev: torch.device, dtype: torch.dtype, hidden: int, *_: int | bool) -> str:
    from engine.kernels.triton_kernels import fused
    from engine.model.transformer import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(5, hidden, generator=gen).to(dev, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dtype)
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = add_rms_norm(x, residual, weight, 1e-5)
    alone, want_alone = fused.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5)
    return (
        _verdict("fused RMSNorm", alone, want_alone, hidden)
        or _verdict("fused residual add + RMSNorm", normed, want_normed, hidden)
        or _verdict("fused residual add", summed, want_summed, 2)
    )


def _rope(
    dev: torch.device, dtype: torch.dtype, _hidden: int, heads: int, kv_heads: int,
    head_dim: int, int8: bool,
) -> str:  # fmt: skip
    from engine.kernels.triton_kernels import fused
    from engine.model.transformer import rotate_

    gen = torch.Generator().manual_seed(5)
    tokens, slots = 6, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dev, dtype)
    angles = torch.rand(tokens, 1, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dev, dtype), angles.sin().to(dev, dtype)
    write = torch.randperm(slots, generator=gen)[:tokens].to(dev)
    pool = torch.zeros(slots, 2 * kv_heads, head_dim, dtype=dtype, device=dev)
    ours, source = qkv.clone(), qkv.clone()  # qkv is rotated in place below
    q = fused.rope_store(ours, cos, sin, pool, write, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim)  # fmt: skip
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rotate_(qk, cos, sin)
    want_pool = torch.zeros_like(pool)
    want_pool.index_copy_(0, write, qkv[:, heads * head_dim :].view(tokens, 2 * kv_heads, head_dim))
    # x·cos + partner·sin: two terms
    why = _verdict("fused RoPE", q, qk[:, :heads], 2) or _verdict(
        "fused K/V write", pool, want_pool, 2
    )
    if why or not int8:
        return why
    # into int8 rows (--kv-dtype int8): torch's quantization of the rows it rotated, within
    # one step of a row's scale (the rotation itself may differ in its last bit, above)
    rows = kv_format.INT8.empty(slots, kv_heads, head_dim, dev)
    fused.rope_store(source, cos, sin, rows, write, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    want = kv_format.quantize(want_pool[write], kv_format.INT8)
    step = want[..., head_dim:].contiguous().view(torch.float32) * 1.01
    off = (kv_format.dequantize(rows[write]) - kv_format.dequantize(want)).abs()
    if off.gt(step).any():
        return (
            f"our fused K/V write into int8 rows is {float(off.max()):.3g} from torch's "
            "quantization of the same rows, more than a step; start again with "
            f"{triton_support.ENV}=torch"
        )
    return ""
