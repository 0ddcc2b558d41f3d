"""How one replica of a model version is started: the command line, from the catalog.

Compose, Kubernetes and an operator by hand all take a replica's command from here (through
``manage.py replica_command`` or the files ``manage.py deploy_files`` writes), so the flags
the platform depends on are written once:

- ``--served-model-name <version>``: the gateway routes by the pinned version name;
- ``--max-model-len <context_length>``: the context the catalog sells, no more;
- ``--enable-prefix-caching``: the tenant-salted prefix cache is part of the design;
- chunked prefill with ``--long-prefill-token-threshold`` (4 % of the context): a 128k
  prompt is prefilled in slices between other requests' decode steps instead of stalling
  them for seconds;
- the platform flags of ``contracts.replica_flags`` (priority scheduling: the gateway sends
  each class as the request's ``priority``; prompt-token details: cached tokens are billed
  at the cached price);
- ``--enable-auto-tool-choice --tool-call-parser <parser>`` where the version has one.

The emulator gets the same arguments where it has them (it speaks vLLM's API), plus its
profile and its KV budget from the catalog.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from contracts.replica_flags import platform_replica_args

Engine = Literal["vllm", "emulator"]
ENGINES: tuple[Engine, ...] = ("vllm", "emulator")
REPLICA_PORT = 8000
# vLLM's default KV-cache event endpoint port (``KVEventsConfig.endpoint``).
KV_EVENTS_PORT = 5557
LONG_PREFILL_FRACTION = 0.04
# What a vLLM replica's prefix cache and the gateways' cache-aware index must agree on (the
# deploy files set both sides from these): tokens per KV block (vLLM's default on CUDA,
# ``CacheConfig.DEFAULT_BLOCK_SIZE``, set explicitly so that a backend's own choice cannot
# move it) and the block hash scheme (vLLM's default, ``contracts.blockhash``'s ``sha256``).
KV_BLOCK_SIZE = 16
PREFIX_HASH_ALGO = "sha256"


@dataclass(frozen=True, slots=True)
class ServingSpec:
    """The catalog fields a replica's command depends on."""

    version: str
    context_length: int
    kv_capacity_tokens: int
    weights: str
    tensor_parallel_size: int
    tool_call_parser: str
    emulator_profile: str

    @classmethod
    def of(cls, version: Any) -> ServingSpec:
        """From a ``catalog.ModelVersion`` (or anything with the same attributes)."""
        name = getattr(version, "name", None) or version.version
        return cls(
            version=name,
            context_length=int(version.context_length),
            kv_capacity_tokens=int(version.kv_capacity_tokens),
            weights=version.weights,
            tensor_parallel_size=int(version.tensor_parallel_size),
            tool_call_parser=version.tool_call_parser,
            emulator_profile=version.emulator_profile,
        )


class NotServable(ValueError):
    """The catalog lacks what this engine needs to serve the version."""


def long_prefill_threshold(context_length: int) -> int:
    return max(1, int(context_length * LONG_PREFILL_FRACTION))


def platform_args() -> list[str]:
    """The flags every platform replica gets, whatever its engine (one list for ``make up``,
    the benchmarks and production: ``contracts.replica_flags``)."""
    return platform_replica_args()


def replica_argv(
    spec: ServingSpec, *, engine: Engine, host: str = "0.0.0.0", port: int = REPLICA_PORT
) -> list[str]:
    threshold = str(long_prefill_threshold(spec.context_length))
    # tool_choice "auto" needs both flags (vLLM and the emulator refuse it otherwise).
    tool_args = (
        ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
        if spec.tool_call_parser
        else []
    )
    if engine == "vllm":
        if not spec.weights:
            raise NotServable(f"{spec.version}: the catalog names no weights for vLLM")
        argv = [
            "vllm",
            "serve",
            spec.weights,
            "--served-model-name",
            spec.version,
            "--host",
            host,
            "--port",
            str(port),
            "--tensor-parallel-size",
            str(spec.tensor_parallel_size),
            "--max-model-len",
            str(spec.context_length),
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--long-prefill-token-threshold",
            threshold,
            *platform_args(),
        ]
        return argv + tool_args
    if engine == "emulator":
        if not spec.emulator_profile:
            raise NotServable(f"{spec.version}: the catalog names no emulator profile")
        return [
            "python",
            "-m",
            "emulator",
            "--profile",
            spec.emulator_profile,
            "--model",
            spec.version,
            "--host",
            host,
            "--port",
            str(port),
            "--max-model-len",
            str(spec.context_length),
            "--kv-capacity-tokens",
            str(spec.kv_capacity_tokens),
            "--long-prefill-token-threshold",
            threshold,
            *platform_args(),
            *tool_args,
        ]
    raise ValueError(f"unknown engine {engine!r}; one of {ENGINES}")


def replica_name(version: str, base_url: str) -> str:
    """The catalog's name of a replica, which the read model carries as its ``replica_id``
    (what a gateway's ``GATEWAY_PREFIX_KV_EVENTS`` keys a replica's event endpoint by)."""
    return f"{version}@{urlsplit(base_url).netloc}"


def kv_events_args(port: int = KV_EVENTS_PORT) -> list[str]:
    """vLLM's ``--kv-events-config``: publish the replica's KV-cache events (blocks stored,
    evicted, cleared) over ZMQ on ``port``, for the gateways' cache-aware index. The emulator
    takes the same flag."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def prefix_cache_args() -> list[str]:
    """vLLM's block size and prefix-cache hash scheme, explicit (``KV_BLOCK_SIZE``,
    ``PREFIX_HASH_ALGO``): the gateway's ``GATEWAY_PREFIX_BLOCK_SIZE`` and
    ``GATEWAY_PREFIX_HASH`` must name the same."""
    return [
        "--block-size",
        str(KV_BLOCK_SIZE),
        "--prefix-caching-hash-algo",
        PREFIX_HASH_ALGO,
    ]


def shell(argv: list[str]) -> str:
    return shlex.join(argv)
