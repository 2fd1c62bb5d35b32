"""A keyring that keeps its passwords in memory, for the tests of what the OS keyring keeps
(the Hub's token, endpoints' API keys): a test installs it with ``keyring.set_keyring``."""

from __future__ import annotations

from keyring.backend import KeyringBackend


class MemoryKeyring(KeyringBackend):
    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.kept.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.kept[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        from keyring.errors import PasswordDeleteError

        if self.kept.pop((service, username), None) is None:
            raise PasswordDeleteError("none")
