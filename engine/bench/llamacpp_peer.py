"""llama.cpp timed the way ``infersight bench`` times the engine, in a process of its own.

This file is run as a script by the Python of a separate environment that has
``llama-cpp-python`` (``make bench-peers`` builds it); it imports nothing from Infersight and
nothing from that environment ever enters the product's. It reads one JSON array per line
on stdin and answers one JSON object per line on stdout:

* ``["load", PATH, THREADS]`` → ``{"loaded": PATH, "system_info": …}``
* ``["quantize", SRC, DST, FTYPE]`` → ``{"quantized": DST}`` (llama.cpp's own requantizer, so
  that its F32/Q8_0 rows hold the very values of the Q4_1 file, as the engine's do)
* ``["run", TOKENS, NEW_TOKENS]`` → ``{"ttft_s", "decode_s", "new_tokens"}``: greedy, EOS not
  checked, the clock read as each token arrives (the engine's bench does the same)
* ``["quit"]``

A failed command answers ``{"error": …}`` and the process lives on.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

#: llama.cpp's file types by the names the bench uses (``llama_ftype`` in llama.h)
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def main() -> int:
    import llama_cpp

    llm: Any = None
    for line in sys.stdin:
        try:
            cmd, *args = json.loads(line)
            if cmd == "load":
                path, threads = args
                llm = llama_cpp.Llama(
                    model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False,
                )  # fmt: skip
                info = llama_cpp.llama_print_system_info().decode(errors="replace")
                reply: dict[str, Any] = {"loaded": path, "system_info": info.strip()}
            elif cmd == "quantize":
                src, dst, ftype = args
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype = FTYPES[ftype]
                params.allow_requantize = True
                rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
                if rc != 0:
                    raise RuntimeError(f"llama_model_quantize returned {rc}")
                reply = {"quantized": dst}
            elif cmd == "run":
                tokens, new_tokens = args
                reply = _run(llm, tokens, new_tokens)
            elif cmd == "quit":
                return 0
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as exc:  # the parent shows it; this process lives on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


def _run(llm: Any, tokens: list[int], new_tokens: int) -> dict[str, float]:
    llm.reset()
    started = time.perf_counter()
    first = end = started
    produced = 0
    for _ in llm.generate(tokens, temp=0.0, reset=True):
        produced += 1
        end = time.perf_counter()
        if produced == 1:
            first = end
        if produced >= new_tokens:
            break
    return {"ttft_s": first - started, "decode_s": end - first, "new_tokens": produced}


if __name__ == "__main__":
    sys.exit(main())
