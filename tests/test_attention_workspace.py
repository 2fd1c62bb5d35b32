"""Each attention backend's workspace term (engine/attention), which the memory plan and the
pool profile reserve per token of context a step reads, against what a step's attention
really allocates here: a decode step and a prefill chunk, each at two context lengths, the
bytes that grow with the context counted from the CPU allocator's record of every allocation
(the step's context built, then one layer attended). Plan and measure agree within 10%."""

from __future__ import annotations

import pytest
import torch

from engine.attention import PagedBackend, TritonBackend
from engine.kernels import paged_decode, triton_support
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.model.config import ModelConfig
from tests.test_memory_plan_paths import peak_allocated

#: one layer of heads our Triton kernels take; a context long enough to dwarf the constants
CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=512, intermediate_size=128,
                  num_layers=1, num_heads=8, num_kv_heads=2, head_dim=64,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=1e4,
                  tie_word_embeddings=False, attention_bias=False)  # fmt: skip
BATCH, CHUNK, CONTEXTS = 8, 256, (1024, 3072)
#: Triton's interpreter runs a program per row and tile in Python: fewer rows, for seconds
#: (decode: contexts past where the kernel's split count stops growing with the context)
INTERPRETED_BATCH = 2
INTERPRETED_CONTEXTS = {"decode": (1024, 2048), "prefill": (128, 384)}


def step_bytes(backend, kind: str, context: int, dtype: torch.dtype, batch: int) -> int:
    """The most bytes one step's attention held at once: its context built and one layer
    attended, at ``context`` tokens before the step, less the output (the step's own)."""
    blocks = (context + CHUNK + 16) * (batch if kind == "decode" else 1) // 16 + 8
    cache = PagedKVCache(CFG, num_blocks=blocks, block_size=16, dtype=dtype, attention=backend)
    torch.manual_seed(0)
    for pool in cache.kv:
        pool.normal_()
    if kind == "decode":
        chunks = [SeqChunk(f"s{b}", context, 1) for b in range(batch)]
    else:
        chunks = [SeqChunk("p", context, CHUNK)]
    for c in chunks:
        cache.manager.grow(c.seq_id, c.start + c.length)
    rows = sum(c.length for c in chunks)
    q = torch.randn(rows, CFG.num_heads, CFG.head_dim, dtype=dtype)
    kv = torch.randn(rows, 2 * CFG.num_kv_heads, CFG.head_dim, dtype=dtype)
    out, peak, _ = peak_allocated(lambda: cache.context(chunks).attend(0, q, kv))
    return peak - out.numel() * out.element_size()


def measured_per_token(backend, kind: str, dtype: torch.dtype) -> float:
    interpreted = isinstance(backend, TritonBackend)
    contexts = INTERPRETED_CONTEXTS[kind] if interpreted else CONTEXTS
    batch = INTERPRETED_BATCH if interpreted else BATCH
    low, high = (step_bytes(backend, kind, n, dtype, batch) for n in contexts)
    return (high - low) / (contexts[1] - contexts[0])


def planned_per_token(backend, kind: str, dtype: torch.dtype) -> int:
    if kind == "decode":
        return (
            backend.workspace_bytes_per_token(CFG, dtype, BATCH, 0)
            if isinstance(backend, TritonBackend)
            else backend.decode_bytes_per_token(CFG, dtype, BATCH)
        )
    if isinstance(backend, TritonBackend):
        return backend.workspace_bytes_per_token(CFG, dtype, 0, CHUNK)
    return backend.prefill_bytes_per_token(CFG, dtype, CHUNK)


CASES = [
    ("torch", "decode", torch.float32), ("torch", "prefill", torch.float32),
    ("torch", "prefill", torch.bfloat16), ("c", "decode", torch.float32),
    ("c", "prefill", torch.float32), ("c", "prefill", torch.bfloat16),
    ("triton", "decode", torch.float32), ("triton", "prefill", torch.float32),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kind", "dtype"), CASES)
def test_the_planned_workspace_is_what_a_step_allocates(monkeypatch, name, kind, dtype):
    monkeypatch.setenv(paged_decode.ENV, {"torch": "gather", "c": "paged"}.get(name, "auto"))
    paged_decode.kernel.cache_clear()
    try:
        if name == "triton":
            if not triton_support.interpreting():
                pytest.skip("our Triton kernels run here only in Triton's interpreter")
            backend = TritonBackend()
        else:
            backend = PagedBackend("cpu")
            if name == "c":
                monkeypatch.setattr(paged_decode, "prefill_faster", lambda *a: True)
        measured = measured_per_token(backend, kind, dtype)
        planned = planned_per_token(backend, kind, dtype)
    finally:
        monkeypatch.undo()
        paged_decode.kernel.cache_clear()
        paged_decode.kernel()
    if planned < 64:  # nothing that grows with the context but its indices
        assert measured <= 64, f"{measured:.0f} B a token measured, {planned} planned"
        return
    assert measured == pytest.approx(planned, rel=0.10), f"{measured:.0f} B vs {planned} B"


def test_the_plan_takes_the_backends_term():
    """What the memory plan reserves per token is the chosen backend's: none through ours,
    the torch path's gather on a GPU without them."""
    cuda = torch.device("cuda")
    assert TritonBackend().workspace_bytes_per_token(CFG, torch.bfloat16, 16, 512) == 0
    torch_path = PagedBackend(cuda)
    assert (
        torch_path.workspace_bytes_per_token(CFG, torch.bfloat16, 16, 512)
        == max(
            torch_path.decode_bytes_per_token(CFG, torch.bfloat16, 16),
            torch_path.prefill_bytes_per_token(CFG, torch.bfloat16, 512),
        )
        > 0
    )
