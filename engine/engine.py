"""`LLMEngine`: load a model folder, turn prompts into streams of tokens.

This is the engine core: one request at a time through a contiguous KV cache. Its public
shape (``load``, ``generate`` yielding :class:`TokenEvent`, plain-data results) is what the
batching scheduler and the app build on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.kv_cache import ContiguousKVCache
from engine.linear import pack_linears
from engine.model import Transformer
from engine.sampling import SamplingParams, make_generator, sample
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.weights import load_transformer, parameter_count, weight_bytes

log = logging.getLogger(__name__)

PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def parse_precision(name: str) -> torch.dtype:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}"
        ) from None


@dataclass(slots=True)
class TokenEvent:
    """One generated token and the text it released (possibly empty: a held-back partial
    character or a possible stop-string prefix). ``finish_reason`` is set on the last event:
    ``"stop"`` (end-of-generation token or stop string) or ``"length"``."""

    token_id: int
    text: str
    finish_reason: str | None = None


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None  # request start → first token sampled
    tpot_s: float | None = None  # mean time per output token after the first

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
        }


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cfg: ModelConfig,
        *,
        eos_token_ids: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        name: str = "model",
        num_parameters: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.eos_token_ids = frozenset(eos_token_ids)
        self.dtype = dtype
        self.device = device
        self.name = name
        self.num_parameters = num_parameters

    @classmethod
    def load(
        cls,
        folder: Path | str,
        *,
        precision: str = "fp32",
        device: str = "cpu",
        pack: bool = True,
    ) -> LLMEngine:
        """Load a HF-style model folder. ``pack`` lays CPU weights out for oneDNN
        (:mod:`engine.linear`); turn it off to run plain ``nn.Linear``."""
        folder = Path(folder)
        dtype = parse_precision(precision)
        if not folder.is_dir():
            raise ModelLoadError(
                f"model folder {folder} does not exist; pass a Hugging Face model folder "
                "(config.json, *.safetensors, tokenizer.json) or --model default"
            )
        torch_device = torch.device(device)
        if torch_device.type == "cpu" and dtype == torch.float16:
            log.warning("fp16 on CPU runs through slow fallback kernels; bf16 or fp32 is faster")
        cfg = ModelConfig.from_file(folder / "config.json")
        tokenizer = Tokenizer.from_folder(folder)
        model = load_transformer(folder, cfg, dtype, torch_device)
        num_parameters = parameter_count(model)
        if pack and torch_device.type == "cpu":
            pack_linears(model)
        eos = set(cfg.eos_token_ids) | set(_generation_config_eos(folder))
        log.info(
            "loaded %s: %s, %d layers, %.1fM parameters, %s, %.0f MiB of weights",
            folder.name,
            cfg.model_type,
            cfg.num_layers,
            num_parameters / 1e6,
            precision,
            weight_bytes(model) / 2**20,
        )
        return cls(
            model,
            tokenizer,
            cfg,
            eos_token_ids=sorted(eos),
            dtype=dtype,
            device=torch_device,
            name=folder.name,
            num_parameters=num_parameters,
        )

    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

    def forward_logits(
        self, token_ids: Sequence[int], cache: ContiguousKVCache, start: int
    ) -> torch.Tensor:
        """Logits for every position of ``token_ids`` continuing a sequence at ``start``."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        ctx = cache.context([0], [start], [len(ids)])
        return self.model(ids, positions, ctx)

    def new_cache(self, capacity: int) -> ContiguousKVCache:
        return ContiguousKVCache(
            self.cfg, slots=1, capacity=capacity, dtype=self.dtype, device=self.device
        )

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Start one request; iterate the result for :class:`TokenEvent` as tokens arrive."""
        return Generation(self, list(prompt_ids), params)


class Generation:
    """A running request. Iterating it drives the model; ``result`` fills in as it goes."""

    def __init__(self, engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        limit = engine.context_length
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {limit}; "
                "shorten the prompt or reset the conversation"
            )
        vocab = engine.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        self.engine = engine
        self.params = params
        self.max_new = min(params.max_new_tokens, limit - len(prompt_ids))
        self.result = GenerationResult(prompt_ids=prompt_ids)
        self._stops = _StopMatcher(params.stop)

    def __iter__(self) -> Iterator[TokenEvent]:
        eng, params, result = self.engine, self.params, self.result
        stop_ids = set() if params.ignore_eos else set(eng.eos_token_ids)
        stop_ids |= set(params.extra_stop_token_ids)
        generator = make_generator(params.seed, eng.device)
        detok = IncrementalDetokenizer(eng.tokenizer)
        cache = eng.new_cache(len(result.prompt_ids) + self.max_new)
        # Every token seen so far, for the repetition penalty; lives beside the logits.
        history = torch.empty(len(result.prompt_ids) + self.max_new, dtype=torch.long,
                              device=eng.device)  # fmt: skip
        history[: len(result.prompt_ids)] = torch.tensor(result.prompt_ids)
        seen = len(result.prompt_ids)
        started = time.perf_counter()
        first_token_at = started

        pending = result.prompt_ids
        position = 0
        while True:
            logits = eng.forward_logits(pending, cache, position)[-1:]
            position += len(pending)
            token = sample(logits, [params], [history[:seen]], [generator])[0]
            now = time.perf_counter()
            if not result.token_ids:
                first_token_at = now
                result.ttft_s = now - started
            result.token_ids.append(token)
            history[seen] = token
            seen += 1

            finish = None
            if token in stop_ids:
                piece, finish = self._stops.feed(detok.flush(), final=True), "stop"
            else:
                piece = self._stops.feed(detok.add(token), final=False)
                if self._stops.hit:
                    finish = "stop"
                elif len(result.token_ids) >= self.max_new:
                    piece += self._stops.feed(detok.flush(), final=True)
                    finish = "length"
            result.text += piece
            if finish is not None:
                result.finish_reason = finish
                n = len(result.token_ids)
                result.tpot_s = (now - first_token_at) / (n - 1) if n > 1 else None
            yield TokenEvent(token, piece, finish)
            if finish is not None:
                return
            pending = [token]


class _StopMatcher:
    """Releases streamed text, holding back any tail that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.hit = False

    def feed(self, delta: str, *, final: bool) -> str:
        if self.hit:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return text[:cut]
        if final:
            self.held = ""
            return text
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def _generation_config_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
