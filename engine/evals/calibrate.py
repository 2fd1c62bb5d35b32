"""``infersight calibrate``: the statistics W8A8's smoothing needs, from text the model writes.

Quantizing activations needs to know their ranges; that takes text, and no labelled data: the
model writes its own (the recipe of the seeds: about 20 prompts × 10 samples, at lengths that
cover what inference will see). The float model then reads every sequence once while a hook
on each smoothed linear keeps the largest magnitude of each input channel
(:mod:`engine.quant.calibration` says what they become). Calibrating on random tokens instead
(``--random``) is the counter-example: those activations are not the ones real text makes.

SmoothQuant's α is chosen last, by a small sweep: ``w8a8-sq`` scores a held part of the
calibration text at each α, one α for every linear first, then one per kind of linear from
there (:func:`sweep`), and the α with the lowest loss (mean negative log-likelihood of the
text's next tokens) is kept in the calibration's JSON with every loss tried. ``infersight
calibrate --sweep`` runs the sweep again on saved statistics.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import EngineBusyError, InvalidRequestError
from engine.quant import calibration as files
from engine.quant.calibration import Calibration

#: The prompts the model answers (rendered with its chat template), ``samples`` times each.
PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle step by step.",
    "Write a polite email asking a colleague to review a document.",
    "Solve: a train travels 120 km in 1.5 hours. What is its average speed?",
    "What are some good habits for studying effectively?",
    "Explain what a neural network is to someone who has never programmed.",
    "Write a poem about autumn leaves.",
    "Compare renewable and non-renewable energy sources.",
    "How does a bill become a law in a parliament?",
    "Write a SQL query that finds the ten most recent orders of each customer.",
    "What should I pack for a week-long hiking trip?",
    "Explain the theory of evolution by natural selection.",
    "Translate into French and explain the grammar: 'I would like a cup of coffee, please.'",
]
#: the α the sweep tries
ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8)
#: sequences of the calibration text the sweep scores, and tokens of each at most
HELD_SEQUENCES, HELD_TOKENS = 8, 512


@dataclass(frozen=True)
class Recipe:
    """What a calibration is made from (kept in its JSON)."""

    source: str = "self"  # self | random | file
    prompts: int = 20
    samples: int = 10
    min_tokens: int = 32
    max_tokens: int = 2048
    seed: int = 0
    temperature: float = 0.8
    top_p: float = 0.95
    file: str | None = None
    alphas: tuple[float, ...] = field(default=ALPHAS)

    @property
    def name(self) -> str:
        """The calibration's name in the model's folder."""
        if self.source == "file":
            assert self.file is not None
            stem = "".join(c if c.isalnum() or c in "_-" else "-" for c in Path(self.file).stem)
            return f"file-{stem[:40]}"
        return self.source

    def check(self) -> None:
        if self.source not in ("self", "random", "file"):
            raise InvalidRequestError(f"unknown calibration source {self.source!r}")
        if self.prompts < 1 or self.samples < 1:
            raise InvalidRequestError("--prompts and --samples must be at least 1")
        if not 2 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("the sequence lengths need 2 <= --min-tokens <= --max-tokens")


def lengths(recipe: Recipe, count: int, context: int) -> list[int]:
    """``count`` sequence lengths, log-uniform between the recipe's bounds (the context
    length caps them), seeded: as many short sequences as long ones per doubling."""
    rng = random.Random(recipe.seed)
    top = min(recipe.max_tokens, context)
    low = min(recipe.min_tokens, top)
    return [round(math.exp(rng.uniform(math.log(low), math.log(top)))) for _ in range(count)]


def self_generated(
    eng: LLMEngine, recipe: Recipe, progress: Callable[[int, int], None] | None = None
) -> list[list[int]]:
    """``prompts × samples`` sequences the model writes itself: each a prompt in its chat
    template (as it is, where the model has none) and a sampled answer, to one of
    :func:`lengths` (the answer goes on past an end-of-turn token, so long lengths are
    reached too), all run as one continuous batch."""
    count = recipe.prompts * recipe.samples
    targets = lengths(recipe, count, eng.context_length)
    todo: list[tuple[list[int], SamplingParams]] = []
    for i in range(count):
        prompt = PROMPTS[(i // recipe.samples) % len(PROMPTS)]
        ids = (
            eng.chat_prompt_ids([{"role": "user", "content": prompt}])
            if eng.tokenizer.chat_template else eng.tokenizer.encode(prompt)
        )  # fmt: skip
        new = max(1, targets[i] - len(ids))
        params = SamplingParams(
            max_new_tokens=new, temperature=recipe.temperature, top_p=recipe.top_p,
            seed=recipe.seed * 100_003 + i, ignore_eos=True,
        )  # fmt: skip
        todo.append((ids, params))
    out: dict[str, list[int]] = {}
    order: list[str] = []
    pending = list(todo)
    done = 0
    while pending or eng.has_work():
        while pending:
            ids, params = pending[0]
            try:
                rid = eng.add_request(ids, params)
            except EngineBusyError:
                break
            out[rid] = list(ids)
            order.append(rid)
            pending.pop(0)
        for event in eng.step():
            if event.token_id is not None:
                out[event.request_id].append(event.token_id)
            if event.finish_reason is not None:
                done += 1
                if progress is not None:
                    progress(done, count)
    return [out[rid] for rid in order]


def random_tokens(eng: LLMEngine, recipe: Recipe) -> list[list[int]]:
    """The counter-example: as many sequences, of the same lengths, of uniformly random ids."""
    count = recipe.prompts * recipe.samples
    gen = torch.Generator().manual_seed(recipe.seed)
    vocab = eng.cfg.vocab_size
    return [
        torch.randint(0, vocab, (n,), generator=gen).tolist()
        for n in lengths(recipe, count, eng.context_length)
    ]


def from_text(eng: LLMEngine, recipe: Recipe, text: str) -> list[list[int]]:
    """A user's text, tokenized and cut into sequences of :func:`lengths` (as many as it
    fills, at most ``prompts × samples``)."""
    ids = eng.tokenizer.encode(text)
    if len(ids) < recipe.min_tokens:
        raise InvalidRequestError(
            f"{recipe.file} holds {len(ids)} tokens; calibration needs at least "
            f"{recipe.min_tokens}: give a longer text"
        )
    out, at = [], 0
    for n in lengths(recipe, recipe.prompts * recipe.samples, eng.context_length):
        if at >= len(ids):
            break
        out.append(ids[at : at + n])
        at += n
    return out


def smoothed_linears(model: nn.Module, num_layers: int) -> dict[str, nn.Module]:
    return {
        f"layers.{layer}.{name}": model.get_submodule(f"layers.{layer}.{name}")
        for layer in range(num_layers)
        for name in files.SMOOTHED
    }


def statistics(
    eng: LLMEngine,
    sequences: list[list[int]],
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Each smoothed linear's largest input magnitude per channel over every token of
    ``sequences`` (read by the float model, one prefill each), and its weights' largest
    magnitude per input column."""
    linears = smoothed_linears(eng.model, eng.cfg.num_layers)
    act: dict[str, Tensor] = {}
    weight: dict[str, Tensor] = {}
    for name, module in linears.items():
        w = getattr(module, "weight", None)
        if not isinstance(w, Tensor) or w.dtype not in (torch.float32, torch.bfloat16):
            raise InvalidRequestError(
                f"{name} is not a float linear here; calibrate on a float precision (fp32)"
            )
        weight[name] = w.detach().float().abs().amax(dim=0).cpu()

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            seen = x.reshape(-1, x.shape[-1]).float().abs().amax(dim=0).cpu()
            act[name] = seen if name not in act else torch.maximum(act[name], seen)

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.inference_mode():
            for i, seq in enumerate(sequences):
                eng.runner.forward_logits(seq, eng.runner.new_cache(len(seq)), 0)
                if progress is not None:
                    progress(i + 1, len(sequences))
    finally:
        for h in handles:
            h.remove()
    return act, weight


def held_loss(eng: LLMEngine, sequences: list[list[int]]) -> float:
    """Mean negative log-likelihood of each sequence's next tokens under ``eng``."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for seq in sequences:
            logits = eng.runner.forward_logits(seq, eng.runner.new_cache(len(seq)), 0)
            logprobs = F.log_softmax(logits[:-1].float(), dim=-1)
            targets = torch.tensor(seq[1:], device=logprobs.device)
            total -= float(logprobs.gather(1, targets[:, None]).sum())
            count += len(seq) - 1
    return total / max(count, 1)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("infersight")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class CalibrationReport:
    name: str
    path: str
    sequences: int
    tokens: int
    alphas: dict[str, float]  # the α chosen for each kind of linear
    #: the held loss of w8a8-sq at each α tried ("0.6,0.6,0.6,0.75": qkv, o, gate_up, down),
    #: and "float": the float model's
    losses: dict[str, float]
    seconds_generating: float


def calibrate(
    folder: Path,
    recipe: Recipe,
    *,
    load: Callable[..., LLMEngine],
    precision: str = "fp32",
    text: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> CalibrationReport:
    """Make calibration ``recipe.name`` of the model in ``folder`` and save it beside it.

    ``load(folder, precision=…, pack=False, alpha=…)`` loads an engine (the loader's
    ``load_model``); the float model writes (``self``) or reads the text, then each α the
    sweep tries loads ``w8a8-sq`` once (:func:`sweep`). ``text``: the user's text for
    ``source == "file"``."""
    recipe.check()

    def report(stage: str) -> Callable[[int, int], None] | None:
        return None if progress is None else (lambda d, t: progress(stage, d, t))

    from engine.model.config import ModelConfig
    from engine.quant.calibration import CalibrationError

    if ModelConfig.from_file(folder / "config.json").num_experts:
        raise CalibrationError(
            "calibration measures dense MLPs; a mixture of experts runs w8a8 (dynamic), int8 "
            "or int4 per expert, which need none"
        )
    eng = load(folder, precision=precision, pack=False)
    started = time.perf_counter()
    if recipe.source == "self":
        sequences = self_generated(eng, recipe, report("writing"))
    elif recipe.source == "random":
        sequences = random_tokens(eng, recipe)
    else:
        assert text is not None
        sequences = from_text(eng, recipe, text)
    generating = time.perf_counter() - started
    act, weight = statistics(eng, sequences, report("reading"))
    held = [s[:HELD_TOKENS] for s in sequences[:: max(1, len(sequences) // HELD_SEQUENCES)]]
    held = [s for s in held if len(s) > 1][:HELD_SEQUENCES]
    float_loss = held_loss(eng, held)
    del eng
    meta: dict[str, Any] = {
        "recipe": {k: v for k, v in asdict(recipe).items() if v is not None},
        "precision": precision,
        "sequences": len(sequences),
        "tokens": sum(len(s) for s in sequences),
        "infersight": _version(),
        "float_loss": float_loss,
    }
    cal = Calibration(act, weight, meta, held)
    cal.save(folder, recipe.name)  # the sweep's loads read it
    sweep(folder, recipe.name, cal, load=load, alphas=recipe.alphas, progress=progress)
    return report_of(folder, recipe.name, cal, generating)


def report_of(folder: Path, name: str, cal: Calibration, generating: float) -> CalibrationReport:
    return CalibrationReport(
        name, str(files.files(folder, name)[1]), int(cal.meta["sequences"]),
        int(cal.meta["tokens"]), cal.alphas, cal.meta["losses"], generating,
    )  # fmt: skip


def _all(alpha: float) -> dict[str, float]:
    return dict.fromkeys(files.SMOOTHED, alpha)


def sweep(
    folder: Path,
    name: str,
    cal: Calibration,
    *,
    load: Callable[..., LLMEngine],
    alphas: tuple[float, ...] = ALPHAS,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, float]:
    """Choose SmoothQuant's α for calibration ``name`` (saved with ``cal``'s statistics and
    held text) and save it: one α for every linear first, then, from there, one per kind of
    linear (a coordinate descent: each kind tried at every α with the others kept), each
    choice the lowest loss of ``w8a8-sq`` on the held text. Returns the α per kind."""
    losses: dict[str, float] = {"float": float(cal.meta["float_loss"])}
    spec = f"w8a8-sq@{name}"
    tried = 0
    total = len(alphas) * (1 + len(files.SMOOTHED))

    def loss(choice: dict[str, float], label: str) -> float:
        nonlocal tried
        key = ",".join(f"{choice[k]:g}" for k in files.SMOOTHED)
        if key not in losses:
            engine = load(folder, precision=spec, alpha=choice)
            losses[key] = held_loss(engine, cal.held)
            del engine
        tried += 1
        if progress is not None:
            progress(label, tried, total)
        return losses[key]

    every = min(alphas, key=lambda a: loss(_all(a), "sweeping α"))
    chosen = dict.fromkeys(files.SMOOTHED, every)
    for kind in files.SMOOTHED:
        chosen[kind] = min(alphas, key=lambda a: loss({**chosen, kind: a}, "α per linear"))
    cal.meta |= {
        "alphas": chosen,
        "losses": losses,
        "held": {"sequences": len(cal.held), "tokens": HELD_TOKENS},
    }
    cal.meta.pop("alpha", None)
    cal.save(folder, name)
    return chosen
