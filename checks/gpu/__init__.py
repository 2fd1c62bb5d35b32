"""``make gpu-check``: the engine on a CUDA GPU (:mod:`checks.gpu.run`, docs/gpu-check.md)."""
