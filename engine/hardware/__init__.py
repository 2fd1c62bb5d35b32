"""What this machine can do, measured once: CPU paths and probes, threads, NVML, kept
measurements."""
