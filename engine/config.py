"""`ModelConfig`: the handful of numbers the forward pass needs, read from an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModelError

#: HF ``model_type`` values whose checkpoints this engine runs, and whether q/k/v carry biases.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {"llama": False, "mistral": False, "qwen2": True}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``none``, ``linear`` or ``llama3``."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
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
            theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", SUPPORTED_ARCHITECTURES[model_type])),
                rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope),
                bos_token_id=_opt_int(raw.get("bos_token_id")),
                eos_token_ids=_int_tuple(raw.get("eos_token_id")),
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


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_scaling(raw: Any) -> RopeScaling:
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
    raise UnsupportedModelError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3"
    )
