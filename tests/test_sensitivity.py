"""The layer sensitivity scan and the mixed-spec planner, on tiny random models.

The scan's shortcut (each block's run starts from the cached input of its layer) is checked
against a plain full forward of the fp32 model with the same block swapped in, built here
without the scan's machinery; the planner's sizes against real loads.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CancelledError, InvalidRequestError
from engine.evals.sensitivity import Scan, plan_mixed, scan_model, scan_sensitivity
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels.packed_linear import PackedLinear
from engine.kv_cache.contiguous import ContiguousKVCache
from engine.loader.load import load_model
from engine.loader.weights import load_transformer
from engine.model.config import ModelConfig
from engine.quant.linear import quantized_linear
from engine.quant.sizes import estimate_weight_bytes
from engine.quant.spec import QuantKind, parse_precision_spec
from tests.probed import needs_int4

TEXT = [(7 * i + 3) % 320 for i in range(48)]
LINEARS = {"attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}


@pytest.fixture(scope="module")
def scans(tiny_model_dir):
    """One int4-g32 scan per tiny model (Llama tied; Qwen2 with q/k/v biases, untied; a
    Qwen3-MoE of two layers of experts around a dense one)."""
    cache: dict[str, Scan] = {}

    def get(arch: str) -> Scan:
        if not cpu_paths().int4_kernel.ok:
            pytest.skip(f"no INT4 kernel here: {cpu_paths().int4_kernel.why}")
        if arch not in cache:
            folder, _ = tiny_model_dir(arch, arch == "llama")
            cache[arch] = scan_sensitivity(folder, "int4-g32", text_ids=TEXT)
        return cache[arch]

    return get


def _fp32_model(tiny_model_dir, arch):
    folder, _ = tiny_model_dir(arch, arch == "llama")
    cfg = ModelConfig.from_file(folder / "config.json")
    return folder, cfg, load_transformer(folder, cfg, torch.float32, torch.device("cpu"))


class _Bf16In(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.bfloat16()).float()


def _logp(model):
    """Log-probs of TEXT by ``Transformer.forward``."""
    cache = ContiguousKVCache(model.cfg, slots=1, capacity=len(TEXT), dtype=torch.float32)
    ids = torch.tensor(TEXT)
    logits = model(ids, torch.arange(len(TEXT)), cache.context([0], [0], [len(TEXT)]))
    return F.log_softmax(logits, dim=-1)


def _full_forward_kl(model, blocks: list[tuple[int, str]], kind: QuantKind) -> float:
    """KL(reference ‖ model with ``blocks`` quantized), both by ``Transformer.forward``."""

    def logp():
        return _logp(model)

    reference = logp()
    saved = []
    for layer, part in blocks:
        block = getattr(model.layers[layer], part)
        # a layer of experts: each expert's products, wherever they sit in the block
        owners = [
            (owner, attr)
            for owner in block.modules()
            for attr in LINEARS[part]
            if type(getattr(owner, attr, None)) is nn.Linear
        ]
        for owner, attr in owners:
            linear = getattr(owner, attr)
            saved.append((owner, attr, linear))
            with torch.inference_mode():
                setattr(owner, attr, _Bf16In(quantized_linear(linear.weight, linear.bias, kind)))
    ours = logp()
    for block, attr, linear in saved:
        setattr(block, attr, linear)
    return float((reference.exp() * (reference - ours)).sum(-1).mean())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_block_kls_equal_a_full_forward_with_that_block_quantized(tiny_model_dir, scans, arch):
    scan = scans(arch)
    _, cfg, model = _fp32_model(tiny_model_dir, arch)
    assert [(b.layer, b.part) for b in scan.blocks] == [
        (layer, part) for layer in range(cfg.num_layers) for part in ("attn", "mlp")
    ]
    for block in scan.blocks:
        assert block.kl > 0
        direct = _full_forward_kl(model, [(block.layer, block.part)], QuantKind(4, 32))
        assert block.kl == pytest.approx(direct, rel=1e-5, abs=1e-8)
    every = [(b.layer, b.part) for b in scan.blocks]
    assert scan.all_low_kl == pytest.approx(
        _full_forward_kl(model, every, QuantKind(4, 32)), rel=1e-5, abs=1e-8
    )
    assert scan.text_tokens == len(TEXT) and scan.low == "int4-g32" and scan.high == "int8"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_scan_sizes_are_the_loaded_sizes(tiny_model_dir, scans, arch):
    folder, _ = tiny_model_dir(arch, arch == "llama")
    scan = scans(arch)
    low = load_model(folder, precision="mixed:attn=int4-g32,mlp=int4-g32").weights_bytes
    high = load_model(folder, precision="mixed:attn=int8,mlp=int8").weights_bytes
    assert (scan.min_bytes, scan.max_bytes) == (low, high)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("share", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_a_plan_fits_its_budget_and_loads_at_its_size(tiny_model_dir, scans, arch, share):
    folder, _ = tiny_model_dir(arch, arch == "llama")
    cfg = ModelConfig.from_file(folder / "config.json")
    scan = scans(arch)
    budget = scan.min_bytes + int(share * (scan.max_bytes - scan.min_bytes))
    plan = plan_mixed(scan, budget)
    assert plan.bytes <= budget and plan.budget_bytes == budget
    assert plan.bytes == estimate_weight_bytes(cfg, parse_precision_spec(plan.spec))
    assert plan.bytes == load_model(folder, precision=plan.spec).weights_bytes
    spec = parse_precision_spec(plan.spec)
    assert {(layer, part) for (part, layer) in spec.layers} == set(plan.upgraded)
    kept = {(b.layer, b.part): b for b in scan.blocks}
    assert plan.predicted_kl == pytest.approx(
        max(0.0, scan.all_low_kl - sum(kept[key].kl for key in plan.upgraded))
    )
    if share == 0.0:
        assert plan.upgraded == [] and plan.spec == "mixed:attn=int4-g32,mlp=int4-g32"
        assert plan.bytes == scan.min_bytes
    if share == 1.0:
        assert len(plan.upgraded) == len(scan.blocks) and plan.bytes == scan.max_bytes
        assert plan.spec == "mixed:attn=int4-g32,mlp=int4-g32,attn.0-2=int8,mlp.0-2=int8"


def test_the_plan_keeps_the_most_kl_per_byte(scans):
    scan = scans("llama")
    best = max(scan.blocks, key=lambda b: b.kl / (b.bytes_high - b.bytes_low))
    plan = plan_mixed(scan, scan.min_bytes + best.bytes_high - best.bytes_low)
    assert plan.upgraded == [(best.layer, best.part)]


def test_a_budget_below_the_smallest_size_says_the_smallest(scans):
    scan = scans("llama")
    with pytest.raises(InvalidRequestError, match=f"{scan.min_bytes} bytes"):
        plan_mixed(scan, scan.min_bytes - 1)


def test_scan_and_plan_are_plain_json(scans):
    scan = scans("qwen2")
    data = json.loads(json.dumps(scan.to_dict()))
    assert data["min_bytes"] == scan.min_bytes and data["max_bytes"] == scan.max_bytes
    assert set(data["blocks"][0]) == {"layer", "part", "kl", "bytes_low", "bytes_high"}
    assert Scan.from_dict(data) == scan
    plan = json.loads(json.dumps(plan_mixed(scan, scan.max_bytes).to_dict()))
    assert plan["upgraded"][0].keys() == {"layer", "part"}
    with pytest.raises(InvalidRequestError, match="not a sensitivity scan"):
        Scan.from_dict({"model": "x"})


def test_int8_low_keeps_blocks_in_bf16_above_it(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2", False)
    scan = scan_sensitivity(folder, "int8", text_ids=TEXT[:16])
    assert scan.high == "none" and all(b.kl >= 0 for b in scan.blocks)
    plan = plan_mixed(scan, scan.max_bytes)
    assert plan.spec == "mixed:attn=int8,mlp=int8,attn.0-2=none,mlp.0-2=none"
    engine = load_model(folder, precision=plan.spec)
    assert engine.weights_bytes == plan.bytes == scan.max_bytes
    # the block left in bf16 takes the layout the probe found for bf16 on this CPU
    plain = PackedLinear if cpu_paths().packed_bf16.ok else nn.Linear
    assert type(engine.model.layers[2].mlp.down_proj) is plain


@pytest.mark.parametrize(
    ("low", "high", "needle"),
    [
        ("none", None, "low format must be quantized"),
        ("int3", None, "unknown precision 'int3'"),
        pytest.param(
            "int8",
            "int4-g32",
            r"high \(int4-g32\) does not store a block in more bytes",
            marks=needs_int4,
        ),
        pytest.param(
            "int4-g32", "int4-g32", "does not store a block in more bytes", marks=needs_int4
        ),
    ],
)
def test_bad_formats_are_refused(tiny_model_dir, low, high, needle):
    folder, _ = tiny_model_dir("llama", True)
    with pytest.raises(InvalidRequestError, match=needle):
        scan_sensitivity(folder, low, high=high, text_ids=TEXT)


def test_cancelling_leaves_the_model_as_it_was(tiny_model_dir):
    _, _, model = _fp32_model(tiny_model_dir, "llama")
    before = [(name, type(m), id(m)) for name, m in model.named_modules()]
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))
        if done == 3:
            raise CancelledError("stop")

    with pytest.raises(CancelledError):
        scan_model(model, QuantKind(4, 32), QuantKind(8), TEXT, progress=progress)
    assert calls == [(1, 7), (2, 7), (3, 7)]
    assert [(name, type(m), id(m)) for name, m in model.named_modules()] == before
    # and the model still scans, finishing with the all-low pass
    done = []
    scan_model(model, QuantKind(4, 32), QuantKind(8), TEXT, progress=lambda d, t: done.append(d))
    assert done == list(range(1, 8))
    assert [(name, type(m), id(m)) for name, m in model.named_modules()] == before


def test_a_bad_text_is_refused(tiny_model_dir):
    folder, _ = tiny_model_dir("llama", True)
    with pytest.raises(InvalidRequestError, match="empty"):
        scan_sensitivity(folder, "int8", text_ids=[])
    with pytest.raises(InvalidRequestError, match=r"in \[0, 320\)"):
        scan_sensitivity(folder, "int8", text_ids=[1, 320])


def test_each_expert_of_a_mixture_is_ranked_by_its_own_kl(tiny_model_dir):
    """``experts=True``: every expert of every layer of experts quantized alone, its KL that
    of a full forward with that expert alone quantized, its share that of the layer's routed
    tokens in the reference pass; the costliest first; the model left as it came."""
    from engine.model.moe import MoE

    if not cpu_paths().int4_kernel.ok:
        pytest.skip(f"no INT4 kernel here: {cpu_paths().int4_kernel.why}")
    folder, _ = tiny_model_dir("qwen3_moe", False)
    cfg = ModelConfig.from_file(folder / "config.json")
    model = load_transformer(folder, cfg, torch.float32, torch.device("cpu"))
    scan = scan_model(model, QuantKind(4, 32), QuantKind(8), TEXT, experts=True)
    assert len(scan.experts) == 2 * 6 and [e.kl for e in scan.experts] == sorted(
        (e.kl for e in scan.experts), reverse=True
    )
    for layer in (0, 2):
        shares = [e.share for e in scan.experts if e.layer == layer]
        assert sum(shares) == pytest.approx(1.0)
    top = scan.experts[0]
    moe = model.layers[top.layer].mlp
    assert isinstance(moe, MoE)
    expert = moe.experts[top.expert]
    reference = _logp(model)
    saved = [(attr, getattr(expert, attr)) for attr in LINEARS["mlp"]]
    with torch.inference_mode():
        for attr, linear in saved:
            low = quantized_linear(linear.weight, linear.bias, QuantKind(4, 32))
            setattr(expert, attr, _Bf16In(low))
    try:
        ours = _logp(model)
    finally:
        for attr, linear in saved:
            setattr(expert, attr, linear)
    direct = float((reference.exp() * (reference - ours)).sum(-1).mean())
    assert top.kl == pytest.approx(direct, rel=1e-5, abs=1e-8)
    assert torch.equal(_logp(model), reference)  # left as it came
    assert Scan.from_dict(scan.to_dict()).experts == scan.experts
