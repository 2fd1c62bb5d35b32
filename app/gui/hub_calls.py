"""The model picker's Hub page (widgets/hub_page.py) on engine/store/hub.py: the verdicts for
the device and precision the app targets now."""

from __future__ import annotations

from collections.abc import Callable

from widgets.hub_page import HubCalls, Progress, RepoView

#: the precisions a repo's verdict lists (the chosen one first)
PRECISIONS = ("fp32", "bf16", "int8+head", "int4-g32+head")


def hub_calls(target: Callable[[], tuple[str, str]]) -> HubCalls:
    """``target()``: the precision and device chosen now, which the verdicts are for."""

    def inspect(repo_id: str) -> RepoView:
        from app.loading import resolve_device
        from engine.errors import ModelPullError
        from engine.store import hub

        repo = hub.repo(repo_id)
        files = [(f.path, f.size) for f in repo.weights]
        precision, device = target()
        precisions = [precision, *(p for p in PRECISIONS if p != precision)]
        try:
            config = hub.config(repo_id)
        except ModelPullError:
            if not repo.gated:
                raise
            return RepoView(repo_id, files, [], True)  # its config too needs the token
        verdicts = hub.verdicts(config, precisions, resolve_device(device))
        return RepoView(repo_id, files, [(v.precision, v.text, v.fits) for v in verdicts],
                        repo.gated)  # fmt: skip

    def search(query: str) -> list[str]:
        from engine.store import hub

        return hub.search(query)

    def pull(repo_id: str, weights: str | None, progress: Progress) -> str:
        from engine.store import hub

        return str(hub.pull(repo_id, weights=weights, progress=progress))

    def save_token(value: str) -> None:
        from engine.store import hub

        hub.save_token(value or None)

    return HubCalls(search, inspect, pull, save_token)
