"""Our Triton kernels, one module per kind, each importing Triton at its top: import them only
where :func:`engine.kernels.triton_support.installed` says Triton is here. Each module has
``configs()``, the configurations it launches, which ``python -m engine.kernels.triton_aot``
builds for every target architecture."""
