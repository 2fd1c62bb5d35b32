"""Weight-only INT8 / INT4: round trips, packed kernels against dequantize-then-matmul,
precision specs and quantized loading."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.formats.int4 import dequantize_int4, quantize_int4
from engine.formats.int8 import dequantize_int8, quantize_int8
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels import lowbit
from engine.kernels.packed_linear import PackedLinear
from engine.loader.load import load_model
from engine.quant.int4 import Int4Linear, padded_width
from engine.quant.int8 import Int8Linear
from engine.quant.spec import parse_precision_spec
from tests.probed import needs_int4, precisions

SHAPES = [(64, 96), (192, 576), (96, 1536), (40, 128)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_round_trip_error_is_at_most_half_a_step(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (192, 640), (96, 1536)])
def test_int4_round_trip_error_is_at_most_half_a_step(n, k, group):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(group + n)) * 0.05
    q, scale, zero = quantize_int4(w, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    err = (dequantize_int4(q, scale, zero, group) - w).abs().reshape(n, k // group, group)
    step = scale.float()[..., None]
    assert (err <= step / 2 + 1e-6).all()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_int8_kernel_equals_dequantized_matmul(n, k, m):
    gen = torch.Generator().manual_seed(m * n)
    w, b = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)
    layer = Int8Linear(w, b, torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    reference = x.float() @ dequantize_int8(layer.weight, layer.scales).T + b.bfloat16().float()
    assert _relative_error(layer(x), reference) <= 1e-2


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (192, 576), (96, 1536), (40, 96)])
@pytest.mark.parametrize("m", [1, 9])
@needs_int4
def test_int4_kernel_equals_dequantized_matmul_including_padded_k(n, k, m, group):
    gen = torch.Generator().manual_seed(m + n + group)
    w = torch.randn(n, k, generator=gen) * 0.05
    layer = Int4Linear(w, None, group)
    kp = padded_width(k, group)
    assert layer.padded_k == kp - k
    q, scale, zero = quantize_int4(torch.nn.functional.pad(w, (0, kp - k)), group)
    dq = dequantize_int4(q, scale, zero, group)[:, :k]
    x = torch.randn(2, m, k, generator=gen).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (2, m, n)
    assert _relative_error(out, x.float() @ dq.T) <= 1e-2


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("fp32", {}),
        ("int8", {"attn": "int8", "mlp": "int8"}),
        pytest.param("int4-g64", {"attn": "int4-g64", "mlp": "int4-g64"}, marks=needs_int4),
        pytest.param(
            "mixed:attn=int8,mlp=int4-g32", {"attn": "int8", "mlp": "int4-g32"}, marks=needs_int4
        ),
        ("mixed:attn=none,mlp=int8,head=int8", {"mlp": "int8", "head": "int8"}),
        pytest.param(  # llama.cpp Q4_1's own head: INT8 beside the INT4 body
            "int4-g32+head8",
            {"attn": "int4-g32", "mlp": "int4-g32", "head": "int8"},
            marks=needs_int4,
        ),
    ],
)
def test_precision_specs(text, parts):
    spec = parse_precision_spec(text)
    assert {k: v.name for k, v in spec.parts.items()} == parts
    assert spec.compute == (torch.float32 if text == "fp32" else torch.bfloat16)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("int3", "unknown precision 'int3'"),
        ("int4-g48", "group size 48"),
        ("int4", "unknown precision 'int4'"),
        ("mixed:attn=int8,ffn=int4-g32", "part=kind"),
        ("mixed:attn=none", "quantizes nothing"),
    ],
)
def test_bad_precision_specs_name_what_is_available(text, needle):
    with pytest.raises(InvalidRequestError, match=needle) as info:
        parse_precision_spec(text)
    assert "int4-g32" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm80+)")
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_int4_equals_reference(group):
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(256, 576, generator=gen) * 0.05
    layer = Int4Linear(w.cuda(), None, group)
    kp = padded_width(576, group)
    q, scale, zero = quantize_int4(torch.nn.functional.pad(w, (0, kp - 576)), group)
    dq = dequantize_int4(q, scale, zero, group)[:, :576]
    x = torch.randn(5, 576, generator=gen).to(torch.bfloat16)
    assert _relative_error(layer(x.cuda()).cpu(), x.float() @ dq.T) <= 1e-2


# -- quantized models ------------------------------------------------------------------------

from engine.core.engine import LLMEngine  # noqa: E402
from engine.quant.embedding import QuantizedEmbedding  # noqa: E402


@pytest.mark.parametrize("spec", precisions("int8+head", "int4-g32+head", "int4-g128+head"))
def test_tied_quantized_head_serves_the_embedding_exactly(tiny_model_dir, spec):
    folder, _ = tiny_model_dir("llama", True)
    engine = load_model(folder, precision=spec)
    embed, head = engine.model.embed, engine.model.lm_head
    assert isinstance(embed, QuantizedEmbedding)
    # Row i of the embedding is the head's dequantized weight row i: probe the head with the
    # unit vectors of its input space (x @ Wᵀ with x = I gives Wᵀ).
    k = head.in_features
    dense = head(torch.eye(k, dtype=torch.bfloat16)).float().T  # [V, K] = W·diag(s)
    ids = torch.tensor([0, 5, 17, 300, 319])
    expected = dense[ids] * embed.inverse_scale  # the head's channel scaling undone
    assert torch.allclose(embed(ids).float(), expected, rtol=1e-2, atol=1e-3)


def _dequantized_reference(folder, spec_text: str) -> LLMEngine:
    """The oracle: a plain bf16 model whose quantized weights are replaced by their
    dequantized values (computed here with the reference functions), run through nn.Linear."""
    from torch import nn

    from engine.quant.embedding import head_channel_scale
    from engine.quant.spec import part_of

    spec = parse_precision_spec(spec_text)
    engine = load_model(folder, precision="fp32", pack=False)
    model = engine.model
    tied = model.lm_head.weight is model.embed.weight
    for name, module in list(model.named_modules()):
        kind = spec.parts.get(part_of(name) or "")
        if type(module) is not nn.Linear or kind is None:
            continue
        w = module.weight.detach().float()
        channel = head_channel_scale(model.norm.weight) if name == "lm_head" else torch.ones(1)
        w = w * channel
        if kind.bits == 8:
            scale = (w.abs().amax(1) / 127).clamp(min=1e-12).bfloat16().float()
            dq = torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]
        else:
            k = w.shape[1]
            padded = torch.nn.functional.pad(w, (0, padded_width(k, kind.group) - k))
            q, sc, z = quantize_int4(padded, kind.group)
            dq = dequantize_int4(q, sc, z, kind.group)[:, :k]
        module.weight = nn.Parameter(dq / channel, requires_grad=False)
        if name == "lm_head" and tied:
            model.embed.weight = module.weight
    model.to(torch.bfloat16)
    engine.dtype = engine.runner.dtype = torch.bfloat16  # its caches hold bf16 too
    return engine


@pytest.mark.parametrize(
    "spec",
    precisions("int8", "int4-g32", "int4-g128+head", "mixed:attn=int8,mlp=int4-g64,head=int8"),
)
@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False)])
def test_quantized_model_equals_its_dequantized_reference(tiny_model_dir, spec, arch, tied):
    folder, _ = tiny_model_dir(arch, tied)
    ids = list(range(3, 40))
    quantized = load_model(folder, precision=spec)
    reference = _dequantized_reference(folder, spec)
    ours = quantized.runner.forward_logits(ids, quantized.runner.new_cache(len(ids)), 0)
    theirs = reference.runner.forward_logits(ids, reference.runner.new_cache(len(ids)), 0)
    assert _relative_error(ours, theirs) <= 2e-2


@needs_int4
def test_weight_bytes_of_the_default_model_against_fp16(default_model):
    fp16_bytes = None
    ratios = {}
    for spec in ("fp16", "int8+head", "int4-g32+head"):
        engine = load_model(default_model, precision=spec, pack=False)
        if spec == "fp16":
            fp16_bytes = engine.weights_bytes
            assert fp16_bytes == 2 * engine.num_parameters
        ratios[spec] = engine.weights_bytes / fp16_bytes
    assert ratios["int8+head"] <= 0.52
    assert ratios["int4-g32+head"] <= 0.32


def test_int4_on_an_old_cuda_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(InvalidRequestError, match=r"compute capability 8\.0"):
        parse_precision_spec("int4-g32", "cuda")
    assert parse_precision_spec("int8", "cuda").parts["attn"].bits == 8


@pytest.mark.parametrize(
    "spec", precisions("fp32", "bf16", "int8", "int4-g128+head", "mixed:mlp=int4-g32")
)
def test_load_report_accounts_for_every_byte(tiny_model_dir, spec):
    from engine.quant.inventory import weight_report

    folder, _ = tiny_model_dir("qwen2", False)
    engine = load_model(folder, precision=spec)
    report = weight_report(engine.model)
    assert sum(g.nbytes for g in report) == engine.weights_bytes
    forms = {g.form for g in report}
    if spec == "int4-g128+head":  # hidden 64 is padded to one group of 128
        assert "int4-g128 (int4 kernel), K padded +64" in forms


# -- per-layer overrides in mixed specs, and the weight-byte estimate ------------------------

from engine.quant.sizes import block_bytes, estimate_weight_bytes  # noqa: E402
from engine.quant.spec import QuantKind, format_mixed_spec  # noqa: E402

INT8, G32, G128 = QuantKind(8), QuantKind(4, 32), QuantKind(4, 128)


@needs_int4
def test_per_layer_overrides_beat_the_part_default():
    spec = parse_precision_spec(
        "mixed:attn=int4-g128,mlp=int4-g128,mlp.3=int8,attn.0-2=int8,mlp.7=none"
    )
    assert spec.layers == {
        ("mlp", 3): INT8,
        ("attn", 0): INT8,
        ("attn", 1): INT8,
        ("attn", 2): INT8,
        ("mlp", 7): None,
    }
    assert spec.kind_for("layers.3.mlp.down_proj") == INT8
    assert spec.kind_for("layers.3.attn.qkv_proj") == G128
    assert spec.kind_for("layers.2.attn.o_proj") == INT8
    assert spec.kind_for("layers.7.mlp.gate_up_proj") is None
    assert spec.kind_for("layers.12.mlp.gate_up_proj") == G128
    assert spec.kind_for("lm_head") is None
    assert spec.kind_for("layers.0.input_norm") is None
    assert spec.compute == torch.bfloat16


def test_an_override_alone_quantizes():
    spec = parse_precision_spec("mixed:attn=none,mlp=none,mlp.3=int8")
    assert spec.quantized and spec.compute == torch.bfloat16 and not spec.parts
    assert spec.kind_for("layers.3.mlp.down_proj") == INT8
    assert spec.kind_for("layers.2.mlp.down_proj") is None
    with pytest.raises(InvalidRequestError, match="quantizes nothing"):
        parse_precision_spec("mixed:attn=none,mlp=none,mlp.3=none")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("mixed:attn=int8,ffn.3=int8", "'ffn' is no part"),
        ("mixed:attn=int8,head.0=int8", "the LM head has no layers"),
        ("mixed:attn=int8,mlp.x=int8", r"'x' in 'mlp.x=int8'.*is not a layer index.*mlp\.N-M"),
        ("mixed:attn=int8,mlp.1.5=int8", "is not a layer index"),
        ("mixed:attn=int8,mlp.-1=int8", "is not a layer index"),
        ("mixed:attn=int8,mlp.5-2=int8", "runs backwards; write mlp.2-5"),
        ("mixed:attn=int8,mlp.0-999999999=int8", "past any model's last layer"),
        ("mixed:attn=int8,mlp.0-3=int8,mlp.3=none", "mlp.3 is given more than one format"),
        ("mixed:attn=int8,mlp.3=int5", "unknown precision"),
    ],
)
def test_bad_overrides_say_what_to_write(text, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        parse_precision_spec(text)


def test_overrides_beyond_the_model_are_refused_at_load(tiny_model_dir):
    folder, _ = tiny_model_dir("llama", True)  # 3 layers
    with pytest.raises(InvalidRequestError, match=r"mlp\.3, but this model has 3 layers"):
        load_model(folder, precision="mixed:attn=int8,mlp=int8,mlp.1-3=none")


def test_int4_in_an_override_needs_the_kernel(monkeypatch):
    from types import SimpleNamespace

    from engine.hardware.cpu_paths import PathProbe
    from engine.quant import spec

    off = SimpleNamespace(int4_kernel=PathProbe(False, "switched off for the test"))
    monkeypatch.setattr(spec, "cpu_paths", lambda: off)
    with pytest.raises(InvalidRequestError, match="switched off for the test"):
        parse_precision_spec("mixed:attn=int8,mlp=int8,mlp.2=int4-g32")
    assert parse_precision_spec("mixed:attn=int8,mlp=int8,mlp.2=none").quantized
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(InvalidRequestError, match=r"compute capability 8\.0"):
        parse_precision_spec("mixed:attn=int8,mlp=none,attn.1=int4-g64", "cuda")


@needs_int4
def test_a_loaded_model_follows_its_overrides(tiny_model_dir):
    from torch import nn

    folder, _ = tiny_model_dir("qwen2", False)
    engine = load_model(
        folder, precision="mixed:attn=int4-g32,mlp=int4-g32,mlp.1=int8,attn.0-1=none"
    )
    layers = engine.model.layers
    # the blocks left in bf16 take the layout the probe found for bf16 on this CPU
    plain = PackedLinear if cpu_paths().packed_bf16.ok else nn.Linear
    assert [type(layer.attn.qkv_proj) for layer in layers] == [plain, plain, Int4Linear]
    assert [type(layer.mlp.down_proj) for layer in layers] == [Int4Linear, Int8Linear, Int4Linear]
    assert layers[0].attn.qkv_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("attn", "mlp", "head", "overrides", "text"),
    [
        (G32, G32, None, {}, "mixed:attn=int4-g32,mlp=int4-g32"),
        (
            G32,
            G32,
            None,
            {("mlp", 0): INT8, ("mlp", 1): INT8, ("attn", 5): INT8},
            "mixed:attn=int4-g32,mlp=int4-g32,attn.5=int8,mlp.0-1=int8",
        ),
        (
            G128,
            None,
            INT8,
            {("attn", 0): INT8, ("attn", 1): None, ("attn", 2): None, ("attn", 4): None,
             ("mlp", 2): G32, ("mlp", 3): G32, ("mlp", 4): None, ("mlp", 6): None},
            "mixed:attn=int4-g128,mlp=none,head=int8,attn.0=int8,attn.1-2=none,attn.4=none,"
            "mlp.2-3=int4-g32",
        ),
        # an override equal to its default says nothing, and is dropped
        (INT8, None, None, {("attn", 1): INT8, ("mlp", 2): None}, "mixed:attn=int8,mlp=none"),
    ],
)  # fmt: skip
@needs_int4
def test_format_mixed_spec_round_trips(attn, mlp, head, overrides, text):
    written = format_mixed_spec(attn, mlp, head, overrides)
    assert written == text
    spec = parse_precision_spec(written)
    assert spec.parts == {k: v for k, v in {"attn": attn, "mlp": mlp, "head": head}.items() if v}
    defaults = {"attn": attn, "mlp": mlp}
    assert spec.layers == {key: k for key, k in overrides.items() if k != defaults[key[0]]}
    again = format_mixed_spec(
        spec.parts.get("attn"), spec.parts.get("mlp"), spec.parts.get("head"), spec.layers
    )
    assert again == written


ESTIMATED_SPECS = [
    "fp32",
    "bf16",
    "int8",
    "int4-g32",
    "w8a8",
    "int8+head",
    "int4-g64+head",
    "mixed:attn=int4-g128,mlp=int4-g32,head=int8,attn.0-1=none,mlp.1=int8",
    "mixed:attn=none,mlp=none,mlp.2=int4-g64",
]


@pytest.mark.parametrize("spec", precisions(*ESTIMATED_SPECS))
@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False)]
)
@pytest.mark.parametrize("mode", ["torch", "ours"])
def test_estimate_weight_bytes_is_exact(tiny_model_dir, spec, arch, tied, mode):
    """With the kernels forced (``INFERSIGHT_LOWBIT``), the estimate is the load's bytes to the
    byte; left to the timings, it is what the load could hold at most."""
    from engine.model.config import ModelConfig
    from engine.quant.sizes import Backends

    folder, _ = tiny_model_dir(arch, tied)
    cfg = ModelConfig.from_file(folder / "config.json")
    parsed = parse_precision_spec(spec)
    backends = Backends(c_kernels=mode == "ours")
    with lowbit.choosing(mode):
        # The default load packs float linears where this CPU's oneDNN path runs their dtype.
        packed = load_model(folder, precision=spec).weights_bytes
        assert estimate_weight_bytes(cfg, parsed, backends=backends) == packed
        unpacked = load_model(folder, precision=spec, pack=False).weights_bytes
        assert estimate_weight_bytes(cfg, parsed, packed=False, backends=backends) == unpacked
    timed = load_model(folder, precision=spec).weights_bytes
    assert timed <= estimate_weight_bytes(cfg, parsed)


@pytest.mark.parametrize("spec", precisions("bf16", "int8", "int4-g32", "int4-g128"))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_block_bytes_is_one_block(tiny_model_dir, spec, arch):
    from engine.model.config import ModelConfig
    from engine.model.inventory import weight_bytes

    folder, _ = tiny_model_dir(arch, arch == "llama")
    cfg = ModelConfig.from_file(folder / "config.json")
    engine = load_model(folder, precision=spec, pack=False)
    kind = parse_precision_spec(spec).parts.get("attn")
    layer = engine.model.layers[1]
    assert weight_bytes(layer.attn) == block_bytes(cfg, "attn", kind, engine.dtype)
    assert weight_bytes(layer.mlp) == block_bytes(cfg, "mlp", kind, engine.dtype)


@pytest.mark.parametrize(("n", "k", "group"), [(1040, 576, 32), (200, 100, 64), (1000, 96, 128)])
def test_quantizing_a_chunk_of_rows_at_a_time_equals_the_whole_matrix(monkeypatch, n, k, group):
    """The bounded load quantizes 32 MiB of rows at a time and packs INT4 per block of rows
    (the CPU layout's blocks, probed on this CPU kind): bit for bit what one whole-matrix
    pass gives, padding rows and columns included."""
    from engine import formats

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    monkeypatch.setattr(formats, "QUANT_CHUNK_BYTES", 1 << 40)
    whole4, whole8 = Int4Linear(w, None, group), Int8Linear(w, None, torch.bfloat16)
    monkeypatch.setattr(formats, "QUANT_CHUNK_BYTES", 64 * 1024)  # many chunks
    assert len(formats.row_chunks(n, k)) > 1
    part4, part8 = Int4Linear(w, None, group), Int8Linear(w, None, torch.bfloat16)
    assert torch.equal(whole4.weight, part4.weight)
    assert torch.equal(whole4.scales_and_zeros, part4.scales_and_zeros)
    assert torch.equal(whole8.weight, part8.weight) and torch.equal(whole8.scales, part8.scales)


def test_int8_widths_torchs_cpu_kernel_cannot_take_convert_per_call() -> None:
    """torch 2.13's CPU INT8 kernel crashes the process on more than one row where K is not a
    multiple of 16 (K = 40, 72, 136 did): such a layer converts its weights per call instead,
    and a prefill chunk through it gives the dequantized product."""
    from engine.quant.int8 import CPU_KERNEL_K

    gen = torch.Generator().manual_seed(0)
    layer = Int8Linear(torch.randn(24, 40, generator=gen), None, torch.bfloat16)
    assert 40 % CPU_KERNEL_K and not layer.use_kernel
    x = torch.randn(17, 40, generator=gen).bfloat16()
    want = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).t()
    torch.testing.assert_close(layer(x).double(), want, rtol=2**-6, atol=2e-2)
