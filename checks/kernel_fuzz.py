"""Hypothesis over our C kernels' Python entry points — the paged decode and prefill
attention, RMSNorm and residual add + RMSNorm, the GEMV — with shapes, dtypes, strides,
block tables with holes and slots past the pool, lengths at 0 and at the edge: every case
either matches the torch reference or raises a Python error. Run under AddressSanitizer
(``make asan``: the kernels built with ``-fsanitize=address``, libasan preloaded), a read or
write out of bounds ends the run with ASan's report instead of passing unseen.

``python -m checks.kernel_fuzz --examples 300`` prints the cases run per entry point, how many
matched, how many were refused, and exits 1 on a mismatch (a crash exits by ASan's abort)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats import kv as kv_format
from engine.kernels import gemv, layer_ops, paged_decode
from engine.kernels.gather_attention import gather_attention
from engine.model import transformer

COUNTS: Counter[tuple[str, str]] = Counter()
REFUSED = (ValueError, RuntimeError, TypeError, IndexError)


def outcome(name: str, ours: Callable[[], Any], reference: Callable[[], Any],
            close: Callable[[Any, Any], bool]) -> None:  # fmt: skip
    """Ours must match the reference, or raise; where the reference raises, ours must too."""
    try:
        want = reference()
    except REFUSED:
        want = None
    try:
        got = ours()
    except REFUSED:
        COUNTS[name, "refused"] += 1
        return
    if want is None:
        raise AssertionError(f"{name}: ours answered a case the reference refuses")
    if not close(got, want):
        raise AssertionError(f"{name}: ours differs from the reference")
    COUNTS[name, "matched"] += 1


def near(tol: float) -> Callable[[Any, Any], bool]:
    def check(got: Any, want: Any) -> bool:
        pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
                   for a, b in pairs)  # fmt: skip

    return check


DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def attention_case(draw: Any) -> dict[str, Any]:
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, 0, 1]))
    dim = draw(st.sampled_from([8, 16, 32, 40]))
    slots_n = draw(st.integers(1, 48))
    b, w = draw(st.integers(1, 4)), draw(st.integers(0, 24))
    pool_kind = draw(st.sampled_from(["fp32", "bf16", "int8"]))
    seed = draw(st.integers(0, 1 << 16))
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots_n, 2 * kv_heads, dim, generator=gen)
    if pool_kind == "bf16":
        pool = pool.bfloat16()
    elif pool_kind == "int8":
        pool = kv_format.quantize(pool, kv_format.INT8)
    lo, hi = draw(st.sampled_from([(0, slots_n - 1), (0, slots_n - 1), (-2, slots_n + 2)]))
    slots = torch.randint(lo, hi + 1, (b, w), generator=gen) if w else torch.zeros(b, 0).long()
    lens = torch.tensor([draw(st.integers(-1 if lo < 0 else 0, w + (lo < 0))) for _ in range(b)])
    q = torch.randn(b, heads, dim, generator=gen)
    return {"q": q, "pool": pool, "slots": slots, "lens": lens}


@given(attention_case())
def fuzz_paged_decode(case: dict[str, Any]) -> None:
    q, pool, slots, lens = case["q"], case["pool"], case["slots"], case["lens"]
    b, w = slots.shape
    mask = torch.zeros(b, w)
    for i, n in enumerate(lens.tolist()):
        mask[i, max(n, 0) :] = float("-inf")

    def reference() -> torch.Tensor:
        if lens.min() < 0 or lens.max() > w or q.shape[1] % (pool.shape[1] // 2):
            raise ValueError("out of range")
        for i, n in enumerate(lens.tolist()):
            if n and (slots[i, :n].min() < 0 or slots[i, :n].max() >= pool.shape[0]):
                raise ValueError("a slot outside the pool")
        safe = slots.clamp(0, pool.shape[0] - 1)
        out = gather_attention(q, pool, safe, mask[:, None, None, :]).reshape(b, -1)
        return torch.where((lens > 0)[:, None], out, torch.zeros_like(out))  # no keys: zeros

    kernel = paged_decode.kernel()
    outcome("paged decode", lambda: paged_decode._call(kernel, q, pool, slots, lens, mask),
            reference, near(2e-2))  # fmt: skip


@given(attention_case(), st.integers(1, 6), st.integers(0, 3), st.sampled_from([0, 0, 4, 9]))
def fuzz_paged_prefill(case: dict[str, Any], queries: int, sink: int, window: int) -> None:
    """One sequence's chunk over its slots (the first row of the case's table, every column
    read), positions 0…T-1, the chunk's queries the last of them (each sees itself, as in a
    prefill); no slots at all must be refused."""
    pool, slots = case["pool"], case["slots"][0]
    heads, dim = case["q"].shape[1:]
    t = slots.numel()
    length = max(1, min(queries, t))
    q = torch.randn(length, heads, dim)
    positions, start = torch.arange(t), t - length

    def reference() -> torch.Tensor:
        if t == 0 or heads % (pool.shape[1] // 2):
            raise ValueError("no keys, or heads that do not group")
        if slots.min() < 0 or slots.max() >= pool.shape[0]:
            raise ValueError("a slot outside the pool")
        want = paged_decode.prefill_reference(q, pool, slots, positions, start, sink, window)
        return want.reshape(length, -1)

    kernel = paged_decode.kernel()

    def ours() -> torch.Tensor:
        out = paged_decode._call_prefill(kernel, q, pool, slots, positions, start, sink, window)
        return out.reshape(length, -1)

    outcome("paged prefill", ours, reference, near(2e-2))


@st.composite
def norm_case(draw: Any) -> dict[str, Any]:
    dtype = draw(DTYPES)
    rows, h = draw(st.integers(0, 9)), draw(st.integers(1, 70))
    x = torch.randn(rows, h).to(dtype)
    if draw(st.booleans()):
        x = x.t().contiguous().t() if rows > 1 else x  # a non-contiguous view (falls back)
    wh = draw(st.sampled_from([h, h, h, h - 1, h + 3])) if h > 1 else h
    weight = torch.randn(max(wh, 1)).to(draw(st.sampled_from([dtype, dtype, torch.float32])))
    residual = torch.randn(rows, draw(st.sampled_from([h, h, h + 1]))).to(dtype)
    eps = draw(st.sampled_from([1e-6, 1e-5]))
    return {"x": x, "weight": weight, "residual": residual, "eps": eps}


@given(norm_case())
def fuzz_norms(case: dict[str, Any]) -> None:
    lib = layer_ops.library()
    if not lib.available:
        return
    ops = layer_ops.c_ops(lib)
    x, weight, residual, eps = case["x"], case["weight"], case["residual"], case["eps"]
    tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
    outcome("rms norm", lambda: ops.rms_norm(x, weight, eps),
            lambda: transformer.rms_norm(x, weight, eps), near(tol))  # fmt: skip
    outcome("add + rms norm", lambda: ops.add_rms_norm(x, residual, weight, eps),
            lambda: transformer.add_rms_norm(x, residual, weight, eps), near(tol))  # fmt: skip


@st.composite
def gemv_case(draw: Any) -> dict[str, Any]:
    m, k, n = draw(st.integers(1, 4)), draw(st.integers(1, 96)), draw(st.integers(1, 40))
    kind = draw(st.sampled_from([torch.int8, torch.bfloat16, torch.float32]))
    weight = torch.randn(n, k + draw(st.sampled_from([0, 0, 0, 1])))
    if kind == torch.int8:
        weight = (weight * 40).round().clamp(-127, 127)
    weight = weight.to(kind)
    if draw(st.booleans()) and n > 1:
        weight = weight.t().contiguous().t()  # non-contiguous
    scales = torch.rand(n + draw(st.sampled_from([0, 0, 0, -1, 2]))) / 40 + 1e-3
    x = torch.randn(m, k).to(draw(DTYPES))
    return {"x": x, "weight": weight, "scales": scales if kind == torch.int8 else None,
            "out": draw(DTYPES)}  # fmt: skip


@given(gemv_case())
def fuzz_gemv(case: dict[str, Any]) -> None:
    lib = gemv.library()
    if not lib.available:
        return
    x, weight, scales, out = case["x"], case["weight"], case["scales"], case["out"]

    def reference() -> torch.Tensor:
        w = weight.float() if scales is None else weight.float() * scales[:, None]
        return (x.float() @ w.t()).to(out)

    tol = 3e-2 if torch.bfloat16 in (x.dtype, out, weight.dtype) else 1e-3
    outcome("gemv", lambda: gemv.product(lib, x, weight, scales, out), reference, near(tol))


FUZZERS = {"paged decode": fuzz_paged_decode, "paged prefill": fuzz_paged_prefill,
           "norms": fuzz_norms, "gemv": fuzz_gemv}  # fmt: skip


def canary() -> None:
    """Read one float past a weight through the raw C call, past the entry point's check: a
    build under ASan must stop here with its heap-buffer-overflow report (the proof that the
    fuzzing ran with the sanitizer live)."""
    lib = layer_ops.library()
    x, out = torch.randn(1, 64), torch.empty(1, 64)
    weight = torch.randn(63)  # one short
    lib.lib.infersight_rms_norm(x.data_ptr(), weight.data_ptr(), 1, 64, 1e-6, 0,
                                out.data_ptr(), 1)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.kernel_fuzz")
    p.add_argument("--examples", type=int, default=300, help="cases per entry point")
    p.add_argument("--canary", action="store_true", help="read past a buffer on purpose")
    args = p.parse_args(argv)
    if args.canary:
        canary()
        print("the canary's read past the weight went unseen: not under ASan", file=sys.stderr)
        return 1
    torch.set_num_threads(2)
    failed = False
    for name, fuzzer in FUZZERS.items():
        run = settings(max_examples=args.examples, deadline=None, derandomize=True,
                       suppress_health_check=list(HealthCheck))(fuzzer)  # fmt: skip
        try:
            run()
        except AssertionError as exc:
            failed = True
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
    for (name, result), n in sorted(COUNTS.items()):
        print(f"{name}: {n} {result}")
    print(f"{sum(COUNTS.values())} cases, {'a mismatch' if failed else '0 mismatches'}, 0 crashes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
