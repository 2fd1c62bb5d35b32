"""Our kernels, each beside the portable torch path that is its fallback and reference: the
paged attention kernels on a CPU (C, built on the user's machine: ``paged_decode``), the GEMV
and low-bit GEMMs (``gemv``, ``lowbit``, ``amx``), the layers' norms and RoPE in C
(``layer_ops``), oneDNN-packed linears (``packed_linear``), the C decode step's ABI
(``decode_step``), our Triton kernels (``triton_kernels``) with their support, checks and
ahead-of-time build (``triton_support``, ``triton_check``, ``triton_aot``), and the native
build and call machinery (``native``). Which attention runs is :mod:`engine.attention`'s;
how a decode step runs, :mod:`engine.executor`'s."""
