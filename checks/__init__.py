"""Device checks: what only real hardware can show (``make gpu-check``), run on a lent machine
with its own Python, outside the test suite (``tests/`` runs their CPU dry runs)."""
