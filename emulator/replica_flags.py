"""The platform's replica flags (``contracts/replica_flags.py``) as an in-process engine's
settings, for the discrete-event simulations."""

from __future__ import annotations

from typing import Any

from contracts.replica_flags import PLATFORM_REPLICA_FLAGS
from emulator.engine import EngineConfig


def platform_engine_config(**overrides: Any) -> EngineConfig:
    """The same settings for an in-process ``Engine`` (discrete-event simulations)."""
    settings: dict[str, Any] = {"scheduling_policy": PLATFORM_REPLICA_FLAGS["--scheduling-policy"]}
    settings.update(overrides)
    return EngineConfig(**settings)
