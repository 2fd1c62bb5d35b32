"""Host syncs per decode step: at most one, at batch 1 and at batch 16, greedy and sampled.

On a GPU the host waits for the device whenever it reads a tensor's values (``item``,
``tolist``, ``int(t)``, ``bool(t)``, a copy to the CPU) and whenever it copies pageable host
memory to the device (``torch.tensor(..., device=cuda)``, ``.to(cuda)`` without
``non_blocking``). Each wait stalls the step: the host cannot queue the next kernels until
the device has caught up. A decode step needs the host to learn its sampled tokens, and
nothing else: one wait.

These machines have no GPU, so the test counts the *calls* that would wait there, wherever
they are made on the step's path, on CPU tensors: a host-only tensor read in Python costs
little on a CPU but stays on the path, so the step does none. The same calls are what
:mod:`engine.hardware.transfer` makes once, on purpose.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model

#: Tensor methods that read values back to the host (each one waits for the device there).
READS = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__")
#: Ops whose output size depends on values (the host must learn it before going on).
DATA_DEPENDENT = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
#: Ops that read one value back (what ``item``/``int``/``bool`` dispatch to).
SCALAR_READS = {"_local_scalar_dense"}

SAMPLED = SamplingParams(
    max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02,
    repetition_penalty=1.1, ignore_eos=True, seed=5,
)  # fmt: skip
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


class SyncCounter(TorchDispatchMode):
    """Counts the calls that would make the host wait for a GPU, with where each was made."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.where: dict[str, str] = {}

    def hit(self, name: str) -> None:
        self.calls[name] += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/engine/" in f.filename]
        path = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:])
        self.where.setdefault(name, path)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in DATA_DEPENDENT or name in SCALAR_READS:
            self.hit(f"aten.{name}")
        elif name in ("index", "index_put_", "index_put") and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):  # a boolean mask index: how many rows it selects is data
            self.hit(f"aten.{name}(bool mask)")
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    """Inside: every call that would sync on a GPU is counted (and still runs)."""
    counter = SyncCounter()
    with monkeypatch.context() as m:
        for name in READS:
            real = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *a: Any, _real: Any = real, _n: str = name, **k: Any) -> Any:
                counter.hit(f"Tensor.{_n}")
                with _paused(counter):
                    return _real(t, *a, **k)

            m.setattr(torch.Tensor, name, read)
        real_tensor = torch.tensor

        def tensor(*a: Any, **k: Any) -> torch.Tensor:
            if k.get("device") is not None:  # a pageable host copy to the device
                counter.hit("torch.tensor(device=)")
            return real_tensor(*a, **k)

        m.setattr(torch, "tensor", tensor)
        real_to = torch.Tensor.to

        def to(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            target = k.get("device", a[0] if a else None)
            if isinstance(target, (str, torch.device)) and not k.get("non_blocking", False):
                counter.hit("Tensor.to(device)")
            return real_to(self, *a, **k)

        m.setattr(torch.Tensor, "to", to)
        with counter:
            yield counter


@contextlib.contextmanager
def _paused(counter: SyncCounter) -> Iterator[None]:
    """A counted read's own ops are not counted again."""
    calls = Counter(counter.calls)
    try:
        yield
    finally:
        counter.calls = calls


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    folder, _ = tiny_model_dir("llama", False)
    # Eager decode steps: the compiled graph's path is the same host code around the same
    # forward, and compiling here would only cost time.
    return load_model(folder, config=EngineConfig(decode_graph="off"))


def decode_syncs(
    engine: LLMEngine, params: SamplingParams, batch: int, monkeypatch: pytest.MonkeyPatch
) -> list[SyncCounter]:
    """The syncs of each decode-only step of ``batch`` requests with ``params``."""
    for i in range(batch):
        engine.add_request([5 + i, 17, 33 + i, 8], params)
    while any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    counted = []
    while engine.has_work():
        assert all(s.num_computed >= len(s.prompt_ids) for s in engine.scheduler.running)
        with counting(monkeypatch) as counter:
            events = engine.step()
        assert sum(e.token_id is not None for e in events) == batch  # every row advanced
        counted.append(counter)
    assert len(counted) == params.max_new_tokens - 1
    return counted


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_decode_step_syncs_the_host_once(engine, params, batch, monkeypatch):
    for counter in decode_syncs(engine, params, batch, monkeypatch):
        assert counter.total <= 1, (counter.calls, counter.where)


def test_logprobs_ride_the_same_transfer(engine, monkeypatch):
    from dataclasses import replace

    params = replace(SAMPLED, logprobs=3)
    for counter in decode_syncs(engine, params, 4, monkeypatch):
        assert counter.total <= 1, (counter.calls, counter.where)


def test_the_counter_sees_each_kind_of_sync(monkeypatch):
    """Each call the engine must avoid is counted once: the test above can fail."""
    t = torch.arange(4)
    reads = [
        lambda: t[1].item(), lambda: t.tolist(), lambda: t.cpu(), lambda: int(t[0]),
        lambda: bool(t[1]), lambda: float(t[2]), lambda: torch.tensor([1], device="cpu"),
        lambda: t.to("cpu"), lambda: t.nonzero(), lambda: t[t > 1],
    ]  # fmt: skip
    for read in reads:
        with counting(monkeypatch) as counter:
            read()
        assert counter.total >= 1, read
    with counting(monkeypatch) as counter:
        t.to("cpu", non_blocking=True)
        torch.tensor([1, 2])
        (t * 2).sum()
    assert counter.total == 0


def test_a_verify_step_syncs_once_per_sequence_it_verifies(tiny_model_dir, monkeypatch):
    """Speculative decoding by prompt lookup (drafting reads token lists, no tensor): each
    sequence's drafts are checked at once and their outcome read back in one transfer, and
    the rows sampled without drafts share one more."""
    from engine.speculative.config import VerifyCost, parse_speculative

    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder, config=EngineConfig(decode_graph="off"))
    fixed = VerifyCost(0.1, 0.05)  # no timing probe
    engine.set_speculation(
        parse_speculative("lookup", k=3, ngram_min=1, adaptive=False, verify_cost=fixed)
    )
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1]  # repeats: lookup always finds a match
    batch = 4
    for i in range(batch):
        engine.add_request(prompt, SAMPLED if i % 2 else GREEDY)
    verified = 0
    while engine.has_work():
        with counting(monkeypatch) as counter:
            engine.step()
        drafted = engine.speculator.stats.num_drafts - verified
        verified += drafted
        if drafted:
            assert counter.total <= drafted + 1, (counter.calls, counter.where)
    assert verified >= batch  # the case under test happened
