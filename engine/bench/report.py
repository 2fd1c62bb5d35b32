"""The bench reports as text: the single workload's (:func:`format_report`), the mixed
workload's (:func:`format_workload_report`) and the table's (:func:`format_table`), and
:func:`text_table`, the right-aligned columns every bench report is laid out in.
"""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    head = (
        f"model {report['model']}  precision {report['precision']}  device {report['device']}  "
        f"threads {report['threads']}  median of {report['repeats']}"
    )
    cols = ["engine", "batch", "prompt", "new", "prefill tok/s", "decode tok/s", "TTFT ms",
            "TPOT ms"]  # fmt: skip
    rows = [
        [
            r["engine"], str(r["batch"]), str(r["prompt_len"]), str(r["new_tokens"]),
            f"{r['prefill_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}", f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']:.2f}",
        ]
        for r in report["results"]
    ]  # fmt: skip
    lines = [head, *text_table(cols, rows)]
    peak_name = "peak CUDA allocated" if report["device"].startswith("cuda") else "peak RSS"
    lines.append(
        f"weights {report['weights_mib']:.0f} MiB ({report['weights_vs_fp16']:.2f}× fp16); "
        f"process {peak_name} "
        f"{report['results'][0]['peak_mem_mib']:.0f} MiB"
    )
    if "prefix_cache" in report:
        batch = report["results"][0]["batch"]
        lines.append(
            f"prefix cache {report['prefix_cache']}: the timed prefills found "
            f"{report['cached_prompt_tokens']} of their prompt tokens cached"
            + _copies_note(batch, report["prefix_cache"] != "off")
        )
    lines += _verdicts_line(report)
    first = report["results"][0]["engine"].removeprefix("infersight, ")
    for kv, ratio in report.get("kv_ratios", {}).items():
        lines.append(
            f"KV {kv} / {first}: decode {ratio['decode']:.2f}x, prefill {ratio['prefill']:.2f}x "
            "(the same weights, in turn within each repeat)"
        )
    if "ratio_decode" in report:
        lines.append(
            f"infersight / transformers: decode {report['ratio_decode']:.2f}x, "
            f"prefill {report['ratio_prefill']:.2f}x"
        )
    return "\n".join(lines)


def _verdicts_line(report: dict[str, Any]) -> list[str]:
    """What the run's kernel choices stood on: this machine's kept verdicts, counted."""
    v = report.get("kernel_verdicts")
    if not v or not any(v.values()):
        return []
    return [
        f"kernel verdicts kept on this machine (every build, at no slack): {v['ours']} "
        f"shapes ours ({v['within_noise']} within the noise of two timings), {v['torch']} "
        "torch's (`infersight kernels` lists them; --retime times them again)"
    ]


def _copies_note(batch: int, caching: bool) -> str:
    """What the other copies of a ``batch`` run do to the first request's prefill figures."""
    if batch == 1:
        return ""
    others = f"; the {batch - 1} other copies of a run's first request"
    timed = "(prefill and TTFT time the first request)"
    if caching:
        return f"{others} share its prompt blocks as it computes them {timed}"
    return f"{others} compute their prompts in its steps where they fit {timed}"


def text_table(cols: list[str], rows: list[list[str]]) -> list[str]:
    """A header line and one line per row, every column right-aligned to its widest cell."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    return ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True))
            for line in (cols, *rows)]  # fmt: skip


def format_workload_report(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}  precision {report['precision']}  device {report['device']}  "
        f"threads {report['threads']}  {report['requests']} requests (seed {report['seed']}), "
        f"KV pool {report['kv_blocks']} blocks × {report['block_size']}"
        + (f", a shared prefix of {report['shared_prefix']} tokens"
           if report.get("shared_prefix") else "")
    ]  # fmt: skip
    cols = ["engine", "batch", "prefix cache", "out tok/s", "total tok/s", "TTFT p50/p95/p99 s",
            "TPOT p50/p95/p99 ms", "peak KV", "KV waste", "contig. util", "preempt"]  # fmt: skip
    rows = []
    for r in report["results"]:
        kv = r["peak_kv_usage"] is not None
        cache = "-"
        if r["prefix_caching"] is not None:
            hits = r["cached_prompt_tokens"] / r["prompt_tokens"]
            cache = f"on, {hits:.0%} hit" if r["prefix_caching"] else "off"
        rows.append([
            r["engine"], str(r["max_batch_size"]), cache, f"{r['output_tok_s']:.1f}",
            f"{r['total_tok_s']:.1f}",
            f"{r['ttft_p50_s']:.2f}/{r['ttft_p95_s']:.2f}/{r['ttft_p99_s']:.2f}",
            f"{r['tpot_p50_s'] * 1e3:.0f}/{r['tpot_p95_s'] * 1e3:.0f}/{r['tpot_p99_s'] * 1e3:.0f}",
            f"{r['peak_kv_usage']:.0%}" if kv else "-",
            f"{r['mean_kv_waste']:.1%}" if kv else "-",
            f"{r['mean_contiguous_utilisation']:.0%}" if kv else "-",
            str(r["preemptions"]) if kv else "-",
        ])  # fmt: skip
    lines += text_table(cols, rows)
    for key, label in (("speedup_vs_batch1", "vs our batch 1"),
                       ("ratio_vs_transformers", "vs transformers")):  # fmt: skip
        if key in report:
            parts = ", ".join(f"batch {b}: {v:.2f}x" for b, v in report[key].items())
            lines.append(f"output throughput {label}: {parts}")
    for b, ratio in report.get("prefix_cache_on_vs_off", {}).items():
        lines.append(
            f"prefix cache on vs off, batch {b}: output throughput {ratio['output_tok_s']:.2f}x, "
            f"TTFT p50 {ratio['ttft_p50']:.2f}x"
        )
    if "best_vs_batch1" in report:
        b = report["best_vs_batch1"]
        lines.append(f"our best (batch {b['batch']}) vs our batch 1: {b['ratio']:.2f}x")
    if "best_vs_best_transformers" in report:
        b = report["best_vs_best_transformers"]
        lines.append(
            f"our best (batch {b['ours']}) vs transformers' best (static batches of "
            f"{b['transformers']}, {b.get('transformers_precision', 'the same precision')}): "
            f"{b['ratio']:.2f}x"
        )
    return "\n".join(lines)


#: the llama.cpp file type that stores weights as our precision does (by its prefix)
PEER_TYPES = (("int4", "Q4_1"), ("int8", "Q8_0"), ("fp32", "F32"), ("bf16", "F16"), ("fp16", "F16"))


def peer_type(precision: str) -> str | None:
    """The llama.cpp file type a precision of ours is compared with: group-wise INT4 with zero
    points against Q4_1 (32 weights, a scale and a minimum), INT8 against Q8_0, fp32 against
    F32, 16-bit floats against F16."""
    return next((t for prefix, t in PEER_TYPES if precision.startswith(prefix)), None)


def format_table(report: dict[str, Any]) -> str:
    bw = report["bandwidth_gb_s"]
    lines = [
        f"model {report['model']}  CPU {report['cpu']}  threads {report['threads']}  "
        f"batch 1, {report['new_tokens']} new tokens, median of {report['repeats']}"
        + (f", prefix cache {report['prefix_cache']}" if "prefix_cache" in report else ""),
        f"memory read bandwidth {max(bw):.1f} GB/s (before {bw[0]:.1f}, after {bw[-1]:.1f}); "
        "limit = bandwidth / weights read per token",
    ]
    peers = {r["precision"]: r for r in report["rows"] if r["engine"] == "llama.cpp"}
    q4 = peers.get("Q4_1")
    matched = any(peer_type(r["precision"]) in peers for r in report["rows"])
    cols = ["engine", "precision", "mode", "head", "read MiB", "decode tok/s", "limit tok/s",
            "of limit", "kernels-only tok/s"] + (["vs llama.cpp Q4_1"] if q4 else [])  # fmt: skip
    cols += ["vs llama.cpp, same bits"] if matched else []
    rows = []
    for r in report["rows"]:
        floor = r.get("kernels_tok_s")
        row = [r["engine"], r["precision"], r["mode"], r.get("head") or "-",
               f"{r['read_mib']:.0f}",
               f"{r['decode_tok_s']:.1f}", f"{r['limit_tok_s']:.0f}",
               f"{r['fraction']:.2f}", "-" if floor is None else f"{floor:.1f}"]  # fmt: skip
        if q4:
            row.append(f"{r['decode_tok_s'] / q4['decode_tok_s']:.2f}x")
        if matched:
            peer = peers.get(peer_type(r["precision"]) or "")
            if r["engine"] == "infersight" and peer is not None:
                row.append(f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}x {peer['precision']}")
            else:
                row.append("-")
        rows.append(row)
    lines += text_table(cols, rows)
    lines.append(
        "kernels-only: the step's matmuls and attention timed back to back with nothing "
        "between them (the floor under Python, dispatch and small ops); for a C step, its "
        "products and attention as its own clocks timed them in the runs"
    )
    for r in report["rows"]:
        if r.get("why"):
            lines.append(f"{r['precision']} ran eager: {r['why']}")
    lines += _verdicts_line(report)
    if report.get("llama_cpp_system_info"):
        lines.append(f"llama.cpp: {report['llama_cpp_system_info']}")
    return "\n".join(lines)
