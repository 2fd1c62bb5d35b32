"""Our Triton kernels, one module per kind, each importing Triton at its top: import them only
where :func:`engine.kernels.triton_support.installed` says Triton is here. Each module has
``configs()``, the configurations it launches, which ``python -m engine.kernels.triton_aot``
builds for every target architecture."""

from engine.kernels import triton_support

if triton_support.interpreting():
    triton_support.fix_interpreter_bf16_dot()  # the interpreter's bf16 tl.dot, as a GPU's
    triton_support.fix_interpreter_scalar_index()  # scalar loop bounds under NumPy 2.4
