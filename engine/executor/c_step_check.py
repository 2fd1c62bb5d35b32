"""The C decode step's check (:mod:`engine.executor.c_step`), run in a child process
before a load uses the step, once per set of builds: new C that crashes there leaves loads on
the eager step, as every kernel of ours is checked before it runs."""

from __future__ import annotations

from typing import cast

import torch

from engine.attention.paged import PagedBackend
from engine.executor import c_step
from engine.executor.step import StepExecutor
from engine.kernels import decode_step, gemv, verify
from engine.kernels.packed_linear import GemvLinear
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.model.config import ModelConfig
from engine.model.mlp import MLP
from engine.model.transformer import DecoderLayer, Transformer

PROBE = f"{__name__}:check"
NAME = "C decode step"
#: The finest the logits are checked to (:func:`engine.kernels.verify.tolerance`'s floor),
#: binding fp32 only: the 1e-4 it had before the policy, kept as a stated exception. The
#: policy's 6e-5 sums the depth's rounding errors as independent, where each layer also
#: carries the errors before it through its gain, which the policy does not model (measured
#: here: 2.6e-7).
FINEST = 1e-4


def verdict() -> str:
    """The check's verdict for this machine's builds ("" where it passed): read from
    ``probes.json``, else run in a child process now."""
    from engine.hardware import isolated

    return isolated.verdict(NAME, PROBE, decode_step.builds())


def check() -> str:
    """A tiny random Llama on our GEMV, fp32 and bf16: two sequences of different lengths
    prefilled through the modules, then one decode step through the C step and through the
    modules, whose logits must agree within :func:`tolerance`; "" where they do."""
    if not gemv.library().available:
        return f"no GEMV to check it on ({gemv.library().why})"
    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, attention_bias=False)  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        problem = _check(cfg, dtype, tolerance(cfg, dtype, CONTEXT))
        if problem:
            return problem
    return ""


def tolerance(cfg: ModelConfig, dtype: torch.dtype, context: int) -> float:
    """The logits' bound: the policy (:func:`engine.kernels.verify.tolerance`) for the sums
    along the depth, the layers' widths times the layers: per layer the input norm's, q/k/v's,
    the post-attention norm's and gate/up's (``hidden`` each), a score's and an output's
    (``head_dim`` and ``context``), o's (``heads · head_dim``) and down's (``intermediate``);
    then the final norm's and the head's (``hidden`` each). Roundings: two (one each side)
    at every place the C step computes apart from the modules, where a value may round
    otherwise: per layer the two norms, the attention and SiLU · up, then the final norm (the
    products are the same GEMV on both sides). fp32 floored at :data:`FINEST`."""
    attention = cfg.head_dim + context + cfg.num_heads * cfg.head_dim
    layer = 4 * cfg.hidden_size + attention + cfg.intermediate_size
    reduction = cfg.num_layers * layer + 2 * cfg.hidden_size
    places = 4 * cfg.num_layers + 1
    return verify.tolerance(dtype, reduction, roundings=2 * places, finest=FINEST)


#: the longest context of the check's decode step (its longer sequence's, the new token's too)
CONTEXT = 8


def _check(cfg: ModelConfig, dtype: torch.dtype, tolerance: float) -> str:
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1).add_(1.0 if "norm" in name else 0.0)
    for module in model.layers:
        layer = cast(DecoderLayer, module)
        attn, mlp = layer.attn, cast(MLP, layer.mlp)  # a dense model
        attn.qkv_proj = GemvLinear.of(attn.qkv_proj)
        attn.o_proj = GemvLinear.of(attn.o_proj)
        mlp.gate_up_proj = GemvLinear.of(mlp.gate_up_proj)
        mlp.down_proj = GemvLinear.of(mlp.down_proj)
    model.lm_head = GemvLinear.of(model.lm_head)
    model = model.to(dtype).eval()
    step, why = c_step.planned(model, dtype)
    if step is None:
        return why
    executor = StepExecutor(model)
    executor.c_step = step
    cache = PagedKVCache(cfg, num_blocks=8, block_size=4, dtype=dtype, attention=PagedBackend())
    lengths = {"a": CONTEXT - 1, "b": 3}
    for seq, n in lengths.items():
        cache.manager.grow(seq, n + 1)
        model(torch.arange(n) + 5, torch.arange(n), cache.context([SeqChunk(seq, 0, n)]))
    ids = torch.tensor([11, 12])
    positions = torch.tensor(list(lengths.values()))
    chunks = [SeqChunk(seq, n, 1) for seq, n in lengths.items()]
    with step.clocked():
        got = executor.forward(ids, positions, cache.context(chunks))  # the C step
    if step.steps != 1 or executor.ran != {("decode", "c-step"): 1}:
        return "the C step did not run the step"
    want = model(ids, positions, cache.context(chunks))  # the modules, over the same K/V
    return verify.differs(f"{dtype} logits (the eager step's)", got, want, tolerance)
