"""The soak: ``infersight serve`` held under mixed traffic with faults for ``--minutes``, what
comes back checked. Two servers on the default model — INT4 with speculative decoding (the
``lookup`` drafter) and W8A8 without — each driven by the project's load generator
(:class:`app.endpoints.load.EndpointLoad`: closed-loop users) with the :data:`TRAFFIC` of
:class:`engine.bench.load_spec.Traffic` (chat and completions, streamed and not, greedy and
sampled, replies ending at their end token or their length; questions, conversations and
documents, which many requests share as a prefix; hang-ups mid-stream, cancels, slow
readers, oversize bodies and prompts, malformed JSON, at fixed rates).

Every :data:`SAMPLE_S` it records, per server: its RSS, threads and open file descriptors
(``/proc``), the KV blocks held and kept as reusable prefixes and the queue (its
``/metrics``), and the p50/p99 TTFT and TPOT of the requests that ended in that interval. At
the end it checks:

* the load ran its whole duration (no failure that ends a load: unreachable, a key or a model
  refused);
* nothing accepted was lost: every request ended whole, with an error event naming why, in a
  refusal in OpenAI's shape, or cut by the client itself (:attr:`Record.outcome
  <app.endpoints.load.Record.outcome>`);
* each request ended as its fault asks (:data:`EXPECTED`): a plain one and a slow reader's
  whole, a cancel cut, a hang-up cut (or whole where the reply ended first), the oversize,
  over-context and malformed bodies refused;
* no block leaked: once idle, no request runs or waits and no KV block is held;
* RSS after the warm-up (the first quarter) grows at most :data:`RSS_SLOPE_MIB_MIN` MiB a
  minute (least squares; judged where that window is 10 minutes or longer);
* the p99 TTFT and TPOT of the last five minutes are within :data:`P99_FACTOR` of the first
  five minutes' after the warm-up (the median of the 10 s readings; judged where the run
  leaves five minutes at each end);
* threads and file descriptors come back to within a few of where they stood after warm-up.

``python -m checks.soak --minutes 60 --out docs/soak`` (``make soak``); exit status 1 where a
check fails. The figures and plots of an hour's run are in ``docs/reliability.md``."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx2

from app.endpoints.client import Endpoint
from app.endpoints.load import FATAL, EndpointLoad, EndpointRun, outcome_counts
from app.endpoints.server_metrics import samples
from checks.serve_process import serving_process
from engine.bench.load_spec import LoadSpec, PromptMix, Traffic

SAMPLE_S = 10.0
RSS_SLOPE_MIB_MIN = 1.0
P99_FACTOR = 1.5
KEY = "soak-key"
#: the servers: precision and serve's other arguments
SERVERS = {"int4-g32+spec": ("int4-g32", ("--speculative", "lookup")), "w8a8": ("w8a8", ())}
#: what the requests say: questions, documents and conversations (shared prefixes), 8–48 tokens
MIX = PromptMix(documents=0.5, conversations=0.1, conversation_tokens=(300, 800),
                output_median=20, output_sigma=0.6, output_min=8, output_max=48)  # fmt: skip
#: how they are sent, and the faults among them
TRAFFIC = Traffic(completions=0.5, unstreamed=0.4, sampled=0.4, temperature=0.8,
                  faults=(("disconnect", 0.06), ("cancel", 0.04), ("slow_reader", 0.05),
                          ("oversize_body", 0.02), ("over_context", 0.02),
                          ("malformed", 0.03)))  # fmt: skip
#: how a request with each fault ("" none) may end
EXPECTED = {"": {"whole"}, "slow_reader": {"whole"}, "disconnect": {"cut", "whole"},
            "cancel": {"cut"}, "oversize_body": {"refused"}, "over_context": {"refused"},
            "malformed": {"refused"}}  # fmt: skip
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_used": "infersight:kv_blocks_used", "kv_cached": "infersight:kv_blocks_cached",
          "kv_total": "infersight:kv_blocks_total"}  # fmt: skip


def proc_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), threads and open file descriptors of a process, from ``/proc``."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"]), "fds": fds}  # fmt: skip


def scrape(client: httpx2.Client, base: str) -> dict[str, float]:
    text = client.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = samples(text)
    return {name: found.get(metric, float("nan")) for name, metric in GAUGES.items()}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Soak:
    """The loads, the samples and the records of one run (see the module docstring)."""

    def __init__(self, servers: dict[str, tuple[str, int, str]], clients: int, seed: int):
        self.servers = servers  # name → (base URL, pid, model id)
        self.clients, self.seed = clients, seed
        self.stop = threading.Event()
        self.loads: dict[str, EndpointLoad] = {}
        self.samples: list[dict[str, Any]] = []
        self.started = time.perf_counter()

    def _sample(self) -> None:
        with httpx2.Client(timeout=10.0) as client:
            last = self.started
            while not self.stop.wait(max(0.0, last + SAMPLE_S - time.perf_counter())):
                now = time.perf_counter()
                self.samples.append(self.reading(client, last, now))
                last = now

    def reading(self, client: httpx2.Client, since: float, now: float) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": now - self.started}
        for name, (base, pid, _) in self.servers.items():
            ended = self.loads[name].ended_since(since)
            recent = [r for r in ended if r.sent + r.e2e_s < now and r.outcome == "whole"
                      and not r.shape.fault]  # fmt: skip
            ttft = [r.time_to_first_token_seconds * 1e3 for r in recent
                    if r.time_to_first_token_seconds is not None]  # fmt: skip
            tpot = [r.time_per_output_token_seconds * 1e3 for r in recent
                    if r.time_per_output_token_seconds is not None]  # fmt: skip
            row[name] = {
                **proc_figures(pid), **scrape(client, base), "requests": len(recent),
                "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
                "tpot_p50_ms": pct(tpot, 0.5), "tpot_p99_ms": pct(tpot, 0.99),
            }  # fmt: skip
        return row

    def run(self, minutes: float) -> None:
        spec = LoadSpec(mode="closed", users=self.clients, requests=None, seed=self.seed,
                        duration_s=minutes * 60, mix=MIX, traffic=TRAFFIC)  # fmt: skip
        for name, (base, _, model) in self.servers.items():
            # replies end at their end token (speculation's stop included) or their length
            endpoint = Endpoint(base, model, KEY)
            self.loads[name] = EndpointLoad(endpoint, spec, ignore_eos=False).start()
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        try:
            for load in self.loads.values():
                load.wait()  # its duration over, and the requests in flight ended
        except KeyboardInterrupt:
            print("stopped early: the figures so far follow", file=sys.stderr)
            for load in self.loads.values():
                load.stop()
                load.wait()
        self.stop.set()
        sampler.join(60)


def settle(servers: dict[str, tuple[str, int, str]], timeout: float = 60.0) -> dict[str, Any]:
    """Each server's figures once it is idle (or as they stand after ``timeout``)."""
    deadline = time.monotonic() + timeout
    with httpx2.Client(timeout=10.0) as client:
        while True:
            figures = {name: {**scrape(client, base), **proc_figures(pid)}
                       for name, (base, pid, _) in servers.items()}  # fmt: skip
            idle = all(f["running"] == f["waiting"] == f["kv_used"] == 0
                       for f in figures.values())  # fmt: skip
            if idle or time.monotonic() > deadline:
                return figures
            time.sleep(1.0)


def slope_mib_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per minute."""
    ts, ys = [p[0] for p in points], [p[1] for p in points]
    t0, y0 = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - t0) ** 2 for t in ts)
    if not den:
        return 0.0
    return 60.0 * sum((t - t0) * (y - y0) for t, y in zip(ts, ys, strict=True)) / den


def verdicts(soak: Soak, idle: dict[str, Any], minutes: float) -> dict[str, Any]:
    """The checks of the module docstring, per server: each a (passed, what was measured)."""
    out: dict[str, Any] = {}
    warm_s = minutes * 60 / 4
    for name in soak.servers:
        run = soak.loads[name].run()
        outcomes = run.records
        lost = [r for r in outcomes if r.outcome == "lost"]
        rows = [(s["t_s"], s[name]) for s in soak.samples]
        after = [(t, r) for t, r in rows if t >= warm_s]
        checks: dict[str, Any] = {}
        said = ""
        if lost:  # the first one's story: the server's words, or how the reply ended
            how = lost[0].failure
            said = ": " + (run.first_failure.get(how, how) if how else "no finish")
        checks["nothing accepted lost"] = (not lost, f"{len(lost)} lost of {len(outcomes)}{said}")
        load = soak.loads[name]
        ran = load.ended - load.started
        checks["ran its whole duration"] = (
            not run.result.stopped and ran >= minutes * 60,
            f"{ran / 60:.1f} of {minutes:g} min"
            + (_why_stopped(run) if run.result.stopped else ""),
        )  # fmt: skip
        astray = [r for r in outcomes if r.outcome not in EXPECTED[r.shape.fault]]
        checks["each fault ended as it asks"] = (
            not astray, f"{len(astray)} otherwise" + (
                f": {astray[0].shape.fault or 'none'} → {astray[0].outcome}" if astray else ""),
        )  # fmt: skip
        f = idle[name]
        said = (
            f"idle: {f['running']:g} running, {f['waiting']:g} waiting, "
            f"{f['kv_used']:g} blocks held, {f['kv_cached']:g} cached"
        )
        checks["no block leaked"] = (f["running"] == f["waiting"] == f["kv_used"] == 0, said)
        window_min = (after[-1][0] - after[0][0]) / 60 if len(after) > 1 else 0.0
        slope = slope_mib_min([(t, r["rss_mib"]) for t, r in after]) if len(after) > 1 else 0.0
        judged = window_min >= 10
        checks["RSS slope after warm-up"] = (
            (slope <= RSS_SLOPE_MIB_MIN) if judged else None,
            f"{slope:+.2f} MiB/min over {window_min:.1f} min"
            + ("" if judged else " (too short to judge: 10 min needed)"),
        )  # fmt: skip
        span = min(300.0, (rows[-1][0] - warm_s) / 3 if rows else 0.0)
        for figure in ("ttft_p99_ms", "tpot_p99_ms"):
            first = [r[figure] for t, r in after if t < warm_s + span and r[figure] is not None]
            end = rows[-1][0] - span
            last = [r[figure] for t, r in after if t >= end and r[figure] is not None]
            if first and last:
                a, b = statistics.median(first), statistics.median(last)
                judged = span >= 300.0  # five minutes at each end, else a few readings
                checks[f"{figure} held"] = (
                    (b <= P99_FACTOR * a) if judged else None,
                    f"{a:.0f} → {b:.0f} ms (the median of the 10 s p99s, first and last "
                    f"{span / 60:.1f} min after the warm-up)" + ("" if judged else
                                                                 " (too short to judge)"),
                )  # fmt: skip
        base = after[0][1] if after else None
        if base is not None:
            checks["threads and fds back"] = (
                f["threads"] <= base["threads"] + 4 and f["fds"] <= base["fds"] + 8,
                f"threads {base['threads']} → {f['threads']}, fds {base['fds']} → {f['fds']}",
            )  # fmt: skip
        out[name] = {"checks": checks, "outcomes": outcome_counts(run)}
    return out


def _why_stopped(run: EndpointRun) -> str:
    """What ended a load before its duration: a failure no wait heals, or an interrupt."""
    fatal = [f"{kind}: {run.first_failure.get(kind, '')}" for kind in run.failures if kind in FATAL]
    return f", ended by {'; '.join(fatal)}" if fatal else ", stopped early (interrupted)"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    about = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m checks.soak", description=about)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=3, help="client threads per server")
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the figures so far, servers ended
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, (precision, extra) in SERVERS.items():
            base, proc = stack.enter_context(serving_process(
                args.model, precision, args.out / f"serve-{name}.log", threads=1,
                extra=("--api-key", KEY, "--max-batch-size", "8", *extra)))  # fmt: skip
            listed = httpx2.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            model = listed.json()["data"][0]["id"]
            servers[name] = (base, proc.pid, model)
        soak = Soak(servers, args.clients, args.seed)
        soak.run(args.minutes)
        idle = settle(servers)
        result = verdicts(soak, idle, args.minutes)
    report = {"minutes": args.minutes, "clients_per_server": args.clients, "servers": list(SERVERS),
              "traffic": TRAFFIC.describe(), "samples": soak.samples, "idle": idle,
              "result": result}  # fmt: skip
    (args.out / "soak.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    failed = False
    for name, r in result.items():
        print(f"{name}: " + ", ".join(f"{k} {n}" for k, n in r["outcomes"].items()))
        for check, (passed, said) in r["checks"].items():
            mark = "n/a" if passed is None else ("ok" if passed else "FAILED")
            failed |= passed is False
            print(f"  {mark:6} {check}: {said}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
