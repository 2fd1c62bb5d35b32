"""`ModelConfig`: the handful of numbers the forward pass needs, read from an HF `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.errors import ModelLoadError, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class Architecture:
    """What sets a supported ``model_type`` apart from Llama."""

    qkv_bias: bool = False  # q/k/v projections carry biases unless ``attention_bias`` says
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    #: how the config's ``sliding_window`` applies: not at all, to every layer (Mistral), or
    #: to the layers it marks behind ``use_sliding_window`` (Qwen2, Qwen3)
    window: Literal["ignored", "every_layer", "opt_in", "local_layers"] = "ignored"
    #: Gemma's layer: RMSNorm weights stored as offsets from 1 (``(1 + w)``), norms after
    #: attention and after the MLP as well as before them, GeGLU, embeddings scaled by
    #: sqrt(hidden), attention scaled by ``query_pre_attn_scalar``, and local (sliding) layers
    #: with a RoPE base of their own between the global ones
    gemma: bool = False
    #: a mixture of experts in place of the MLP (:func:`_moe` reads its numbers)
    moe: bool = False


#: HF ``model_type`` values whose checkpoints this engine runs.
SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(window="every_layer"),
    "qwen2": Architecture(qkv_bias=True, window="opt_in"),
    "qwen3": Architecture(qk_norm=True, window="opt_in"),
    # Phi-3 and Phi-4: q/k/v and gate/up fused in the checkpoint itself, LongRoPE on the long
    # context variants, a window on every layer where the config sets one
    "phi3": Architecture(window="every_layer"),
    # Gemma 3's text model (the 1B checkpoint; the larger ones' language model is the same);
    # Gemma 2: every other layer local, attention scores soft-capped, no q/k norms
    "gemma3_text": Architecture(qk_norm=True, window="local_layers", gemma=True),
    "gemma2": Architecture(window="local_layers", gemma=True),
    # mixtures of experts: Qwen3's, Qwen2's (with a shared expert beside the routed ones),
    # Mixtral's
    "qwen3_moe": Architecture(qk_norm=True, window="opt_in", moe=True),
    "qwen2_moe": Architecture(qkv_bias=True, window="opt_in", moe=True),
    "mixtral": Architecture(window="every_layer", moe=True),
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``none``, ``linear``, ``llama3`` or ``longrope``
    (Phi-3's: per-frequency ``short_factor`` within the pretraining context, ``long_factor``
    past it, and cos/sin scaled by ``attention_factor``)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: the checkpoint's dtype as the config states it (``bfloat16`` …; transformers 5 writes
    #: ``dtype``), for the memory plan; None when it does not say
    torch_dtype: str | None = None
    #: per-head RMSNorm of q and k before RoPE (Qwen3)
    qk_norm: bool = False
    #: attention sees only the last ``sliding_window`` keys (Mistral); None: every key
    sliding_window: int | None = None
    #: the leading dimensions of each q/k head that RoPE rotates (``partial_rotary_factor`` of
    #: the head: Phi-4-mini's 0.75); 0 for every one
    partial_rotary_dim: int = 0
    #: Gemma's layer (:class:`Architecture`); the fields below hold its numbers
    gemma: bool = False
    #: the MLP's activation of the gate: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU)
    activation: str = "silu"
    #: what the embedding rows are multiplied by (rounded to the activations' dtype), or None
    embed_scale: float | None = None
    #: the final logits pass through ``cap · tanh(logits / cap)``; None: as they are
    final_softcap: float | None = None
    #: what each query is multiplied by at load (folded into its projection or its norm) so
    #: that attention's 1/sqrt(head_dim) comes to the model's own scale
    query_scale: float = 1.0
    #: the window of the local (sliding) layers, ``local_layers``; None: no such layers
    local_window: int | None = None
    local_layers: tuple[int, ...] = ()
    #: the local layers' RoPE base (no scaling); None: they turn as the others do
    local_rope_theta: float | None = None
    #: attention scores pass through ``cap · tanh(score / cap)`` before the softmax (Gemma 2);
    #: None: as they are
    attn_softcap: float | None = None
    #: a mixture of experts: how many experts a layer has (0: a dense MLP), how many each
    #: token is routed to, each expert's intermediate size, whether the chosen experts'
    #: weights are renormalised to sum to 1, the shared expert's intermediate size (Qwen2-MoE;
    #: 0: none) and the layers that keep a dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False
    shared_expert_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer`` routes its tokens to experts (else it has a dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The window of ``layer`` alone (a local layer's), beside the model's
        :attr:`sliding_window`; None for a global layer."""
        return self.local_window if layer in self.local_layers else None

    @property
    def window_count(self) -> int:
        """How many windows the layers attend under (2 where local layers have their own)."""
        return 1 + (self.local_window is not None and bool(self.local_layers))

    @property
    def layer_extras(self) -> str:
        """What this model's layers do beyond Llama's, for the paths that run Llama's layer
        only (the C decode step, the fused W8A8 layer, the Triton attention): "" for none."""
        if self.gemma:
            return "Gemma's layer (extra norms, GeGLU, local layers)"
        return "a mixture of experts" if self.num_experts else ""

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates."""
        return self.partial_rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = _language_model(raw)
        model_type = str(raw.get("model_type", "")).lower()
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise UnsupportedModelError(
                f"model_type {model_type or '(missing)'!r} is not supported; "
                f"Infersight runs these architectures: {supported}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            # transformers >= 5 keeps RoPE settings in `rope_parameters`; older configs use
            # top-level `rope_theta` and `rope_scaling`.
            rope = raw.get("rope_parameters") or {}
            if model_type == "gemma3_text":  # per layer kind: the global ones'
                rope = rope.get("full_attention") or {}
            if model_type == "gemma3_text":  # rope_parameters' own first
                theta = rope.get("rope_theta") or raw.get("rope_theta") or 1_000_000.0
            else:
                theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
            arch = SUPPORTED_ARCHITECTURES[model_type]
            context = int(raw.get("max_position_embeddings", 2048))
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=context,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch.qkv_bias)),
                rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope, raw, context),
                bos_token_id=_opt_int(raw.get("bos_token_id")),
                eos_token_ids=_int_tuple(raw.get("eos_token_id")),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "") or None,
                qk_norm=arch.qk_norm,
                sliding_window=_sliding_window(raw, arch, context),
                partial_rotary_dim=_partial_rotary_dim(raw, rope, head_dim),
                **(_gemma(raw, head_dim, context) if arch.gemma else {}),
                **(_moe(raw, model_type) if arch.moe else {}),
            )
        except KeyError as exc:
            raise ModelLoadError(
                f"config.json lacks the key {exc.args[0]!r}; is this a Hugging Face model folder?"
            ) from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json holds a malformed value: {exc}") from exc
        cfg._validate()
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ModelLoadError(
                f"{path} does not exist; a model folder needs config.json next to its weights"
            ) from exc
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} is not a JSON object")
        return cls.from_dict(raw)

    def _validate(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ModelLoadError(f"config.json: {name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(
                f"config.json: head_dim must be even for RoPE, got {self.head_dim}"
            )
        rs, pairs = self.rope_scaling, self.rotary_dim // 2
        if rs.kind == "longrope" and {len(rs.short_factor), len(rs.long_factor)} != {pairs}:
            raise ModelLoadError(
                f"config.json: LongRoPE's short and long factors number {len(rs.short_factor)} "
                f"and {len(rs.long_factor)}; each head rotates {pairs} pairs"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(
                f"config.json: sliding_window must be positive, got {self.sliding_window}"
            )


#: Gemma3TextConfig's defaults: a published Gemma 3's ``text_config`` names only the others
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}  # fmt: skip


def _language_model(raw: dict[str, Any]) -> dict[str, Any]:
    """The config of the language model a checkpoint holds: Gemma 3's own where it is the
    image-and-text model (``gemma3``, its language model's in ``text_config``, the token ids
    and dtype beside it), with Gemma3TextConfig's defaults under what it names."""
    kind = str(raw.get("model_type", "")).lower()
    if kind == "gemma3" and isinstance(raw.get("text_config"), dict):
        outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype",
                                     "tie_word_embeddings") if raw.get(k) is not None}  # fmt: skip
        raw = {**outer, **raw["text_config"], "model_type": "gemma3_text"}
        kind = "gemma3_text"
    if kind == "gemma3_text":
        return {**GEMMA3_TEXT_DEFAULTS, **raw}
    return raw


def arch_window(model_type: str) -> str:
    return SUPPORTED_ARCHITECTURES[model_type].window


def _gemma(raw: dict[str, Any], head_dim: int, context: int) -> dict[str, Any]:
    """Gemma's numbers, as Gemma3TextConfig and Gemma2Config read them: its layer kinds
    (``layer_types``, else every ``sliding_window_pattern``-th layer global, every other one
    for Gemma 2), the local layers' window and (Gemma 3's) RoPE base
    (``rope_parameters.sliding_attention`` or ``rope_local_base_freq``), the attention's
    ``query_pre_attn_scalar`` and soft-cap, and the final soft-cap."""
    gemma2 = str(raw.get("model_type")) == "gemma2"
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (an encoder) is not run")
    activation = str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(
            f"hidden_activation {activation!r}: Gemma runs gelu_pytorch_tanh"
        )
    layers = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern", 2 if gemma2 else 6))
    kinds = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(
            f"config.json: layer_types must name {layers} layers, each sliding_attention or "
            "full_attention"
        )
    window = _opt_int(raw.get("sliding_window"))
    local = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if window is not None and window >= context:
        window = None  # a window no shorter than the context is none (their RoPE stays theirs)
    rope = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if str(rope.get("rope_type", "default")) != "default":
        raise UnsupportedModelError("RoPE scaling on Gemma's local layers is not run")
    theta = (
        None
        if gemma2
        else float(rope.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0)
    )
    softcap = raw.get("final_logit_softcapping")
    attn_softcap = raw.get("attn_logit_softcapping")
    scalar = float(raw.get("query_pre_attn_scalar") or head_dim)
    return {
        "gemma": True,
        "activation": "gelu_tanh",
        "embed_scale": float(raw["hidden_size"]) ** 0.5,
        "final_softcap": None if softcap is None else float(softcap),
        "query_scale": (head_dim / scalar) ** 0.5,
        "local_window": window,
        "local_layers": local,
        "local_rope_theta": theta,
        "attn_softcap": None if attn_softcap is None else float(attn_softcap),
    }


def _moe(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A mixture of experts' numbers as transformers reads them: Qwen3-MoE's and Qwen2-MoE's
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    and dense layers (``mlp_only_layers``, and those ``decoder_sparse_step`` skips);
    Qwen2-MoE's shared expert; Mixtral's ``num_local_experts`` and experts of
    ``intermediate_size``, their weights always renormalised."""
    layers = int(raw["num_hidden_layers"])
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    per_token = int(raw.get("num_experts_per_tok") or 2)
    if experts < 1 or not 1 <= per_token <= experts:
        raise ModelLoadError(
            f"config.json: {per_token} experts per token of {experts}; a mixture of experts "
            "routes each token to between 1 and all of its experts"
        )
    if model_type == "mixtral":
        return {"num_experts": experts, "experts_per_token": per_token,
                "expert_intermediate_size": int(raw["intermediate_size"]),
                "normalize_expert_weights": True}  # fmt: skip
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    dense |= {i for i in range(layers) if (i + 1) % step}
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    shared = shared if model_type == "qwen2_moe" else 0
    return {
        "num_experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate_size": int(
            raw.get("moe_intermediate_size") or raw["intermediate_size"]
        ),
        "normalize_expert_weights": bool(raw.get("norm_topk_prob", False)),
        "shared_expert_size": shared,
        "dense_layers": tuple(sorted(int(i) for i in dense)),
    }


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _sliding_window(raw: dict[str, Any], arch: Architecture, context: int) -> int | None:
    """The model's own attention window, as transformers applies it, or None for none.

    Mistral applies ``sliding_window`` (null for none) to every layer. Qwen2/Qwen3 configs
    carry one too but apply it only with ``use_sliding_window``, and then only to the layers
    ``layer_types`` (or, before it, ``max_window_layers``) marks: a window on every layer or
    on none runs here, a mix of the two does not. A window no shorter than the context is none.
    """
    window = _opt_int(raw.get("sliding_window"))
    if window is None or arch.window in ("ignored", "local_layers"):
        return None  # Gemma's is its local layers' alone: :func:`_gemma`
    if arch.window == "opt_in":
        if not raw.get("use_sliding_window"):
            return None
        layers = int(raw["num_hidden_layers"])
        first = int(raw.get("max_window_layers", layers))
        kinds = set(
            raw.get("layer_types")
            or ("sliding_attention" if i >= first else "full_attention" for i in range(layers))
        )
        if kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            raise UnsupportedModelError(
                "this model uses a sliding window on some layers and full attention on others "
                "(use_sliding_window with max_window_layers / layer_types); Infersight runs a "
                "window on every layer or on none"
            )
    return None if window >= context else window


def _partial_rotary_dim(raw: dict[str, Any], rope: dict[str, Any], head_dim: int) -> int:
    """The dimensions RoPE rotates where it rotates only part of each head (transformers'
    ``int(head_dim · partial_rotary_factor)``), else 0."""
    partial = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial is None or float(partial) >= 1.0:
        return 0
    dim = int(head_dim * float(partial))
    if dim <= 0 or dim % 2:
        raise ModelLoadError(
            f"config.json: partial_rotary_factor {partial} rotates {dim} of each head's "
            f"{head_dim} dimensions; RoPE needs an even, positive number of them"
        )
    if raw.get("model_type") == "qwen3":  # its q/k norms are per head dimension
        raise UnsupportedModelError("partial_rotary_factor with Qwen3's q/k norms is not run")
    return dim


def _rope_scaling(raw: Any, config: dict[str, Any], context: int) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = str(raw.get("rope_type") or raw.get("type") or "default")
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    if kind in ("longrope", "su"):
        return _longrope(raw, config, context)
    raise UnsupportedModelError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, longrope"
    )


def _longrope(raw: dict[str, Any], config: dict[str, Any], context: int) -> RopeScaling:
    """Phi-3's LongRoPE as transformers computes it: the pretraining context is Phi-3's own
    ``original_max_position_embeddings`` (4096 where unset; another model's, its scaling's),
    the factor the context's ratio to it unless given, and the attention factor
    ``sqrt(1 + ln(factor) / ln(original))`` unless given (1 where the context is not
    extended)."""
    if str(config.get("model_type", "")).lower() == "phi3":  # Phi3Config's own, 4096 unset
        original = int(config.get("original_max_position_embeddings") or 4096)
    else:
        original = int(raw.get("original_max_position_embeddings") or context)
    factor = float(raw.get("factor") or context / original)
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in raw["short_factor"]),
        long_factor=tuple(float(f) for f in raw["long_factor"]),
        attention_factor=float(attention),
    )
