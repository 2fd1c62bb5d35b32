"""Where a token's step happens: ``engine.py`` (the request API and live settings), ``step.py``
(one step: schedule → draft → forward → sample/verify → commit → events), ``runner.py`` (the
model call), ``output.py`` (events, stop strings, logprobs), ``config.py``, the scheduler,
sequences, sampling, the metrics records and instruments, and ``recovery.py`` (going on after
a step runs out of memory)."""
