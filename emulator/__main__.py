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
from typing import BinaryIO

import orjson
import uvloop

from emulator.engine import Engine, EngineConfig, Request, resolve_long_prefill_threshold
from emulator.faults import Faults
from emulator.kv import HASH_ALGOS
from emulator.kv_events import KVEventsConfig
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
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="as vLLM: fcfs (default; request priority ignored) or priority (lower first)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="as vLLM: report usage.prompt_tokens_details.cached_tokens (off by default)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='as vLLM: allow tool_choice "auto" (needs --tool-call-parser)',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        help="as vLLM: the tool-call format, e.g. llama3_json (the emulator writes that one)",
    )
    parser.add_argument(
        "--kv-events-config",
        type=KVEventsConfig.from_json,
        help='as vLLM: JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "topic": "kv"}\' (off by default)',
    )
    parser.add_argument(
        "--scheduler-reserve-full-isl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as vLLM 0.33 (on by default): admit a waiting request only if its whole "
        "sequence fits in free KV blocks; --no-scheduler-reserve-full-isl admits it once its "
        "first chunk fits",
    )
    parser.add_argument(
        "--admit-on-first-chunk",
        action="store_false",
        dest="scheduler_reserve_full_isl",
        help="emulator-only alias of --no-scheduler-reserve-full-isl: the gate of vLLM "
        "releases before the full-sequence admission gate (v0.11.x and earlier)",
    )
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
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="emulator",
        help="as vLLM (sha256, sha256_cbor), or the emulator's own chain hash (default); "
        "vLLM's schemes seed the first block's parent from PYTHONHASHSEED, as vLLM does",
    )
    parser.add_argument(
        "--tenant-cache-share",
        type=float,
        default=0.0,
        help="emulator-only (no vLLM equivalent): the most of the prefix cache one cache "
        "salt may keep before reusing its own cached blocks; 0 = off",
    )
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
    parser.add_argument(
        "--request-log",
        help="emulator-only (no vLLM equivalent): append one JSON line per finished request "
        "(id, priority, prompt and output tokens, model-time arrival, first scheduling, first "
        "token, finish, preemptions) to this file; for benchmarks' diagnostics",
    )
    return parser


def log_finished(engine: Engine, out: BinaryIO) -> None:
    """Write ``request_record`` of every request ``engine`` finishes to ``out``."""

    def write(req: Request) -> None:
        out.write(request_record(req))

    engine.on_finish = write


def request_record(req: Request) -> bytes:
    """One ``--request-log`` line: a finished request's model-time milestones."""
    return (
        orjson.dumps(
            {
                "request_id": req.request_id,
                "priority": req.priority,
                "prompt": req.prompt_len,
                "output": req.num_output,
                "cached": req.num_cached_tokens,
                "arrival": req.arrival_time,
                "scheduled": req.first_scheduled_time,
                "first_token": req.first_token_time,
                "finish": req.finish_time,
                "preemptions": req.num_preemptions,
                "reason": req.finish_reason,
            }
        )
        + b"\n"
    )


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
        reserve_full_prompt=args.scheduler_reserve_full_isl,
        tenant_cache_share=args.tenant_cache_share,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        prefix_hash_seed=os.environ.get("PYTHONHASHSEED"),
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
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_events=args.kv_events_config,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        # read as vLLM reads it (vllm/envs.py): an int, default 1
        int_block_hashes=bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1"))),
    )
    log_file = None
    if args.request_log:
        # once, before serving; closed after the service stops
        log_file = open(args.request_log, "ab")  # noqa: ASYNC230, SIM115
        log_finished(service.engine, log_file)
    await service.start()
    print(f"EMULATOR_READY {service.base_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    if log_file is not None:
        log_file.close()


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
