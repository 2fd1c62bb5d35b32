"""How a step runs: the decode-step executors and the one table that says which may run.

* :mod:`~engine.executor.table`: the executors in their one precedence order (CUDA graphs,
  the compiled step, the C step, eager), the attention backends, and which pairs are refused
  and why; the load, the load report, the tests and ``make gpu-check`` all read it;
* :mod:`~engine.executor.step`: :class:`~engine.executor.step.StepExecutor`, which runs each
  step on the first executor that applies, counts what ran and records every fallback (the
  paths report, :meth:`engine.core.engine.LLMEngine.paths`);
* the executors: :mod:`~engine.executor.cuda_graphs` (static buffers, a graph per batch
  bucket), :mod:`~engine.executor.inductor` (TorchInductor), :mod:`~engine.executor.c_step`
  (the layers in one C call); eager is the model's own forward.
"""
