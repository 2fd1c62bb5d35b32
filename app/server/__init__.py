"""The OpenAI-compatible HTTP server (no Qt): routes, the engine loop and its metrics."""
