"""Checks and benchmarks run outside the test suite, one module per check:

* the device checks (``checks/gpu``, ``make gpu-check``): what only real hardware can show,
  run on a lent machine with its own Python (``tests/`` runs their CPU dry runs);
* third-party clients against ``serve``: GuideLLM (``bench_serving``, ``make bench-serving``),
  lm-evaluation-harness (``eval_serving``, ``make eval-serving``), on one launcher
  (``serve_process``); our own users' load (``serve_throughput``);
* measurements of one engine choice: a load's memory peak against its plan (``load_peak``,
  ``make load-peak``), the paged prefill kernel against the portable path
  (``prefill_attention``), our CPU low-bit kernels' KL against torch's (``lowbit_kl``).
"""
