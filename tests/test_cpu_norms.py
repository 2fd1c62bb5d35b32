"""The layers' RMSNorms, and RoPE with the K/V write, in C on a CPU
(``engine/kernels/csrc/layer_ops.c``): what the model's torch code computes, at every CPU level
this machine builds, one call each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kernels import decode_step, layer_ops, lowbit, native
from engine.model import transformer
from tests.probed import built_levels

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module", params=built_levels(), ids=lambda level: level or "native")
def ops(request: pytest.FixtureRequest) -> layer_ops.LayerOps:
    built = layer_ops.build(request.param)
    assert built.available, built.why
    assert layer_ops.check(built) == ""
    return layer_ops.c_ops(built)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units of their last place."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize(("rows", "h"), [(1, 576), (3, 64), (7, 100), (2, 2048)])
def test_the_norms_compute_what_the_torch_code_computes(ops, rows, h):
    gen = torch.Generator().manual_seed(rows * h)
    x = torch.randn(rows, h, generator=gen) * 4
    r = torch.randn(rows, h, generator=gen)
    w = torch.rand(h, generator=gen) + 0.5
    # fp32: the sum of squares in another order only
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), transformer.rms_norm(x, w, 1e-5),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    out, summed = ops.add_rms_norm(x, r, w, 1e-6)
    want, want_sum = transformer.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # bf16: the same roundings as the torch code, at most one place apart
    xb, rb, wb = x.bfloat16(), r.bfloat16(), w.bfloat16()
    assert _ulps(ops.rms_norm(xb, wb, 1e-5), transformer.rms_norm(xb, wb, 1e-5)) <= 1
    out, summed = ops.add_rms_norm(xb, rb, wb, 1e-5)
    want, want_sum = transformer.add_rms_norm(xb, rb, wb, 1e-5)
    assert torch.equal(summed, want_sum) and _ulps(out, want) <= 1
    # and against float64
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"),
                         [(1, 9, 3, 64), (5, 4, 4, 8), (3, 8, 1, 128), (2, 6, 2, 32)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_the_kv_write_are_the_torch_codes_bit_for_bit(ops, tokens, heads, kv_heads,
                                                                 dim, dtype):  # fmt: skip
    """The rotated q heads (in place in qkv), the rotated k heads and the v heads at their
    slots, and every other slot of the pool untouched: equal to the torch code, to the bit,
    GQA and MHA, head sizes 8 to 128, the model's own angle tables."""
    from engine.model.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=heads * dim,
                      intermediate_size=64, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=dim, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False,
                      max_position_embeddings=4096)  # fmt: skip
    gen = torch.Generator().manual_seed(tokens * dim + heads)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = transformer.RotaryEmbedding(cfg).angles(positions, dtype)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    slots = torch.randperm(2 * tokens + 3, generator=gen)[:tokens]
    results = []
    for fn in (ops.rope_store, transformer.rope_store):
        pool = torch.full((2 * tokens + 3, 2 * kv_heads, dim), 7.0, dtype=dtype)
        q = fn(qkv.clone(), cos, sin, pool, slots, num_heads=heads, num_kv_heads=kv_heads,
               head_dim=dim)  # fmt: skip
        results.append((q, pool))
    (q, pool), (want_q, want_pool) = results
    assert q.shape == (tokens, heads, dim)
    assert torch.equal(q, want_q) and torch.equal(pool, want_pool)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert (pool[untouched] == 7).all()


def test_what_the_c_code_does_not_take_goes_to_torch(monkeypatch):
    norms = layer_ops.CNorms(layer_ops.build())
    calls: list[str] = []
    lib = norms.lib

    class Counting:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(lib, name)

    monkeypatch.setattr(norms, "lib", Counting())
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    cases = [
        (x.half(), w.half()),  # fp16
        (x[:, ::2], w[::2].contiguous()),  # a view that is not contiguous
        (x.bfloat16(), w),  # a weight of another dtype
    ]
    for xs, ws in cases:
        torch.testing.assert_close(norms.rms_norm(xs, ws, 1e-5), transformer.rms_norm(xs, ws, 1e-5))
    assert calls == []
    qkv, pool = torch.randn(2, 4 * 8).half(), torch.zeros(4, 2, 8).half()
    angles = torch.zeros(2, 1, 8).half()
    kw = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 8}
    norms.rope_store(qkv, angles, angles, pool, torch.tensor([1, 3]), **kw)  # fp16
    assert calls == []
    norms.rms_norm(x, w, 1e-5)
    norms.add_rms_norm(x, x, w, 1e-5)
    norms.rope_store(qkv.float(), angles.float(), angles.float(), pool.float(),
                     torch.tensor([1, 3]), **kw)  # fmt: skip
    assert calls == ["infersight_rms_norm", "infersight_add_rms_norm", "infersight_rope_store"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cpu_load_takes_them_where_our_kernels_are_allowed(tiny_model_dir, precision):
    """The C operations in every layer (the RoPE + K/V write counted), with a prefill after a
    cached prefix and decode steps through the modules (the C decode step, which makes the
    same calls from C, turned off: whether a load plans it is the machine's kernel
    verdicts'): the torch path's tokens."""
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model

    folder, _ = tiny_model_dir("llama", True)
    plain = load_model(folder, precision=precision)  # the tests pin INFERSIGHT_LOWBIT=torch
    assert "norms in torch (INFERSIGHT_LOWBIT=torch)" in plain.kernels
    with lowbit.choosing("auto"):
        ours = load_model(folder, precision=precision)
    assert "C: RMSNorm, residual add + RMSNorm, RoPE + KV write" in ours.kernels
    assert ours.model.ops.name.startswith("C:")
    stores = []
    rope_store = ours.model.ops.rope_store
    assert rope_store is not None

    def counted(*args, **kwargs):
        stores.append(args[0].shape[0])
        return rope_store(*args, **kwargs)

    ours.model.set_ops(dataclasses.replace(ours.model.ops, rope_store=counted))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 40))
    for prompts in ([prompt], [[*prompt, 50, 51, 52]]):  # the second finds 32 tokens cached
        got = [[e.generate(p, params) for p in prompts] for e in (ours, plain)]
        with decode_step.eager():
            for g in got[0] + got[1]:
                list(g)
        assert [g.result.token_ids for g in got[0]] == [g.result.token_ids for g in got[1]]
    layers = ours.cfg.num_layers
    assert len(stores) == layers * (1 + 7 + 1 + 7) and stores[layers * 8] == 8
