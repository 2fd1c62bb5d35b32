"""Endpoints' API keys in the OS keyring (``keyring``), one per base URL: never in a settings
file. ``INFERSIGHT_ENDPOINT_KEY`` overrides them all (CI, a headless ``tune --endpoint``)."""

from __future__ import annotations

import contextlib
import os

#: the keyring service the keys are kept under (the user name: the endpoint's base URL)
SERVICE = "infersight-endpoint"
ENV = "INFERSIGHT_ENDPOINT_KEY"


def key(base_url: str) -> str | None:
    """The key for ``base_url``: ``INFERSIGHT_ENDPOINT_KEY``, else the keyring's (None: none
    kept, or no keyring on this machine)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    import keyring
    from keyring.errors import KeyringError

    try:
        return keyring.get_password(SERVICE, _user(base_url))
    except KeyringError:
        return None


def save_key(base_url: str, value: str | None) -> None:
    """Keep ``value`` for ``base_url`` in the keyring (None or "": forget it)."""
    import keyring
    from keyring.errors import KeyringError, PasswordDeleteError

    from engine.errors import InvalidRequestError

    try:
        if value:
            keyring.set_password(SERVICE, _user(base_url), value)
        else:
            with contextlib.suppress(PasswordDeleteError):  # none was kept
                keyring.delete_password(SERVICE, _user(base_url))
    except KeyringError as exc:
        raise InvalidRequestError(
            f"this machine has no keyring to keep the key in ({exc}); set {ENV} instead"
        ) from exc


def _user(base_url: str) -> str:
    """One entry per server (:func:`app.endpoints.client.server_url`)."""
    from app.endpoints.client import server_url

    return server_url(base_url)
