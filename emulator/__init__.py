"""vLLM-compatible replica emulator: the engine model (``emulator.engine``), profiles,
tokenizer, HTTP server (``python -m emulator``) and test helpers (``emulator.testing``).

Importing the package or ``emulator.engine`` pulls in no server dependencies, so discrete-event
simulations can use ``Engine`` cheaply.
"""

from emulator.engine import Engine, EngineConfig, Request, StepResult
from emulator.profiles import BUILTIN_PROFILES, Profile, get_profile

__all__ = [
    "BUILTIN_PROFILES",
    "Engine",
    "EngineConfig",
    "Profile",
    "Request",
    "StepResult",
    "get_profile",
]
