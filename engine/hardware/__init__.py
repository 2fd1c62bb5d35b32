"""What this machine can do, measured once: CPU paths and probes, threads, free memory, NVML,
kept measurements."""
