"""Checks and benchmarks run outside the test suite: the device checks, what only real
hardware can show (``make gpu-check``, run on a lent machine with its own Python; ``tests/``
runs their CPU dry runs), and third-party load generators against ``serve``
(``make bench-serving``: GuideLLM)."""
