"""How Fairway runs its vLLM replicas (a contract between the control plane, which prints
the replica command, and the replicas): the flags the platform depends on, in one place.

vLLM's defaults are not what the platform needs, and an operator who starts a replica
without these flags gets a replica that silently behaves differently:

* ``--scheduling-policy priority``: the gateway sends each plan's class as the request's
  ``priority``; under vLLM's default ``fcfs`` the replica ignores it, so a reserved or
  standard request queues behind best-effort ones.
* ``--enable-prompt-tokens-details``: without it vLLM leaves
  ``usage.prompt_tokens_details.cached_tokens`` out, and the gateway bills every prompt
  token at the uncached price.

``make up`` (``fairway.devstack``), the benchmarks and the tests that stand in for platform
replicas all start them from here, so a change of flags happens once.
"""

from __future__ import annotations

from collections.abc import Iterable

# flag -> its value (None for a switch); the same settings as EngineConfig fields below.
PLATFORM_REPLICA_FLAGS: dict[str, str | None] = {
    "--scheduling-policy": "priority",
    "--enable-prompt-tokens-details": None,
}


def platform_replica_args(*, omit: Iterable[str] = ()) -> list[str]:
    """Command-line flags for a platform replica (``python -m emulator`` or ``vllm serve``).

    ``omit`` drops flags by name, to model an operator who forgot one (the benchmarks'
    fcfs arm)."""
    skip = set(omit)
    unknown = skip - set(PLATFORM_REPLICA_FLAGS)
    if unknown:
        raise ValueError(f"not platform flags: {sorted(unknown)}")
    args: list[str] = []
    for flag, value in PLATFORM_REPLICA_FLAGS.items():
        if flag in skip:
            continue
        args.append(flag)
        if value is not None:
            args.append(value)
    return args
