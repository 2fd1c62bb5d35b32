"""A model's calibration: activation statistics per linear, and the SmoothQuant factors they give.

``infersight calibrate`` (:mod:`engine.evals.calibrate`) runs the float model over a
calibration set and keeps, for each linear that W8A8 quantizes, the largest magnitude each
input channel took (``act``) and the largest magnitude of each input column of its weights
(``weight``), with what produced them. They are saved beside the model::

    <model folder>/calibration/<name>.safetensors   act.<module>, weight.<module> (fp32, [K])
    <model folder>/calibration/<name>.json          version, model fingerprint, source, α, …

``name`` says where the text came from: ``self`` (text the model wrote itself, the default),
``random`` (random tokens: the counter-example) or ``file-<stem>`` (a user's file).

**Smoothing** (SmoothQuant, Xiao et al. 2023). Quantizing activations per token fails where a
few channels carry outliers: the row's scale follows them, and every other channel loses its
bits. For each input channel ``j`` of a linear, ``s_j = act_j^α / weight_j^(1-α)`` divides the
activation and multiplies the weights' column, ``y = (x / s) · (W · diag(s))ᵀ``: exactly the
same product in real arithmetic, with the range moved from the activations into the weights.
Nothing of it runs at inference; the factors are folded at load (:class:`SmoothingPlan`):

* ``qkv_proj`` and ``gate_up_proj`` read an RMSNorm's output: its weight is divided by ``s``;
* ``down_proj`` reads ``silu(gate) · up``: the ``up`` rows of ``gate_up_proj`` are divided;
* ``o_proj`` reads the attention output, a probability-weighted sum of ``v``: the ``v`` rows of
  ``qkv_proj`` (and bias) are divided, so ``s`` is shared by the query heads of a KV head
  (each channel takes the largest statistics of its group).

α is chosen by ``infersight calibrate`` with a small sweep against the calibration loss, one
for all linears first, then one per kind of linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``: their activations differ, SwiGLU's ``down_proj`` input most), and kept in the
JSON. A load refuses statistics made for another model, or for this model's
folder before its weights changed (the fingerprint), or by another version of this format.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    from engine.quant.spec import QuantKind

#: the format of the files; a load refuses any other
VERSION = 1
#: the folder beside the model's weights
FOLDER = "calibration"
#: the calibration a ``w8a8-sq`` load takes unless told otherwise
DEFAULT_NAME = "self"
#: the linears W8A8 smooths, by their place in a decoder layer
SMOOTHED = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
#: the floor of a statistic in a factor (a channel that never fired)
EPS = 1e-5


class CalibrationError(InvalidRequestError):
    """Statistics that cannot serve this model: missing, foreign, stale or unreadable."""


def model_fingerprint(folder: Path) -> str:
    """What identifies a model's weights: ``config.json``, then each safetensors file's name,
    size, header (every tensor's name, dtype, shape and offsets) and its first and last 64
    KiB of data. A re-conversion or another model changes it; copying the folder does not."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            header = f.read(header_len)
            head = f.read(65536)
            f.seek(max(8 + header_len, size - 65536))
            tail = f.read(65536)
        for part in (path.name.encode(), str(size).encode(), header, head, tail):
            digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:32]


def files(folder: Path, name: str) -> tuple[Path, Path]:
    """The tensors' file and the description's file of calibration ``name``."""
    base = folder / FOLDER / name
    return base.with_suffix(".safetensors"), base.with_suffix(".json")


@dataclass
class Calibration:
    """Per linear (``layers.3.mlp.down_proj``): ``act`` and ``weight``, fp32 ``[in_features]``."""

    act: dict[str, Tensor]
    weight: dict[str, Tensor]
    #: how they were produced: source, recipe, seed, tokens, α, fingerprint, version, …
    meta: dict[str, Any] = field(default_factory=dict)
    #: the part of the calibration text α's sweep scores (token ids), kept so that the sweep
    #: can run again on the same statistics (``infersight calibrate --sweep``)
    held: list[list[int]] = field(default_factory=list)

    @property
    def alphas(self) -> dict[str, float]:
        """SmoothQuant's α for each smoothed linear of a layer (:data:`SMOOTHED`), as the
        calibration's sweep chose them."""
        chosen = self.meta.get("alphas", {})
        default = float(self.meta.get("alpha", 0.5))
        return {kind: float(chosen.get(kind, default)) for kind in SMOOTHED}

    def save(self, folder: Path, name: str) -> Path:
        tensors_path, meta_path = files(folder, name)
        tensors_path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"act.{k}": v.float().contiguous() for k, v in self.act.items()}
        tensors |= {f"weight.{k}": v.float().contiguous() for k, v in self.weight.items()}
        tensors |= {
            f"held.{i}": torch.tensor(h, dtype=torch.int64) for i, h in enumerate(self.held)
        }
        save_file(tensors, str(tensors_path))
        meta = {**self.meta, "version": VERSION, "model": model_fingerprint(folder)}
        meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        self.meta = meta
        return meta_path

    def check(self, cfg: ModelConfig) -> None:
        """Refuse statistics that do not fit ``cfg``'s linears (a file edited, or written for
        another model that happens to share the fingerprint's parts)."""
        for layer in range(cfg.num_layers):
            for module, width in _widths(cfg).items():
                name = f"layers.{layer}.{module}"
                for kind, stats in (("act", self.act), ("weight", self.weight)):
                    got = stats.get(name)
                    if got is None or tuple(got.shape) != (width,):
                        raise CalibrationError(
                            f"the calibration's {kind} statistics for {name} are "
                            f"{'missing' if got is None else tuple(got.shape)}, this model "
                            f"needs ({width},); run `infersight calibrate` again"
                        )


def load(folder: Path, name: str, cfg: ModelConfig) -> Calibration:
    """Calibration ``name`` of the model in ``folder``, checked against it."""
    if cfg.num_experts:
        raise CalibrationError(
            "a calibration (SmoothQuant's factors, static scales) is measured for dense MLPs; "
            "a mixture of experts runs w8a8 (dynamic), int8 or int4 per expert"
        )
    tensors_path, meta_path = files(folder, name)
    if not meta_path.is_file() or not tensors_path.is_file():
        raise CalibrationError(
            f"{folder.name} has no calibration named {name!r} (looked for {meta_path}); run "
            f"`infersight calibrate --model {folder}{_source_flag(name)}` first, or use w8a8 "
            "(no smoothing)"
        )
    try:
        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(tensors_path))
    except (OSError, ValueError) as exc:
        raise CalibrationError(
            f"calibration {name!r} of {folder.name} cannot be read ({exc}); run "
            "`infersight calibrate` again"
        ) from exc
    if meta.get("version") != VERSION:
        raise CalibrationError(
            f"calibration {name!r} of {folder.name} is in format version "
            f"{meta.get('version')!r}, this Infersight reads version {VERSION}; run "
            "`infersight calibrate` again"
        )
    if meta.get("model") != model_fingerprint(folder):
        raise CalibrationError(
            f"calibration {name!r} in {folder / FOLDER} was made for other weights than "
            f"{folder.name}'s (another model, or this one before it was converted again): its "
            "statistics would smooth the wrong channels; run `infersight calibrate` again"
        )
    cal = Calibration(
        act={k[4:]: v for k, v in tensors.items() if k.startswith("act.")},
        weight={k[7:]: v for k, v in tensors.items() if k.startswith("weight.")},
        meta=meta,
        held=[tensors[f"held.{i}"].tolist() for i in range(len(tensors)) if f"held.{i}" in tensors],
    )
    cal.check(cfg)
    return cal


def _source_flag(name: str) -> str:
    """The ``infersight calibrate`` option that makes calibration ``name``."""
    if name == "random":
        return " --random"
    return " --from-file <your text>" if name.startswith("file-") else ""


def _widths(cfg: ModelConfig) -> dict[str, int]:
    """Each smoothed linear's input width."""
    return {
        "attn.qkv_proj": cfg.hidden_size,
        "attn.o_proj": cfg.q_size,
        "mlp.gate_up_proj": cfg.hidden_size,
        "mlp.down_proj": cfg.intermediate_size,
    }


def factors(act: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """SmoothQuant's ``s = act^α / weight^(1-α)`` per channel (fp32, statistics floored at
    :data:`EPS`)."""
    a, w = act.float().clamp(min=EPS), weight.float().clamp(min=EPS)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=EPS)


class SmoothingPlan:
    """The factors of the smoothed blocks of one load, applied to each parameter as it is
    loaded (:meth:`apply`): ``blocks`` is ``{(part, layer)}``, part ``attn`` or ``mlp``."""

    def __init__(
        self, cal: Calibration, cfg: ModelConfig, blocks: set[tuple[str, int]],
        alpha: float | dict[str, float] | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        #: α per smoothed linear of a layer: the calibration's, or ``alpha`` (one for all, or
        #: some of them by kind) in their place
        self.alphas = cal.alphas
        if isinstance(alpha, float | int):
            self.alphas = dict.fromkeys(SMOOTHED, float(alpha))
        elif alpha is not None:
            self.alphas |= alpha
        #: parameter name → (column factors, or None; (first row, row divisors), or None;
        #: divisor of the whole vector (a norm's weight), or None)
        self._ops: dict[str, tuple[Tensor | None, tuple[int, Tensor] | None, Tensor | None]] = {}
        group = cfg.num_heads // cfg.num_kv_heads
        for part, layer in sorted(blocks):
            pre = f"layers.{layer}"
            if part == "attn":
                s_in = self._factors(cal, f"{pre}.attn.qkv_proj")
                # o_proj's channel (head h, dim d) shares v's row (h // group, d): one factor
                # per KV head's channel, from the largest statistics of its query heads
                per_kv = (cfg.num_kv_heads, group, cfg.head_dim)
                act = cal.act[f"{pre}.attn.o_proj"].view(per_kv).amax(dim=1)
                wgt = cal.weight[f"{pre}.attn.o_proj"].view(per_kv).amax(dim=1)
                s_kv = factors(act, wgt, self.alphas["attn.o_proj"])  # [Hkv, D]
                s_o = s_kv[:, None, :].expand(per_kv).reshape(-1)
                v_row = cfg.q_size + cfg.kv_size
                self._ops[f"{pre}.input_norm.weight"] = (None, None, s_in)
                self._ops[f"{pre}.attn.qkv_proj.weight"] = (s_in, (v_row, s_kv.reshape(-1)), None)
                self._ops[f"{pre}.attn.qkv_proj.bias"] = (None, (v_row, s_kv.reshape(-1)), None)
                self._ops[f"{pre}.attn.o_proj.weight"] = (s_o, None, None)
            else:
                s_in = self._factors(cal, f"{pre}.mlp.gate_up_proj")
                s_down = self._factors(cal, f"{pre}.mlp.down_proj")
                self._ops[f"{pre}.post_attn_norm.weight"] = (None, None, s_in)
                self._ops[f"{pre}.mlp.gate_up_proj.weight"] = (
                    s_in,
                    (cfg.intermediate_size, s_down),
                    None,
                )
                self._ops[f"{pre}.mlp.down_proj.weight"] = (s_down, None, None)

    def _factors(self, cal: Calibration, module: str) -> Tensor:
        kind = module.split(".", 2)[2]  # layers.3.mlp.down_proj -> mlp.down_proj
        return factors(cal.act[module], cal.weight[module], self.alphas[kind])

    def touches(self, name: str) -> bool:
        return name in self._ops

    def input_factors(self, module: str) -> Tensor | None:
        """The factors linear ``module``'s input is divided by, or None (not smoothed)."""
        ops = self._ops.get(f"{module}.weight")
        return None if ops is None else ops[0]

    def apply(self, name: str, tensor: Tensor) -> Tensor:
        """``tensor`` (parameter ``name``, fp32) with its factors folded in: columns
        multiplied, rows from the first given divided (``v`` of ``qkv_proj``, ``up`` of
        ``gate_up_proj``), or the whole vector divided (a norm's weight)."""
        columns, rows, divide = self._ops[name]
        out = tensor.float().clone()
        if columns is not None:
            out *= columns.to(out.device)
        if rows is not None:
            first, by = rows
            shape = (-1, 1) if out.dim() == 2 else (-1,)
            out[first : first + by.numel()] /= by.to(out.device).view(shape)
        if divide is not None:
            out /= divide.to(out.device)
        return out


def set_static_scales(
    model: nn.Module, cal: Calibration, plan: SmoothingPlan | None,
    kind_for: Callable[[str], QuantKind | None],
) -> int:  # fmt: skip
    """Give each W8A8 linear whose format is static (``w8a8-static``, ``w8a8-sq-static``) one
    activation scale: the largest magnitude its input took in the calibration (divided by its
    smoothing factors where it is smoothed) over 127. Returns how many it set; the LM head,
    which the calibration does not read, keeps per-token scales."""
    from engine.quant.w8a8 import W8A8Linear

    count = 0
    for name, module in model.named_modules():
        kind = kind_for(name)
        if not isinstance(module, W8A8Linear) or kind is None or not kind.static:
            continue
        if name not in cal.act:
            continue
        act = cal.act[name].float()
        factors_ = plan.input_factors(name) if plan is not None else None
        if factors_ is not None:
            act = act / factors_.float()
        module.act_scale = max(float(act.max()), EPS) / 127
        count += 1
    return count
