"""Our kernels, each beside the portable torch path that is its fallback and reference: the
paged attention kernels on a CPU (C, built on the user's machine: ``paged_decode``), the GEMV
and low-bit GEMMs (``gemv``, ``lowbit``, ``amx``), the layers' norms and RoPE in C
(``layer_ops``), oneDNN-packed linears (``packed_linear``), the C decode step's ABI
(``decode_step``), our Triton kernels (``triton_kernels``) with their support, checks and
ahead-of-time build (``triton_support``, ``triton_check``, ``triton_aot``), the one harness
every load-time check compares through, with its tolerance policy (``verify``), and the native
build and call machinery (``native``). The formats the quantized kernels read are
:mod:`engine.formats`'s; the "measured faster" verdicts that pick them,
:mod:`engine.hardware.verdicts`'s. Which attention runs is :mod:`engine.attention`'s;
how a decode step runs, :mod:`engine.executor`'s."""
