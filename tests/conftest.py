"""Shared fixtures: tiny random models built with transformers, and the real default model."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.misbehaving import misbehaving  # noqa: F401 (a shared fixture)
from tests.served import client, server, server_log  # noqa: F401 (shared fixtures)

if TYPE_CHECKING:
    from app.gui.main_window import MainWindow
    from engine.core.engine import LLMEngine

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A fixed count, as if asked for: loads do not time their own (tests/test_threads.py does).
# Under pytest-xdist the cores are shared out between the workers, so that two workers on two
# cores do not run four threads.
# (The controller process imports this file first and its workers inherit its environment, so
# the count a user set is remembered apart from the one set here.)
if "PYTEST_XDIST_WORKER" not in os.environ:
    _asked = os.environ.get("INFERSIGHT_THREADS", "")
    os.environ.setdefault("INFERSIGHT_TESTS_THREADS_ASKED", _asked)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ["INFERSIGHT_THREADS"] = os.environ["INFERSIGHT_TESTS_THREADS_ASKED"] or str(
    max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
)
# Every packable linear packed, as loads did before layouts were timed: one path whatever the
# machine's noise (tests/test_linear_layout.py times them).
os.environ.setdefault("INFERSIGHT_LAYOUT", "packed")
# Eager decode steps unless a test asks for a compiled one: ``auto`` would compile wherever a
# CPU kind is listed as faster compiled (engine/executor/inductor.py), minutes per load.
os.environ.setdefault("INFERSIGHT_DECODE_GRAPH", "off")
# torch's low-bit kernels unless a test asks for ours (tests/test_lowbit.py): ``auto`` would
# take ours for the shapes where they timed faster, and their activations are quantized.
os.environ.setdefault("INFERSIGHT_LOWBIT", "torch")
# Our Triton kernels run in Triton's interpreter on these CPUs, on CPU tensors
# (engine/kernels/triton_support.py): set before anything imports Triton. The engine still
# runs the torch kernels unless a test asks for ours (INFERSIGHT_KERNELS=triton).
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
torch.set_num_threads(int(os.environ["INFERSIGHT_THREADS"]))


#: seconds a test process may take to exit once its tests are done (its atexit handlers, a
#: split model's ranks stopping) before it prints every thread's stack and exits with 1: a
#: hang at exit fails the run where it would stall it (pytest-timeout covers the tests)
EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


@pytest.fixture(scope="session", autouse=True)
def _compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """TorchInductor compiles into a cache of this session's: a warm cache left by an earlier
    run would hide a cold compile's failures (and time). Set before anything compiles; a
    lowered CPU level still gets a folder of its own beside it (engine/hardware/cpu_paths.py)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=5000.0,  # not the default: a config reader that ignores it fails
)


def rope_theta(config: object) -> float:
    """RoPE base of a transformers config (``rope_parameters`` in v5, ``rope_theta`` before;
    the global layers' where each kind of layer has its own)."""
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get("full_attention", params)  # per layer kind (Gemma 3): the global ones'
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


#: What each architecture's tiny model sets beyond :data:`TINY`: Qwen3 an explicit head_dim
#: (its default is 128), so that q (8 × 16) is wider than the hidden size; Mistral a sliding
#: window short enough that a test's prompt and decode run far past it.
TINY_ARCH: dict[str, dict[str, object]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 8},
    # q/k/v and gate/up fused in the checkpoint; its defaults' token ids lie past the vocabulary
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # local layers (window 8, their own RoPE base) around a global one; attention scaled by
    # 1/sqrt(8), not 1/sqrt(head_dim 16); the final logits soft-capped
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 8,
        "rope_local_base_freq": 300.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 8,
        "final_logit_softcapping": 3.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # every other layer local (window 8), attention and final logits soft-capped, attention
    # scaled by 1/sqrt(8)
    "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 8,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # mixtures of experts: 6 experts of 24 channels, 2 a token (Qwen3-MoE's renormalised, its
    # middle layer dense; Qwen2-MoE's not, with a shared expert; Mixtral's always)
    "qwen3_moe": {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 24, "norm_topk_prob": True, "mlp_only_layers": [1]},
    "qwen2_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40},
    "mixtral": {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 24},
}  # fmt: skip


def build_tiny_hf(arch: str, *, tied: bool, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random transformers model of ``arch`` (``llama``, ``qwen2``, ``qwen3``, ``mistral``,
    ``phi3``, ``gemma3_text``, ``gemma2``, or the mixtures of experts ``qwen3_moe``,
    ``qwen2_moe`` and ``mixtral``) with GQA."""
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(arch)
    config_class, model_class = (getattr(transformers, name) for name in classes[arch])
    torch.manual_seed(seed)
    kwargs = {**TINY, **TINY_ARCH[arch], "tie_word_embeddings": tied, **overrides}
    model = model_class(config_class(**kwargs))
    with torch.no_grad():  # larger than the default init, so logits are far from uniform
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return model.eval()


def save_tiny(model: torch.nn.Module, folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bar on stderr would land in a test's captured output
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


#: The tiny models with heads 64 wide (4 query heads on 2 KV heads): what our Triton kernels
#: are built for (engine/kernels/triton_support.py, HEAD_DIMS).
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """``make(arch, tied, **overrides)``: a tiny model's folder and its transformers model,
    built once per session."""
    cache: dict[tuple[object, ...], tuple[Path, torch.nn.Module]] = {}

    def make(arch: str, tied: bool, **overrides: object) -> tuple[Path, torch.nn.Module]:
        key = (arch, tied, repr(sorted(overrides.items())))
        if key not in cache:
            model = build_tiny_hf(arch, tied=tied, **overrides)
            folder = tmp_path_factory.mktemp(f"{arch}-{'tied' if tied else 'untied'}")
            cache[key] = (save_tiny(model, folder), model)
        return cache[key]

    return make


@pytest.fixture
def fresh_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No kernel timing or thread count measured yet (``kernels.json`` and ``threads.json``
    in an empty folder, which it returns), while the builds of our C kernels and the probes'
    verdicts stay the session's: a test about measurements need not rebuild every kernel and
    rerun every probe, as an empty ``INFERSIGHT_HOME`` would make it."""
    from engine.hardware import measured, threads

    real = measured.path
    fresh = {measured.KERNELS_FILE, threads.FILE}
    monkeypatch.setattr(
        measured, "path", lambda name: tmp_path / name if name in fresh else real(name)
    )
    return tmp_path


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The converted SmolLM2 folder (``make test`` pulls it before pytest starts)."""
    from engine.store.model_store import pull_default

    return pull_default()


@pytest.fixture(scope="module")
def gui_gc(qapp: object) -> Iterator[None]:
    """Qt tests: garbage is collected in the UI thread only, as in the app (see
    ``app.gc_guard``); a collection in the engine or loader thread could destroy this
    module's widgets from the wrong thread and crash the run."""
    from app.gui.gc_guard import GuiGarbageCollector

    collector = GuiGarbageCollector()
    yield
    collector.stop()


@pytest.fixture(scope="session")
def default_gguf(default_model: Path) -> Path:
    from engine.store.model_store import fetch_default_gguf

    return fetch_default_gguf()


@pytest.fixture()
def user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user home of its own: HOME, the hub's cache, LM Studio's folder and the store."""
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path / "infersight"))
    monkeypatch.delenv("INFERSIGHT_LMSTUDIO_DIR", raising=False)
    return user


@pytest.fixture
def oracle(default_model: Path) -> LLMEngine:
    """A second engine, outside the app, for the expected text: an engine of its own (pool,
    limits, instruments) on the weights the app's windows share in this process
    (``tests/app_window.py``), made per test, so that no window's layer timings can leave
    hooks on it."""
    from tests.app_window import SHARED_WEIGHTS, SPEC

    return SHARED_WEIGHTS(SPEC)


@pytest.fixture
def window(qtbot: object, tmp_path: Path, default_model: Path) -> Iterator[MainWindow]:
    """A real app window on the default model (tests/app_window.py), closed afterwards."""
    from tests.app_window import open_window

    w = open_window(qtbot, tmp_path / "data")
    yield w
    w.shutdown()


def truncated_copy(folder: Path, out: Path, layers: int) -> Path:
    """The model's first ``layers`` layers, final norm and head as a model of its own, with
    the same tokenizer: a smaller draft model, or a real model's weights and shapes at a
    fraction of its depth."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    kept = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                kept[name] = t
    save_file(kept, out / "model.safetensors")
    return out
