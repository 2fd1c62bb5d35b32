"""The fused Triton kernels (engine/kernels/triton_kernels/fused.py) under Triton's interpreter
on CPU tensors, against the torch path they replace: the model's ``rms_norm`` after the
residual add, and ``Attention.forward``'s RoPE followed by the paged cache's ``index_copy_``.
Which configurations the launchers pick is checked against what the ahead-of-time build
compiles (``fused.configs()``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from engine.formats import kv as kv_format
from engine.kernels.triton_kernels import fused
from engine.model import transformer
from engine.model.attention import AttentionContext
from engine.model.config import ModelConfig

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def _activations(rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Rows of typical, large, and small values (whose mean square is below ``EPS``, where
    eps must sit inside the square root)."""
    x = torch.randn(rows, hidden, generator=gen)
    x[1::3] *= 50
    x[2::3] *= 1e-3
    return x.to(dtype)


def _assert_norm_equal(got: Tensor, want: Tensor) -> None:
    """Equal but for the order of the sum of squares: fp32 within a few ulps; fp16/bf16 the
    same bits but where ``rstd``'s last bit differs, one ulp in a rare element."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        return
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= 1
    assert (ulps != 0).sum() <= got.numel() // 100


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 1001, 2048, 4096])
def test_add_rms_norm_equals_the_model(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = _activations(3, hidden, dtype, gen)
    residual = _activations(3, hidden, dtype, gen)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)

    normed, summed = fused.add_rms_norm(x, residual, weight, EPS)

    want = residual + x  # the residual stream plus a sublayer's output, as DecoderLayer adds
    assert torch.equal(summed, want)
    _assert_norm_equal(normed, transformer.rms_norm(want, weight, EPS))
    _assert_norm_equal(fused.rms_norm(x, weight, EPS), transformer.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_norm_reads_strided_rows_and_only_hidden_columns(dtype):
    """Rows of a wider tensor, whose columns past ``hidden`` hold huge values: read, they
    would swamp the mean square (the kernel's block of 1024 reaches past 576 columns)."""
    gen = torch.Generator().manual_seed(1)
    hidden = 576
    wide = torch.full((4, 1024), 3e4, dtype=dtype)
    wide[:, :hidden] = _activations(4, hidden, dtype, gen)
    residual = torch.full((4, 700), 3e4, dtype=dtype)
    residual[:, :hidden] = _activations(4, hidden, dtype, gen)
    x, residual = wide[:, :hidden], residual[:, :hidden]
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)

    normed, summed = fused.add_rms_norm(x, residual, weight, EPS)

    assert torch.equal(summed, residual + x)
    _assert_norm_equal(normed, transformer.rms_norm(residual + x, weight, EPS))
    _assert_norm_equal(fused.rms_norm(x, weight, EPS), transformer.rms_norm(x, weight, EPS))


class _Capture(AttentionContext):
    """Stores a step's K/V as the paged cache does and keeps the q it was handed."""

    def __init__(self, pool: Tensor, write_slots: Tensor) -> None:
        self.pool, self.write_slots = pool, write_slots
        self.q: Tensor | None = None

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        kv_format.store(self.pool, self.write_slots, kv)  # quantized where the pool is int8
        self.q = q.clone()
        return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])


def _attention(
    heads: int, kv_heads: int, head_dim: int, qk_norm: bool, dtype: torch.dtype
) -> tuple[ModelConfig, transformer.Attention]:
    """One attention block with random weights (Qwen3's q/k norms when ``qk_norm``)."""
    cfg = ModelConfig(
        model_type="qwen3" if qk_norm else "llama", vocab_size=16, hidden_size=32,
        intermediate_size=16, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=1e6 if qk_norm else 1e4, tie_word_embeddings=False, attention_bias=False,
        qk_norm=qk_norm,
    )  # fmt: skip
    attn = transformer.Attention(cfg, 0)
    gen = torch.Generator().manual_seed(heads * head_dim)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1 if p.dim() == 1 else 0))
    return cfg, attn.to(dtype).requires_grad_(False)


ROPE_SHAPES = [
    pytest.param(9, 3, 64, False, id="smollm2-9/3x64"),
    pytest.param(32, 8, 128, False, id="llama3-32/8x128"),
    pytest.param(32, 8, 128, True, id="qwen3-32/8x128-qk-norm"),
    pytest.param(8, 2, 8, False, id="tiny-8/2x8"),  # D/2 = 4 in a block of 32: masked columns
]


@pytest.mark.parametrize("int8", [False, True], ids=["float-pool", "int8-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "qk_norm"), ROPE_SHAPES)
def test_rope_store_equals_the_model(dtype, heads, kv_heads, head_dim, qk_norm, int8):
    """Bit for bit, in every dtype: q as ``Attention.forward`` hands it to attention, and the
    pool after the paged cache's write (``kv.store``: a copy, or into int8 rows each value
    quantized, each row's scale after it), at positions up to 4k and slots in no order. The
    pool's other slots and ``qkv``'s k and v columns are left as they were."""
    cfg, attn = _attention(heads, kv_heads, head_dim, qk_norm, dtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, cfg.hidden_size, generator=gen).to(dtype)
    cos, sin = transformer.RotaryEmbedding(cfg).angles(torch.tensor([4095, 0, 2047, 1]), dtype)
    write_slots = torch.tensor([37, 2, 90, 91])
    pool = torch.randn(96, 2 * kv_heads, head_dim, generator=gen).to(dtype)
    if int8:
        pool = kv_format.quantize(pool, kv_format.INT8)
    expected = _Capture(pool.clone(), write_slots)
    attn(x, cos, sin, expected)

    with torch.no_grad():
        qkv = attn.qkv_proj(x)
        if qk_norm:
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(4, heads + kv_heads, head_dim)
            attn.norm_heads_(qk, attn.q_norm_weight, attn.k_norm_weight)
    before = qkv.clone()
    q = fused.rope_store(
        qkv, cos, sin, pool, write_slots,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
    )  # fmt: skip

    assert expected.q is not None
    assert torch.equal(q, expected.q)
    assert torch.equal(pool, expected.pool)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(qkv[:, cfg.q_size :], before[:, cfg.q_size :])
    assert not torch.equal(q, before[:, : cfg.q_size].view_as(q))  # it did rotate


def test_rope_store_takes_angle_rows_as_the_model_gives_them_or_flat():
    cfg, _ = _attention(8, 2, 16, False, torch.float32)
    cos, sin = transformer.RotaryEmbedding(cfg).angles(torch.tensor([3, 1000]), torch.float32)
    qkv = torch.randn(2, (8 + 4) * 16, generator=torch.Generator().manual_seed(0))
    pools = [torch.zeros(4, 4, 16) for _ in range(2)]
    shapes = dict(num_heads=8, num_kv_heads=2, head_dim=16)
    slots = torch.tensor([3, 0])
    q3 = fused.rope_store(qkv.clone(), cos, sin, pools[0], slots, **shapes)
    q2 = fused.rope_store(qkv.clone(), cos[:, 0], sin[:, 0], pools[1], slots, **shapes)
    assert torch.equal(q3, q2) and torch.equal(pools[0], pools[1])


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    """Replace both kernels by recorders of (kernel, launch keywords): no kernel runs."""
    launches: list[tuple[Any, dict[str, Any]]] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append((self.kernel, kwargs | {"args": args}))

    for name in ("_rms_norm_kernel", "_rope_store_kernel"):
        monkeypatch.setattr(fused, name, Recorder(getattr(fused, name)))
    return launches


def test_the_launchers_pick_exactly_the_configurations_the_build_compiles(monkeypatch):
    """Every launch, for hidden sizes up to 8192 and every even head dim up to 256 in
    every dtype a GPU computes in, is a configuration of ``configs()`` (constants, warps,
    stages, FMA contraction), and every configuration is launched for some size; fp32 (the
    interpreter's reference) is launched with the same constants and built for no GPU."""
    built = {
        (c.fn, c.signature[next(iter(c.signature))], tuple(sorted(c.constants.items())),
         c.num_warps, c.num_stages, c.enable_fp_fusion)
        for c in fused.configs()
    }  # fmt: skip
    launches = _record_launches(monkeypatch)
    hiddens = sorted(
        {1, 64, 576, 1001, 8192} | {2**k + d for k in range(1, 13) for d in (-1, 0, 1)}
    )
    for dtype in DTYPES:
        for hidden in hiddens:
            x = torch.empty(1, hidden, dtype=dtype)
            fused.add_rms_norm(x, x, torch.empty(hidden, dtype=dtype), EPS)
            fused.rms_norm(x, torch.empty(hidden, dtype=dtype), EPS)
        for head_dim in range(2, 257, 2):
            qkv = torch.empty(1, 3 * head_dim, dtype=dtype)
            angle = torch.empty(1, 1, head_dim, dtype=dtype)
            pools = [torch.empty(2, 2, head_dim, dtype=dtype)]
            if head_dim % 4 == 0:  # int8 rows (--kv-dtype int8): their scale aligned after them
                pools.append(kv_format.INT8.empty(2, 1, head_dim, "cpu"))
            for pool in pools:
                fused.rope_store(
                    qkv.zero_(), angle.zero_(), angle, pool, torch.tensor([1]),
                    num_heads=1, num_kv_heads=1, head_dim=head_dim,
                )  # fmt: skip
    launched = {
        (kernel, "*" + fused.DTYPES[kw["args"][0].dtype],
         tuple(sorted((k, v) for k, v in kw.items() if k.isupper())),
         kw["num_warps"], kw["num_stages"], kw.get("enable_fp_fusion", True))
        for kernel, kw in launches
    }  # fmt: skip
    assert len(launches) == 3 * (2 * len(hiddens) + 128 + 64)
    on_gpus = {launch for launch in launched if launch[1] != "*fp32"}
    assert on_gpus == built
    fp32 = launched - on_gpus
    assert {(k, *rest) for k, _, *rest in fp32} == {(k, *rest) for k, _, *rest in on_gpus}


def test_empty_steps_launch_nothing(monkeypatch):
    launches = _record_launches(monkeypatch)
    x = torch.empty(0, 576)
    normed, summed = fused.add_rms_norm(x, x, torch.ones(576), EPS)
    assert normed.shape == summed.shape == (0, 576)
    q = fused.rope_store(
        torch.empty(0, 15 * 64), torch.empty(0, 1, 64), torch.empty(0, 1, 64),
        torch.empty(8, 6, 64), torch.empty(0, dtype=torch.int64),
        num_heads=9, num_kv_heads=3, head_dim=64,
    )  # fmt: skip
    assert q.shape == (0, 9, 64)
    assert launches == []


def test_the_norm_refuses_what_it_cannot_compute():
    x = torch.zeros(2, 576)
    with pytest.raises(ValueError, match=r"weight must be \[576\] torch.float32"):
        fused.rms_norm(x, torch.ones(576, dtype=torch.float16), EPS)
    with pytest.raises(ValueError, match=r"residual must be \(2, 576\)"):
        fused.add_rms_norm(x, torch.zeros(3, 576), torch.ones(576), EPS)
    with pytest.raises(ValueError, match="contiguous rows"):
        fused.rms_norm(torch.zeros(576, 2).t(), torch.ones(576), EPS)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused.rms_norm(x.double(), torch.ones(576, dtype=torch.float64), EPS)
    with pytest.raises(ValueError, match=r"at most 8192 values.*INFERSIGHT_KERNELS=torch"):
        fused.rms_norm(torch.zeros(1, 8193), torch.ones(8193), EPS)


def test_rope_store_refuses_what_it_cannot_compute():
    qkv, angle = torch.zeros(2, 15 * 64), torch.zeros(2, 1, 64)
    pool, slots = torch.zeros(8, 6, 64), torch.tensor([1, 2])
    shapes = dict(num_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match=r"write_slots must be \[2\] int64"):
        fused.rope_store(qkv, angle, angle, pool, slots.int(), **shapes)
    with pytest.raises(ValueError, match=r"pool must be \[slots, 2·Hkv, D\] = \[slots, 6, 64\]"):
        fused.rope_store(qkv, angle, angle, torch.zeros(8, 3, 64), slots, **shapes)
    with pytest.raises(ValueError, match=r"cos must be \[T, 1, D\]"):
        fused.rope_store(qkv, angle.half(), angle, pool, slots, **shapes)
    with pytest.raises(ValueError, match=r"qkv must be \[T, \(H \+ 2·Hkv\)·D\] = \[T, 960\]"):
        fused.rope_store(torch.zeros(2, 14 * 64), angle, angle, pool, slots, **shapes)
    with pytest.raises(ValueError, match="head dims up to 256, not 512"):
        fused.rope_store(
            torch.zeros(2, 3 * 512), torch.zeros(2, 512), torch.zeros(2, 512),
            torch.zeros(8, 2, 512), slots, num_heads=1, num_kv_heads=1, head_dim=512,
        )  # fmt: skip
