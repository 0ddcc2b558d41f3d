"""Replica choice within a model version's fleet.

FIRST VERSION: uniformly random among healthy replicas the class may enter. Issue 5
replaces the internals with power-of-two choices scored by scraped occupancy plus this
gateway's optimistic in-flight KV (R5); ``on_dispatch`` / ``on_finish`` are the hooks that
bookkeeping needs, already called by ``AdmissionController.admit`` / ``settle``.
"""

from __future__ import annotations

import random

from gateway import schema
from gateway.replicas import ReplicaRegistry


class Router:
    def __init__(self, registry: ReplicaRegistry, rng: random.Random | None = None) -> None:
        self._registry = registry
        self._rng = rng or random.Random()

    def choose(self, version: schema.ModelVersionRecord, admission_class: str,
               est_kv_bytes: int) -> schema.ReplicaRecord | None:
        """A healthy replica of ``version`` for a request of ``admission_class``, or None.

        Replicas in the ``reserved`` pool take only reserved-class traffic (R2).
        """
        candidates = [s.record for s in self._registry.healthy(version.version)
                      if s.record.pool != "reserved" or admission_class == "reserved"]
        if not candidates:
            return None
        return self._rng.choice(candidates)

    def on_dispatch(self, replica: schema.ReplicaRecord, request_id: str,
                    est_kv_bytes: int) -> None:
        """Called once the request is sent to ``replica``."""

    def on_finish(self, replica: schema.ReplicaRecord, request_id: str) -> None:
        """Called exactly once per dispatched request, whatever its ending."""
