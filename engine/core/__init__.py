"""Where a token's step happens: the engine's request API, the scheduler, sequences,
sampling and the metrics records."""
