"""Which engine replica a request goes to: the one whose prefix cache most likely holds its
prompt's beginning, unless that one is busier than the rest; else the less busy of two
chosen at random (power of two choices, Ray Serve's own default).

The router (:class:`PrefixRouter`) is Ray Serve's request-router hook on the engine
deployment; it runs where the front deployment calls the replicas. It remembers, for each
prompt chunk key it has routed (:func:`app.replicas.forwarding.prefix_keys`), the replica
it went to: a later prompt whose first ``k`` keys match went to a replica that has those
chunks' KV blocks cached, if its cache still holds them. The policy itself
(:func:`preferred`) is plain Python, tested without Ray.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

#: a replica whose queue is longer than the shortest by more than this is not preferred
#: for its cached prefix: the cache saves a prefill, a queue costs whole replies
SLACK = 2
#: prefix keys remembered, least recently routed dropped first (64 characters each: about
#: 6 MiB of prompts)
MAX_KEYS = 100_000


R = TypeVar("R", bound=Hashable)


def preferred(
    prefix: Sequence[str],
    candidates: Sequence[R],
    owners: Mapping[str, R],
    queue: Callable[[R], int | None],
    slack: int = SLACK,
) -> tuple[R | None, int]:
    """The candidate last sent the longest of ``prefix``'s leading keys that was ever sent
    (each key names its whole prefix, so that candidate was sent all the shorter ones
    too), and how many keys that is. ``(None, 0)`` where no candidate was, or where the one
    that was has a queue more than ``slack`` longer than the shortest known (``queue``: a
    replica's queue length, None where unknown)."""
    live = set(candidates)
    best: R | None = None
    matched = 0
    for i, key in enumerate(prefix):
        owner = owners.get(key)
        if owner is None or owner not in live:
            break
        best, matched = owner, i + 1
    if best is None:
        return None, 0
    known = [q for q in (queue(c) for c in candidates) if q is not None]
    mine = queue(best)
    if known and mine is not None and mine > min(known) + slack:
        return None, 0
    return best, matched


def _prefix(pending: PendingRequest | None) -> tuple[str, ...]:
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "prefix", ()) or ())


class PrefixRouter(RequestRouter):
    """Ray Serve's request router for the engine replicas (``request_router_config``)."""

    def initialize_state(self, slack: int = SLACK, max_keys: int = MAX_KEYS, **_: Any) -> None:
        self.slack, self.max_keys = slack, max_keys
        self.owners: OrderedDict[str, ReplicaID] = OrderedDict()
        self.routed = self.prefix_routed = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        queue: Callable[[Any], int | None] = self.replica_queue_len_cache.get
        best, _ = preferred(_prefix(pending_request), list(by_id), self.owners, queue, self.slack)
        rest = [r for r in candidate_replicas if r.replica_id != best]
        two = random.sample(rest, min(2, len(rest)))  # the base class takes the less busy
        return [[by_id[best]], two] if best is not None else [two]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        prefix = _prefix(pending_request)
        self.routed += 1
        if prefix and self.owners.get(prefix[0]) == replica_id:
            self.prefix_routed += 1
        for key in prefix:
            self.owners[key] = replica_id
            self.owners.move_to_end(key)
        while len(self.owners) > self.max_keys:
            self.owners.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self.owners.items() if owner == replica_id]:
            del self.owners[key]
