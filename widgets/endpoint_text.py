"""A server named in a text field, as the lab's sides and the tuner's target take it:
``http://host:8000`` or ``http://host:8000/v1 model-id`` (the model id after a space; none:
the first the server lists)."""

from __future__ import annotations

PLACEHOLDER = "http://host:8000 [model-id]"


def parse_endpoint(text: str) -> tuple[str, str] | None:
    """The URL and model id ``text`` names (None: it names no server)."""
    url, _, model = text.strip().partition(" ")
    return (url, model.strip()) if url.startswith(("http://", "https://")) else None
