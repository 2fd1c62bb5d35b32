"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against
transformers' own classes: the router's choice and weights, the experts run grouped by token,
exactly; INT8/INT4 per expert with the router in float; what the engine does not run is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import InvalidRequestError, ModelLoadError
from engine.kernels.packed_linear import PackedLinear
from engine.loader.load import load_model
from engine.model.config import ModelConfig
from engine.model.moe import MoE
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from tests.conftest import TINY, TINY_ARCH
from tests.test_exactness_tiny import hf_greedy, hf_logits, tiny_prompt
from tests.test_phi3 import check_ragged_on_a_prefix, ours_step_by_step

STEPS = 24
FAMILIES = [("qwen3_moe", False), ("qwen2_moe", True), ("mixtral", False)]


@pytest.mark.parametrize(("arch", "tied"), FAMILIES)
def test_a_mixture_of_experts_gives_transformers_logits_and_greedy_ids(tiny_model_dir, arch, tied):
    folder, hf = tiny_model_dir(arch, tied)
    engine = load_model(folder, precision="fp32")
    kinds = [type(layer.mlp).__name__ for layer in engine.model.layers]
    assert kinds == (["MoE", "MLP", "MoE"] if arch == "qwen3_moe" else ["MoE"] * 3)
    prompt = tiny_prompt(hf)
    ref_ids = hf_greedy(hf, prompt)
    logits, ids = ours_step_by_step(engine, prompt.tolist(), STEPS)
    ref = hf_logits(hf, torch.cat([prompt, torch.tensor(ref_ids[:-1])]))[len(prompt) - 1 :]
    assert ids == ref_ids[:STEPS]
    assert (logits - ref[:STEPS]).abs().max().item() <= 1e-4
    # every token went to 2 experts of 6, in each layer of experts: what the snapshot says
    tokens = len(prompt) + STEPS - 1  # the prompt, then each step's token but the last
    snapshot = engine.metrics()
    assert snapshot.expert_layers == ((0, 2) if arch == "qwen3_moe" else (0, 1, 2))
    for load in snapshot.expert_tokens:
        assert len(load) == 6 and sum(load) == 2 * tokens and sum(n > 0 for n in load) >= 2


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "lookup-drafts"])
def test_experts_in_a_ragged_batch_sharing_a_prefix_give_each_prompts_own_ids(
    tiny_model_dir, speculative
):
    """Four prompts on one 12-token prefix, arriving a step apart in chunks of at most 16
    tokens, repetitive enough that drafts get accepted: the experts run grouped over rows of
    different sequences and steps, and each prompt's ids are transformers' for it alone."""
    folder, hf = tiny_model_dir("qwen3_moe", False)
    check_ragged_on_a_prefix(folder, hf, speculative=speculative, seed=9, steps=16)


@pytest.mark.parametrize("spec", ["int8", "int4-g32", "mixed:attn=int8,mlp=int4-g32"])
def test_each_expert_is_quantized_and_the_router_stays_in_float(tiny_model_dir, spec):
    """Every expert's products (and the shared expert's) in the spec's format, the router and
    the shared expert's gate in the compute dtype; the logits those of the same model with
    its weights replaced by their dequantized values."""
    from tests.test_quant import _dequantized_reference, _relative_error

    folder, _ = tiny_model_dir("qwen2_moe", True)
    engine = load_model(folder, precision=spec)
    quantized = Int8Linear if spec == "int8" else Int4Linear
    for layer in engine.model.layers:
        moe = layer.mlp
        assert isinstance(moe, MoE)
        assert all(isinstance(p, quantized) for p in moe.linears())
        assert len(moe.linears()) == 2 * 6 + 2
        for gate in (moe.router, moe.shared_gate):  # float (oneDNN's packing where it was
            assert not isinstance(gate, (Int8Linear, Int4Linear))  # measured faster here)
            assert type(gate) in (torch.nn.Linear, PackedLinear)
            dtype = gate.dtype if isinstance(gate, PackedLinear) else gate.weight.dtype
            assert dtype == engine.dtype
    ids = list(range(3, 40))
    reference = _dequantized_reference(folder, spec)
    ours = engine.runner.forward_logits(ids, engine.runner.new_cache(len(ids)), 0)
    theirs = reference.runner.forward_logits(ids, reference.runner.new_cache(len(ids)), 0)
    assert _relative_error(ours, theirs) <= 2e-2


@pytest.mark.parametrize("spec", ["fp32", "int8", "int4-g32+head"])
def test_the_weight_estimate_of_a_mixture_of_experts_is_what_loads(tiny_model_dir, spec):
    from engine.quant.sizes import estimate_weight_bytes
    from engine.quant.spec import parse_precision_spec

    for arch, tied in FAMILIES:
        folder, _ = tiny_model_dir(arch, tied)
        engine = load_model(folder, precision=spec)
        estimate = estimate_weight_bytes(engine.cfg, parse_precision_spec(spec))
        assert estimate == engine.weights_bytes, arch


def test_what_a_mixture_of_experts_runs_not_is_refused_by_name(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("mixtral", False)
    with pytest.raises(InvalidRequestError, match="does not split a mixture of experts"):
        load_model(folder, tensor_parallel=2)
    with pytest.raises(InvalidRequestError, match="mixture of experts runs w8a8"):
        load_model(folder, precision="w8a8-sq")
    raw = {"model_type": "qwen3_moe", **TINY, **TINY_ARCH["qwen3_moe"], "num_experts_per_tok": 7}
    with pytest.raises(ModelLoadError, match="7 experts per token of 6"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_the_published_moe_configs_read_as_transformers_reads_them(name):
    import transformers

    from engine.store.synthetic_store import CONFIGS

    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    ours = ModelConfig.from_dict(raw)
    theirs = transformers.AutoConfig.for_model(
        **{k: v for k, v in raw.items() if not k.startswith("_")}
    )
    experts = getattr(theirs, "num_experts", None) or theirs.num_local_experts
    assert (ours.num_experts, ours.experts_per_token) == (experts, theirs.num_experts_per_tok)
    inner = getattr(theirs, "moe_intermediate_size", None) or theirs.intermediate_size
    assert ours.expert_intermediate_size == inner
    assert ours.normalize_expert_weights == getattr(theirs, "norm_topk_prob", True)
    assert ours.dense_layers == ()


GGUF_ARCHS = [("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe"), ("mixtral", "llama")]


@pytest.mark.parametrize(("arch", "gguf_arch"), GGUF_ARCHS)
def test_a_mixture_of_experts_gguf_imports_to_transformers_logits(tmp_path, arch, gguf_arch):
    """A GGUF as llama.cpp's converter lays a mixture of experts out (each layer's experts
    as one 3-D tensor a product, the router as ffn_gate_inp, Qwen2-MoE's shared expert and
    its gate vector; Mixtral as a llama with experts, its q/k rows permuted), imported into a
    folder: the original's config and transformers' logits."""
    from engine.store.gguf_import import import_gguf
    from tests.conftest import build_tiny_hf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    hf = build_tiny_hf(arch, tied=False, mlp_only_layers=[]) if arch == "qwen3_moe" else (
        build_tiny_hf(arch, tied=False)
    )  # fmt: skip
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    gguf = write_like_llama_cpp(hf, tmp_path / "moe.gguf", arch=gguf_arch)
    folder = tmp_path / "imported"
    import_gguf(gguf, folder, dtype="fp32")
    imported = ModelConfig.from_file(folder / "config.json")
    for field in ("model_type", "num_experts", "experts_per_token", "expert_intermediate_size",
                  "normalize_expert_weights", "shared_expert_size", "head_dim"):  # fmt: skip
        assert getattr(imported, field) == getattr(cfg, field), field
    engine = load_model(folder, precision="fp32")
    prompt = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(3))
    ours = engine.runner.forward_logits(prompt.tolist(), engine.runner.new_cache(30), 0)
    assert (ours - hf_logits(hf, prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("arch", "gguf_arch"), GGUF_ARCHS)
def test_our_moe_gguf_is_laid_out_as_llama_cpps_converter_does(tiny_model_dir, tmp_path, arch,
                                                                gguf_arch):  # fmt: skip
    """The benchmark peer's GGUF (:mod:`engine.store.gguf_writer`) of a mixture of experts,
    from the checkpoint's own per-expert tensors: the same tensors under the same names (the
    experts stacked, the shared expert's gate a vector), the same expert metadata."""
    import numpy as np
    from safetensors.torch import load_file

    from engine.store.gguf_reader import gguf_metadata, open_gguf
    from engine.store.gguf_writer import write_gguf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    folder, hf = tiny_model_dir(arch, False)
    if arch == "qwen3_moe":  # llama.cpp gives every layer experts
        from tests.conftest import build_tiny_hf, save_tiny

        hf = build_tiny_hf(arch, tied=False, mlp_only_layers=[])
        folder = save_tiny(hf, tmp_path / "hf")
    cfg = ModelConfig.from_file(folder / "config.json")
    saved = load_file(folder / "model.safetensors").items()
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    ours = open_gguf(write_gguf(tmp_path / "ours.gguf", cfg, saved, name="t", tokens=tokens))
    want = open_gguf(write_like_llama_cpp(hf, tmp_path / "want.gguf", arch=gguf_arch,
                                          quant="F16"))  # fmt: skip
    got = {t.name: t for t in ours.tensors}
    assert set(got) == {t.name for t in want.tensors}
    for tensor in want.tensors:
        assert np.array_equal(got[tensor.name].data, tensor.data), tensor.name
    keys = [k for k in gguf_metadata(want) if "expert" in k]
    assert len(keys) >= 2 and all(gguf_metadata(ours)[k] == gguf_metadata(want)[k] for k in keys)


def test_the_ab_comparison_of_a_mixture_of_experts_is_its_logits(tiny_model_dir):
    """``eval compare`` and the A/B lab on fp32 against INT8 experts: each token's KL is the
    one computed from the two engines' own logits."""
    from engine.core.sampling import SamplingParams
    from engine.evals.compare import compare_prompt
    from engine.evals.sides import Side, prompt_ids_for
    from tests.test_compare import direct_logprobs

    folder, _ = tiny_model_dir("qwen3_moe", False)
    a, b = load_model(folder, precision="fp32"), load_model(folder, precision="int8")
    greedy = Side(SamplingParams(max_new_tokens=10))
    report = compare_prompt(a, b, "t1 t7 t3 t9 t2", greedy, greedy, speculate=False)
    prompt = prompt_ids_for(a, [{"role": "user", "content": "t1 t7 t3 t9 t2"}])
    for key in ("a", "b"):
        ids = report[key]["token_ids"]
        la, lb = direct_logprobs(a, prompt, ids), direct_logprobs(b, prompt, ids)
        kl = (la.exp() * (la - lb)).sum(-1)
        assert torch.allclose(torch.tensor(report["columns"][key]["kl"], dtype=torch.float64),
                              kl, atol=1e-5)  # fmt: skip
    assert report["summary"]["kl_max"] > 0  # INT8 experts differ from fp32 ones


def test_a_decode_step_reads_the_experts_a_token_chooses(tiny_model_dir):
    """The bandwidth limit of a mixture of experts counts its *active* weights: everything a
    step reads but the embedding, of the routed experts only the k of E a token chooses."""
    from engine.quant.inventory import decode_read_bytes

    folder, _ = tiny_model_dir("qwen3_moe", False)
    engine = load_model(folder, precision="fp32", pack=False)  # plain parameters to count
    params = dict(engine.model.named_parameters())

    def nbytes(keep) -> int:
        return sum(p.numel() * p.element_size() for n, p in params.items() if keep(n))

    experts = nbytes(lambda n: ".experts." in n)
    rest = nbytes(lambda n: ".experts." not in n and not n.startswith("embed."))
    assert experts > 0 and decode_read_bytes(engine.model) == rest + experts * 2 // 6


def test_the_peers_decode_read_counts_its_active_experts(tmp_path):
    """llama.cpp's row of a bench table divides by what its decode reads, counted as ours:
    the GGUF's tensors but the untied embedding, of the expert tensors k of E."""
    import numpy as np

    from engine.bench.table import gguf_decode_bytes
    from engine.store.gguf_reader import open_gguf
    from tests.conftest import build_tiny_hf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    hf = build_tiny_hf("qwen3_moe", tied=False, mlp_only_layers=[])
    path = write_like_llama_cpp(hf, tmp_path / "moe.gguf", arch="qwen3moe")
    sizes = {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}
    experts = sum(n for name, n in sizes.items() if "_exps" in name)
    rest = sum(
        n for name, n in sizes.items() if "_exps" not in name and name != "token_embd.weight"
    )
    assert experts > 0 and gguf_decode_bytes(path) == rest + experts * 2 // 6
    assert np.isclose(sum(sizes.values()), path.stat().st_size, rtol=0.2)  # the file is them
