"""Replica choice within a model version's fleet (R5): power of two random choices scored
by last scraped KV occupancy plus this gateway's optimistic in-flight KV.

The scrape is ~250 ms stale; in that window a busy gateway makes dozens of decisions, and
"pick the emptiest" sends all of them to the same replica (C5's herd). Two changes, both
needed: choose the less loaded of two random eligible replicas, and add to each replica's
scraped occupancy the KV this router has dispatched to it that the scrape cannot show yet.

When can a scrape show it? Not at the first scrape after dispatch: with chunked prefill a
replica allocates a prompt's KV chunk by chunk (and a request may wait in its queue first),
so a 128k prompt is invisible for seconds while it holds the replica's whole prefill budget.
So an entry counts until a scrape taken after the request's *first token* (its prefill is then
complete and fully allocated; ``inflight_grace_s`` later, to be safe), or its finish, whichever
comes first. The relay reports first tokens with ``on_first_token``; a request whose first
token is never reported (a non-streamed response) counts until it finishes — conservative.
Before its first token an entry may overlap the chunks already allocated (bounded by its
prompt, for its prefill's duration): the charge doubles as the replica's outstanding prefill
work seen from this process, which is what keeps P2C off a replica chewing on a long prompt.
The record is soft state, per process, never persisted or shared.

The decisions themselves are the pure functions of ``gateway.policy`` (class ceilings,
reserved pool, P2C); ``bench/herd.py`` drives this same class in virtual time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gateway import schema
from gateway.policy import AdmissionConfig, EffectiveClass, ReplicaView, route
from gateway.replicas import ReplicaState


class ReplicaSource(Protocol):
    """What the router reads of ``gateway.replicas.ReplicaRegistry`` (and the herd
    simulation provides in virtual time)."""

    def states(self, version: str) -> Sequence[ReplicaState]: ...
    def state(self, replica_id: str) -> ReplicaState | None: ...


class Router:
    def __init__(
        self,
        registry: ReplicaSource,
        rng: random.Random | None = None,
        *,
        config: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._rng = rng or random.Random()
        self._cfg = config or AdmissionConfig()
        self._clock = clock
        # replica_id -> {request_id: kv_bytes}: dispatched, no first token reported yet
        self._prefilling: dict[str, dict[str, int]] = {}
        # replica_id -> {request_id: (first_token_at, kv_bytes)}, in first-token order:
        # prefilled, but maybe not yet in a scrape
        self._settling: dict[str, dict[str, tuple[float, int]]] = {}
        self._turn = 0

    @property
    def config(self) -> AdmissionConfig:
        return self._cfg

    def optimistic_bytes(self, replica_id: str, scraped_at: float) -> int:
        """KV dispatched to the replica that its last scrape cannot have seen (all of yet)."""
        total = 0
        prefilling = self._prefilling.get(replica_id)
        if prefilling:
            total = sum(prefilling.values())
        entries = self._settling.get(replica_id)
        if entries:
            cutoff = scraped_at - self._cfg.inflight_grace_s
            while entries:  # first-token order: drop the prefix the scrape accounts for
                rid, (at, _) = next(iter(entries.items()))
                if at > cutoff:
                    break
                del entries[rid]
            total += sum(b for _, b in entries.values())
        return total

    def views(self, version: schema.ModelVersionRecord) -> list[ReplicaView]:
        capacity = version.kv_capacity_tokens * version.kv_bytes_per_token
        out = []
        for s in self._registry.states(version.version):
            if not s.healthy or s.scraped_at <= 0:
                continue
            out.append(
                ReplicaView(
                    s.replica_id,
                    s.record.pool,
                    s.kv_usage,
                    self.optimistic_bytes(s.replica_id, s.scraped_at),
                    capacity,
                )
            )
        return out

    def choose(
        self, version: schema.ModelVersionRecord, admission_class: str, est_kv_bytes: int
    ) -> schema.ReplicaRecord | None:
        """A replica of ``version`` that may take a request of the (effective) class, or None
        when none may (the caller answers 503). ``est_kv_bytes`` is recorded by
        ``on_dispatch``, not here: a choice is not yet a dispatch."""
        cls: EffectiveClass = admission_class  # type: ignore[assignment]
        pick = route(self.views(version), cls, self._cfg, self._rng, turn=self._turn)
        self._turn += 1
        if pick is None:
            return None
        state = self._registry.state(pick.replica_id)
        return state.record if state is not None else None

    def on_dispatch(
        self, replica: schema.ReplicaRecord, request_id: str, est_kv_bytes: int
    ) -> None:
        """Called once the request is sent to ``replica``: count it until a scrape after its
        first token (or its finish)."""
        self._prefilling.setdefault(replica.replica_id, {})[request_id] = max(0, est_kv_bytes)

    def on_first_token(self, replica: schema.ReplicaRecord, request_id: str) -> None:
        """Called when the request's first token arrives (its prefill is done): from here it
        counts only until the replica's next scrape. Unknown or repeated calls are no-ops."""
        prefilling = self._prefilling.get(replica.replica_id)
        if prefilling is None:
            return
        kv_bytes = prefilling.pop(request_id, None)
        if kv_bytes is not None:
            self._settling.setdefault(replica.replica_id, {})[request_id] = (
                self._clock(),
                kv_bytes,
            )

    def on_finish(self, replica: schema.ReplicaRecord, request_id: str) -> None:
        """Called exactly once per dispatched request, whatever its ending: a request that
        ended before the next scrape no longer holds KV the scrape would have shown."""
        replica_id = replica.replica_id
        prefilling = self._prefilling.get(replica_id)
        if prefilling is not None and prefilling.pop(request_id, None) is not None:
            return
        settling = self._settling.get(replica_id)
        if settling is not None:
            settling.pop(request_id, None)
