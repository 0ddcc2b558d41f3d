"""``python -m emulator``: serve one emulated vLLM replica.

Example::

    python -m emulator --profile llama-70b-tp4-h100 --model llama-70b-2026-05 --port 9101 --speed 10

Once listening it prints ``EMULATOR_READY <base_url>`` on stdout (``--port 0`` picks a free
port; ``emulator.testing.spawn_emulator`` reads that line). SIGTERM/SIGINT abort in-flight
requests and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import uvloop

from emulator.engine import EngineConfig, resolve_long_prefill_threshold
from emulator.faults import Faults
from emulator.profiles import BUILTIN_PROFILES, Profile, get_profile, load_profiles
from emulator.service import EmulatorService

CRASH_EXIT_CODE = 70


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m emulator", description="vLLM-compatible replica emulator"
    )
    parser.add_argument(
        "--profile",
        default="llama-70b-tp4-h100",
        help=f"hardware/model profile ({', '.join(sorted(BUILTIN_PROFILES))})",
    )
    parser.add_argument("--profile-file", help="JSON list of extra profiles")
    parser.add_argument("--model", help="served model name (default: the profile name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="model clock runs this many times faster than wall time",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scheduling-policy", choices=("priority", "fcfs"), default="priority")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="override the profile's KV budget (scaled-down benches)",
    )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        help="most prompt tokens one request may compute per step (0: no cap; default as "
        "vLLM: 0, or 4%% of max-model-len when --max-num-partial-prefills > 1)",
    )
    parser.add_argument("--max-num-partial-prefills", type=int, default=1)
    parser.add_argument("--max-long-partial-prefills", type=int, default=1)
    parser.add_argument("--fail-after-tokens", type=int)
    parser.add_argument("--crash-after-tokens", type=int)
    parser.add_argument("--refuse-503", action="store_true")
    parser.add_argument("--extra-latency-ms", type=int, default=0)
    parser.add_argument("--log-level", default="warning")
    return parser


def resolve_profile(name: str, profile_file: str | None) -> Profile:
    if profile_file:
        extra = load_profiles(profile_file)
        if name in extra:
            return extra[name]
    return get_profile(name)


async def serve(args: argparse.Namespace) -> None:
    profile = resolve_profile(args.profile, args.profile_file)
    config = EngineConfig(
        scheduling_policy=args.scheduling_policy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_capacity_tokens=args.kv_capacity_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
    )
    faults = Faults(
        fail_after_tokens=args.fail_after_tokens,
        crash_after_tokens=args.crash_after_tokens,
        refuse_503=args.refuse_503,
        extra_latency_ms=args.extra_latency_ms,
    )
    service = EmulatorService(
        profile,
        args.model or profile.name,
        speed=args.speed,
        config=config,
        seed=args.seed,
        faults=faults,
        host=args.host,
        port=args.port,
        on_crash=lambda: os._exit(CRASH_EXIT_CODE),
        log_level=args.log_level,
    )
    await service.start()
    print(f"EMULATOR_READY {service.base_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        resolve_profile(args.profile, args.profile_file)
        if args.speed <= 0:
            raise ValueError("--speed must be positive")
        resolve_long_prefill_threshold(
            EngineConfig(
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_num_partial_prefills=args.max_num_partial_prefills,
                max_long_partial_prefills=args.max_long_partial_prefills,
            ),
            1,
        )
    except (KeyError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
