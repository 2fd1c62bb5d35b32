"""Speed: infersight bench and tune, the load generator, the profiler, the llama.cpp peer."""
