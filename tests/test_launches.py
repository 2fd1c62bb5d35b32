"""What a step launches: the LM head never on 0 rows (a step of mid-prompt chunks samples
nothing, and CUDA's INT4 and INT8 kernels fail on an empty grid), and the ops one decoder
layer dispatches in a decode step, pinned so that a change that adds launches is seen."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels import paged_decode
from engine.loader.load import load_model
from tests.conftest import build_tiny_hf, save_tiny
from tests.probed import precisions

#: Longer than the default step budget (512 tokens): its first chunk samples nothing.
LONG_PROMPT = 600
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tied Llama (as the default model is tied) with room for :data:`LONG_PROMPT`."""
    model = build_tiny_hf("llama", tied=True, max_position_embeddings=1024)
    return save_tiny(model, tmp_path_factory.mktemp("llama-long"))


@pytest.mark.parametrize(
    "spec", precisions("int8+head", "int4-g32+head", "mixed:attn=int8,mlp=int4-g64,head=int8")
)
def test_a_prompt_longer_than_a_step_never_runs_the_head_on_zero_rows(
    long_context_dir, spec, monkeypatch
):
    from engine.core import step as stepping

    sampled: list[int] = []  # rows of every sampler call: none for a step that samples nothing
    real_sample = stepping.sample
    monkeypatch.setattr(
        stepping,
        "sample",
        lambda logits, *a: (sampled.append(len(logits)), real_sample(logits, *a))[1],
    )
    engine = load_model(long_context_dir, precision=spec)
    model = engine.model
    head_rows: list[int] = []
    outputs: list[tuple[tuple[int, ...], torch.dtype]] = []
    model.lm_head.register_forward_pre_hook(lambda m, args: head_rows.append(args[0].shape[0]))
    model.register_forward_hook(lambda m, args, out: outputs.append((tuple(out.shape), out.dtype)))
    prompt = [3 + (7 * i) % 300 for i in range(LONG_PROMPT)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    result = engine.generate(prompt, params)
    assert len(list(result)) == NEW_TOKENS

    chunks = [r.prompt_tokens for r in engine.collector.recent if r.prompt_tokens]
    assert sum(chunks) == LONG_PROMPT and len(chunks) > 1  # the case under test happened
    # The head ran once per sampled token, on its one row; the chunk that sampled nothing
    # returned empty fp32 logits without calling it.
    assert head_rows == [1] * NEW_TOKENS
    vocab = engine.cfg.vocab_size
    assert outputs[0] == ((0, vocab), torch.float32)
    assert [shape for shape, _ in outputs[1:]] == [(1, vocab)] * NEW_TOKENS
    assert sampled == [1] * NEW_TOKENS  # nor the sampler (on a GPU, an op and a host transfer)


# -- ops per decoder layer ------------------------------------------------------------------


class LayerOps(TorchDispatchMode):
    """Counts the ops dispatched while a decoder layer's forward runs (the hooks toggle it).
    A composite op (``linear``, ``rms_norm``, SDPA) counts once: the kernels it runs are below
    this mode; a custom op's (the paged kernel's) likewise."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.inside:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def decode_ops_per_layer(engine: LLMEngine) -> dict[str, int]:
    """The ops of one eager decode step (one token of one sequence after a short prefill),
    per decoder layer; every layer must dispatch the same."""
    engine.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # the prefill and the first token
    layers = engine.model.layers
    mode = LayerOps()

    def enter(module: Any, args: Any) -> None:
        mode.inside = True

    def leave(module: Any, args: Any, output: Any) -> None:
        mode.inside = False

    handles = [layer.register_forward_pre_hook(enter) for layer in layers]
    handles += [layer.register_forward_hook(leave) for layer in layers]
    try:
        with mode:
            (event,) = engine.step()
    finally:
        for handle in handles:
            handle.remove()
    assert event.token_id is not None  # the step was the decode step
    assert all(n % len(layers) == 0 for n in mode.ops.values()), mode.ops
    return {op: n // len(layers) for op, n in mode.ops.items()}


#: One Llama decoder layer in an fp32 decode step with plain ``nn.Linear`` and the portable
#: attention (gather + SDPA): 30 ops, 13 of them views (no kernel).
PORTABLE_FP32 = {
    "aten.rms_norm.default": 2,  # the input and post-attention norms (one fused op in fp32)
    "aten.linear.default": 4,  # qkv_proj, o_proj, gate_up_proj, down_proj
    # RoPE on q and k together, in place: roll(x)·sin, x·cos, their sum written into x
    "aten.roll.default": 1,
    "aten.add.out": 1,
    "aten.mul.Tensor": 3,  # RoPE's two, and silu(gate)·up
    "aten.index_copy_.default": 1,  # the step's K/V written into the paged pool
    "aten.index_select.default": 1,  # attention: the padded gather of the context's K/V
    "aten.scaled_dot_product_attention.default": 1,  # attention itself
    "aten.silu.default": 1,  # the MLP's activation
    "aten.add.Tensor": 2,  # the two residual adds
    # views: q/k and k/v out of qkv (3 slices, 2 views), gate/up (split), the gather's
    # [B, 2·Hkv, W, D] (2 views, transpose), its K and V (2 slices), GQA's q (view), the
    # output's [B, H·D] (reshape)
    "aten.slice.Tensor": 5,
    "aten.view.default": 5,
    "aten.split.Tensor": 1,
    "aten.transpose.int": 1,
    "aten.reshape.default": 1,
}


def _replace(ops: dict[str, int], gone: dict[str, int], added: dict[str, int]) -> dict[str, int]:
    out = Counter(ops)
    out.subtract(gone)
    out.update(added)
    return {op: n for op, n in out.items() if n}


#: The portable attention's ops (gather, SDPA, their views) beyond the paged kernel's.
GATHER = {
    "aten.index_select.default": 1,
    "aten.scaled_dot_product_attention.default": 1,
    "aten.slice.Tensor": 2,
    "aten.view.default": 3,
    "aten.transpose.int": 1,
    "aten.reshape.default": 1,
}
#: The paged C kernel's, called directly by an eager step: its output and the view of it (the
#: kernel itself is a ctypes call, no operator).
PAGED_KERNEL = {"aten.empty_like.default": 1, "aten.view.default": 1}


@contextlib.contextmanager
def attention(portable: bool) -> Iterator[None]:
    with paged_decode.portable() if portable else contextlib.nullcontext():
        yield


def test_a_decode_step_dispatches_the_pinned_ops_per_layer_on_the_portable_path(tiny_model_dir):
    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder, precision="fp32", pack=False)
    with attention(portable=True):
        per_layer = decode_ops_per_layer(engine)
    assert per_layer == PORTABLE_FP32
    assert sum(per_layer.values()) == 30


def test_a_decode_step_dispatches_the_pinned_ops_per_layer_on_the_probed_paths(tiny_model_dir):
    """Every linear packed where the probe says oneDNN packs fp32 here, and the paged C kernel
    where it built and passed its check: each swaps its ops one for one (22 ops a layer with
    both; the portable 30 with neither)."""
    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder, precision="fp32", pack=True)
    with attention(portable=False):
        per_layer = decode_ops_per_layer(engine)
    expected = PORTABLE_FP32
    if cpu_paths().packed(torch.float32).ok:
        linears = {"aten.linear.default": 4}
        expected = _replace(expected, linears, {"mkldnn._linear_pointwise.default": 4})
    if paged_decode.kernel().available:
        expected = _replace(expected, GATHER, PAGED_KERNEL)
    assert per_layer == expected


def test_an_int8_decode_step_dispatches_the_pinned_ops_per_layer(tiny_model_dir):
    """INT8 computes in bf16: each norm normalises in fp32 and scales in bf16 (two casts and
    a mul more), and each linear reshapes its input and output around the int8 kernel, or,
    where the probe found none, converts its weights per call (a cast, a linear, the scales'
    mul)."""
    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder, precision="int8", pack=False)
    with attention(portable=True):
        per_layer = decode_ops_per_layer(engine)
    norms = {"aten.to.dtype": 4, "aten.mul.Tensor": 2}
    linears = {"aten.reshape.default": 8}
    if cpu_paths().int8_kernel.ok:
        linears |= {"aten._weight_int8pack_mm.default": 4}
    else:
        linears |= {"aten.to.dtype": 4, "aten.linear.default": 4, "aten.mul.Tensor": 4}
    expected = _replace(PORTABLE_FP32, {"aten.linear.default": 4}, {})
    expected = _replace(_replace(expected, {}, norms), {}, linears)
    assert per_layer == expected
