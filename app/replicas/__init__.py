"""Replicas of ``infersight serve`` on Ray Serve (``serve --ray``): see docs/replicas.md."""
