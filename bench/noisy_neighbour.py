"""Scenario 1 — noisy neighbour: one tenant floods 128k-token prompts; does anyone else notice?

Real processes over loopback: emulated 70B replicas (``python -m emulator``), real gateway
processes (``python -m gateway``) reading a read model seeded straight into Redis, and an
open-loop SSE load generator. Four arms replay the same seeded requests:

- ``quiet``: no noisy tenant, Fairway on — the reference;
- ``a``: no protection — clients straight to the replicas, round robin;
- ``b``: a gateway with requests/min limits only (tokens/min and KV·seconds limits set out
  of reach, no class ceilings, no reserved pool) — what most gateways offer;
- ``c``: Fairway with everything on;
- ``fcfs``: arm ``c`` on replicas started without ``--scheduling-policy priority`` (vLLM's
  default ``fcfs``): an operator who forgot the flag. The gateway still sends each class as
  the request's priority; the replicas ignore it.

Scaling (argued in bench/README.md): the replica is the realistic 70B profile with its token
*coarse-grained* by ``k`` — one emulated token stands for ``k`` real tokens: the KV bytes of a
token ×k, the realised bandwidth ÷k, the matmul FLOPs per token ×k and the attention FLOPs
per (token, context token) pair ×k², the context ÷k. Bytes of KV, the
seconds a step takes, the KV a request holds and how long it holds it are all unchanged, so
occupancy dynamics, the prefill:decode ratio, "a 128k prompt is 23 % of a replica" and
per-token TPOT hold, while the SSE chunk rate the 2-core machine must carry drops k-fold.
Reported latencies are converted back to real tokens and model time.

``python -m bench.noisy_neighbour`` writes bench/results/noisy_neighbour.md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench import cluster
from bench.loadgen import (
    SDK_MAX_RETRIES,
    LoadGenerator,
    RawResult,
    Router,
    Target,
    round_robin,
    to_outcome,
)
from bench.stats import GroupStats, Outcome, group_by
from bench.workload import (
    DESIGN_OUTPUT,
    DESIGN_PROMPT,
    NOISY_PROMPT_TOKENS,
    Fixed,
    LogNormal,
    PromptFactory,
    RequestSpec,
    TenantSpec,
    Workload,
    build_workload,
)
from contracts import schema
from emulator.profiles import (
    LLAMA_70B_TP4_H100,
    Profile,
    prefill_attention_share,
    threshold_prefill_rate,
)

RESULTS = Path(__file__).parent / "results"
FAMILY = "llama-70b"
ARMS = ("quiet", "a", "b", "c", "fcfs")
ARM_TITLES = {
    "quiet": "quiet baseline (no noisy tenant, Fairway on)",
    "a": "(a) no protection: straight to replicas, round robin",
    "b": "(b) requests/min limits only",
    "c": "(c) Fairway, everything on",
    "fcfs": "(c) on fcfs replicas (no --scheduling-policy priority)",
    "c0": "(c0) Fairway without long-context isolation",
    "cache": "(c) with cache-aware routing (GATEWAY_ADMISSION_STRATEGY=cache_aware)",
    "quiet2": "the quiet baseline again (its ratio to the first: the run-to-run noise floor)",
}
# "c0": Fairway before long-context isolation (no long-context budget, P2C placement blind
# to long contexts, a request's own KV not counted against the ceiling) — the comparison
# arm of the several-flooding-tenants runs (bench/nn_multi.py).
# "cache": arm c with cache-aware routing (bench/prefix_routing.py compares it with c).
# "quiet2": the quiet workload run a second time, compared with the first like any arm: what
# the ratios of a run without any flooding tenant look like (bench/nn_multi.py).
EXTRA_ARMS = ("c0", "cache", "quiet2")
QUIET_ARMS = ("quiet", "quiet2")  # arms that run the workload without its flooding tenants


# -- scaling ------------------------------------------------------------------------------


def coarse_profile(base: Profile, k: int, chunk_tokens: int) -> Profile:
    """``base`` with one emulated token standing for ``k`` real tokens (see module doc)."""
    if k < 1:
        raise ValueError("k >= 1")
    return dataclasses.replace(
        base,
        name=f"{base.name}-x{k}",
        kv_bytes_per_token=base.kv_bytes_per_token * k,
        bandwidth_efficiency=base.bandwidth_efficiency / k,
        # A chunk of n emulated tokens is n*k real ones at k times the context: matmul FLOPs
        # grow k-fold per token, attention (tokens x context) k^2-fold.
        flops_per_token=base.flops_per_token * k,
        attn_flops_per_token_ctx=base.attn_flops_per_token_ctx * k * k,
        max_model_len=base.max_model_len // k,
        # Paging granularity stays 16 real tokens per block where k divides 16.
        block_size=max(1, base.block_size // k),
        # One emulated step stands for k real steps, each with a budget of chunk_tokens real
        # tokens: k x chunk_tokens real = chunk_tokens emulated tokens.
        max_num_batched_tokens=chunk_tokens,
        tpot_target_ms=base.tpot_target_ms * k,
    )


def to_coarse(n_real: int, k: int) -> int:
    return max(1, math.ceil(n_real / k))


# -- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """Real-token limits of a plan (scaled to emulated tokens when written to Redis)."""

    rpm: int
    tpm: int
    max_context: int
    max_output: int
    kv_seconds_cap: int  # GiB·s: invariant under the token scaling
    reserved_kv: int = 0


@dataclass(frozen=True, slots=True)
class NNConfig:
    k: int = 8
    speed: float = 3.0
    chunk_tokens: int = 1024  # chunked-prefill budget per step, real tokens (docs/design.md §7)
    # Replica setting, same in every arm: vLLM's --long-prefill-token-threshold, real tokens
    # per step like chunk_tokens (so the same number per emulated step); 0 = no cap. 655 is
    # 64 % of the step budget: the share vLLM's automatic threshold (4 % of max_model_len =
    # 5,242) takes of its H100 default budget (8,192). 4 % literally would exceed our budget.
    long_prefill_tokens: int = 655
    shared_replicas: int = 4
    reserved_replicas: int = 1
    duration_s: float = 150.0  # model seconds of arrivals per arm
    warmup_s: float = 40.0  # requests sent before this are not counted
    drain_s: float = 40.0  # model seconds after the last arrival before cutting off
    gateway_workers: int = 2
    seed: int = 7
    standard_tenants: int = 4
    standard_rps: float = 3.5  # each
    enterprise_rps: float = 2.0
    free_rps: float = 1.0
    noisy_rps: float = 0.4  # each noisy tenant
    noisy_tenants: int = 1  # standard tenants flooding 128k prompts at once, each in its limits
    # Every tenant's client retries a refusal as the openai Python SDK does, with its default
    # of 2 retries (bench/loadgen.py: sdk_retry_delay): what real clients do, so a 503 with a
    # short retry-after costs the user a wait, not the request. 0: each request sent once
    # (the runs before this option).
    client_retries: int = SDK_MAX_RETRIES
    # The gateways of arm c hold a long-context refusal up to this many wall seconds instead
    # of answering 503 (GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S, gateway/admission/hold.py);
    # 0, the default: the gateway's own default, no hold.
    long_context_hold_s: float = 0.0
    # Diagnostics (``--trace-dir``): per arm, each replica's finished requests (the emulator's
    # ``--request-log``), the gateway's usage events (request, tenant, replica, TTFT) and the
    # load generator's outcomes, under ``<trace_dir>/s<seed>-n<noisy>-<arm>/``.
    trace_dir: str = ""
    # Plan limits follow one written rule (bench/README.md), fixed before any run: twice
    # the p99 need of a tenant sending the plan's nominal traffic with the docs/design.md §2 shape
    # (standard 3.5 req/s, enterprise 2, free 1; tokens/min and in-flight KV·seconds at the
    # 50 ms target TPOT), rounded; enterprise's reserved floor is that 2x p99 in-flight need.
    plans: dict[str, PlanLimits] = field(
        default_factory=lambda: {
            "free": PlanLimits(rpm=160, tpm=320_000, max_context=8_192, max_output=1_024,
                               kv_seconds_cap=1_000),
            "standard": PlanLimits(rpm=500, tpm=1_200_000, max_context=131_072,
                                   max_output=4_096, kv_seconds_cap=6_000),
            "enterprise": PlanLimits(rpm=300, tpm=700_000, max_context=131_072,
                                     max_output=4_096, kv_seconds_cap=8_000,
                                     reserved_kv=4_000),
        }
    )  # fmt: skip

    @property
    def replicas(self) -> int:
        return self.shared_replicas + self.reserved_replicas

    @classmethod
    def smoke(cls) -> NNConfig:
        """Tiny and fast, for tests: same shape, seconds not minutes."""
        return cls(
            speed=6.0,
            shared_replicas=1,
            reserved_replicas=1,
            duration_s=12.0,
            warmup_s=2.0,
            drain_s=12.0,
            standard_tenants=1,
            standard_rps=1.0,
            enterprise_rps=0.5,
            free_rps=0.5,
            noisy_rps=0.1,
        )


def tenants(cfg: NNConfig) -> list[TenantSpec]:
    # Free keys have an 8k context (docs/design.md §4): prompt + output must fit it.
    free_prompt = LogNormal(DESIGN_PROMPT.mu, DESIGN_PROMPT.sigma, lo=16, hi=7_000)
    free_out = LogNormal(DESIGN_OUTPUT.mu, DESIGN_OUTPUT.sigma, lo=1, hi=1_024)
    out = [
        TenantSpec(f"std-{i + 1}", f"Standard {i + 1}", "standard", "standard", cfg.standard_rps)
        for i in range(cfg.standard_tenants)
    ]
    out.append(TenantSpec("ent", "Enterprise", "enterprise", "reserved", cfg.enterprise_rps))
    out.append(TenantSpec("free", "Free", "free", "best_effort", cfg.free_rps,
                          prompt=free_prompt, output=free_out))  # fmt: skip
    # The 128k prompt plus its output must fit the 131,072-token context.
    for i in range(cfg.noisy_tenants):
        tid = "noisy" if cfg.noisy_tenants == 1 else f"noisy-{i + 1}"
        out.append(TenantSpec(tid, f"Noisy {i + 1} (standard)", "standard", "standard",
                              cfg.noisy_rps, prompt=Fixed(NOISY_PROMPT_TOKENS),
                              output=LogNormal(DESIGN_OUTPUT.mu, DESIGN_OUTPUT.sigma, 1, 3_000),
                              noisy=True))  # fmt: skip
    return out


def _limit_record(p: PlanLimits, k: int) -> schema.LimitRecord:
    """Token counts in emulated tokens (÷k); GiB·s are unchanged by the scaling."""
    return schema.LimitRecord(
        rpm=p.rpm,
        tpm=max(1, p.tpm // k),
        max_context=to_coarse(p.max_context, k),
        max_output=to_coarse(p.max_output, k),
        kv_seconds_cap=p.kv_seconds_cap,
        reserved_kv=p.reserved_kv,
    )


def tenant_seeds(cfg: NNConfig, specs: Sequence[TenantSpec], arm: str) -> list[cluster.TenantSeed]:
    rpm_only = arm == "b"
    seeds = []
    for t in specs:
        cls = t.admission_class
        if rpm_only:
            cls = "standard"  # no classes in a requests/min-only gateway
        rec = schema.TenantRecord(
            tenant_id=t.tenant_id, name=t.name, plan=t.plan, admission_class=cls,  # type: ignore[arg-type]
            suspended=False,
            limits={FAMILY: _limit_record(cfg.plans[t.plan], cfg.k)},
        )  # fmt: skip
        seeds.append(cluster.TenantSeed(rec, cluster.api_key_for(t.tenant_id)))
    return seeds


def catalog(cfg: NNConfig, profile: Profile, replicas: Sequence[cluster.Replica], version: str,
            arm: str) -> schema.Catalog:  # fmt: skip
    recs = tuple(
        schema.ReplicaRecord(r.replica_id, r.base_url, "shared" if arm == "b" else r.pool)
        for r in replicas
    )
    rate = threshold_prefill_rate(profile, TTFT_TARGET_S)
    mv = schema.ModelVersionRecord(
        version=version, family=FAMILY, context_length=profile.max_model_len,
        kv_bytes_per_token=profile.kv_bytes_per_token, tpot_target_ms=profile.tpot_target_ms,
        kv_capacity_tokens=profile.kv_capacity_tokens, replicas=recs,
        # what the control plane pushes from the replica profile; in wall time, as the
        # gateway sees the emulators run at ``speed``
        prefill_tokens_per_s=rate * cfg.speed,
        ttft_target_ms=max(1, round(TTFT_TARGET_S * 1000 / cfg.speed)),
        prefill_attention_share=prefill_attention_share(profile, TTFT_TARGET_S),
    )  # fmt: skip
    return schema.Catalog(families={FAMILY: version}, versions={version: mv})


TTFT_TARGET_S = 1.0  # the design's TTFT SLO


# Gateway knobs per arm: GATEWAY_ADMISSION_* (gateway.admission.config.AdmissionConfig.from_env).
def gateway_env(arm: str, k: int = 8, long_context_hold_s: float = 0.0) -> dict[str, str]:
    if arm == "c" and long_context_hold_s > 0:
        return {"GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S": f"{long_context_hold_s:g}"}
    if arm == "c0":
        return {
            "GATEWAY_ADMISSION_LAYERS": "requests,tokens,kv_seconds,capacity,retry_budget",
            "GATEWAY_ADMISSION_CONTEXT_PLACEMENT": "0",
            "GATEWAY_ADMISSION_COUNT_REQUEST_KV": "0",
        }
    if arm == "b":
        # Requests/min only: no tokens/min or KV·seconds layer, no class ceilings (all 1.0),
        # occupancy-blind round robin — what most gateways offer.
        return {
            "GATEWAY_ADMISSION_LAYERS": "requests",
            "GATEWAY_ADMISSION_STANDARD_MAX_OCCUPANCY": "1.0",
            "GATEWAY_ADMISSION_BEST_EFFORT_MAX_OCCUPANCY": "1.0",
            "GATEWAY_ADMISSION_RESERVED_MAX_OCCUPANCY": "1.0",
            "GATEWAY_ADMISSION_STRATEGY": "round_robin",
            "GATEWAY_ADMISSION_OPTIMISTIC_INFLIGHT": "0",
        }
    if arm == "cache":
        # the coarse profile's block is 16 real tokens = 16 / k emulated ones
        return {
            "GATEWAY_ADMISSION_STRATEGY": "cache_aware",
            "GATEWAY_PREFIX_BLOCK_SIZE": str(max(1, 16 // k)),
        }
    return {}


def hold_note(cfg: NNConfig) -> str:
    """The reports' sentence on arm c's long-context hold ("" when off)."""
    if cfg.long_context_hold_s <= 0:
        return ""
    return (
        f" Arm c's gateways hold a long-context refusal up to {cfg.long_context_hold_s:g} "
        "wall seconds before answering 503 (GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S)."
    )


# -- running an arm -------------------------------------------------------------------------


@dataclass(slots=True)
class ArmResult:
    arm: str
    outcomes: list[Outcome]
    traces: dict[str, cluster.ReplicaTrace]
    preemptions: float
    wall_s: float
    measured_s: float
    chunks_per_s: float = 0.0  # SSE content chunks the load generator read, per wall second
    cpu_cores: float = 0.0  # CPU seconds of the whole arm per wall second


def _coarse_spec(spec: RequestSpec, k: int) -> RequestSpec:
    return dataclasses.replace(
        spec,
        prompt_tokens=to_coarse(spec.prompt_tokens, k),
        max_tokens=to_coarse(spec.max_tokens, k),
    )


def _real_outcome(raw: RawResult, cls: str, cfg: NNConfig, real: RequestSpec) -> Outcome:
    """Emulated tokens and model time -> real tokens and model time.

    TPOT per real token is the emulated inter-token time / k. The first emulated token
    stands for k real ones: the real first token would have come (k-1) real token-times
    earlier, so TTFT is corrected by (k-1) x this request's real TPOT.
    """
    o = to_outcome(raw, cls, cfg.speed)
    if o.error and raw.t_first is not None and raw.cut_at is not None:
        o.error = None  # still streaming at the cut-off: judged on what it delivered so far
    if o.tpot_s is not None:
        o.tpot_s /= cfg.k
        if o.ttft_s is not None:
            o.ttft_s = max(0.0, o.ttft_s - (cfg.k - 1) * o.tpot_s)
    o.completion_tokens = min(real.max_tokens, o.completion_tokens * cfg.k)
    o.prompt_tokens = real.prompt_tokens
    return o


async def _drive(
    cfg: NNConfig, wl: Workload, route: Router, model: str, replicas: Sequence[cluster.Replica],
    label: str,
) -> tuple[list[RawResult], dict[str, cluster.ReplicaTrace]]:  # fmt: skip
    from tqdm import tqdm

    prompts = PromptFactory(seed=cfg.seed)
    gen = LoadGenerator(model, route, prompts, speed=cfg.speed, max_inflight=4000,
                        read_timeout_s=300.0, client_retries=cfg.client_retries,
                        retry_seed=cfg.seed)  # fmt: skip
    specs = [_coarse_spec(r, cfg.k) for r in wl.requests]
    scraper = cluster.MetricsScraper(replicas, cfg.speed)
    bar = tqdm(total=len(specs), desc=f"noisy_neighbour {label}", unit="req", file=sys.stderr,
               leave=False, mininterval=2.0)  # fmt: skip
    scraper.start()
    try:
        raws = await gen.run(specs, deadline_s=(cfg.duration_s + cfg.drain_s) / cfg.speed,
                             on_done=lambda _r: bar.update(1))  # fmt: skip
    finally:
        await scraper.stop()
        bar.close()
    return raws, scraper.traces


def run_arm(
    arm: str, cfg: NNConfig, wl: Workload, profile: Profile, profile_file: Path,
    redis_url: str, workdir: Path,
) -> ArmResult:  # fmt: skip
    started = time.perf_counter()
    cpu_before = _cpu_seconds()
    version = f"{FAMILY}-bench"
    trace = (
        Path(cfg.trace_dir) / f"s{cfg.seed}-n{cfg.noisy_tenants}-{arm}" if cfg.trace_dir else None
    )
    if trace is not None:
        shutil.rmtree(trace, ignore_errors=True)
        trace.mkdir(parents=True)
    shared: list[schema.Pool] = ["shared"] * cfg.shared_replicas
    reserved: list[schema.Pool] = ["reserved"] * cfg.reserved_replicas
    pools = shared + reserved
    replicas = cluster.start_replicas(
        profile,
        profile_file,
        version,
        pools,
        speed=cfg.speed,
        seed=cfg.seed,
        extra={"long_prefill_token_threshold": cfg.long_prefill_tokens},
        # The operator who forgot the flag: vLLM's default fcfs, priorities ignored.
        omit_platform_flags=("--scheduling-policy",) if arm == "fcfs" else (),
        request_log_dir=trace,
    )
    gw: cluster.Gateway | None = None
    try:
        specs = wl.tenants
        classes = {t.tenant_id: t.admission_class for t in specs}
        if arm == "a":
            route = round_robin([r.base_url for r in replicas])
            model = version
        else:
            client = redis.Redis.from_url(redis_url)
            try:
                client.flushdb()
                seeds = tenant_seeds(cfg, specs, arm)
                cluster.seed_read_model(
                    client, seeds, catalog(cfg, profile, replicas, version, arm)
                )
            finally:
                client.close()
            gw = cluster.start_gateway(
                redis_url,
                cfg.gateway_workers,
                gateway_env(arm, cfg.k, cfg.long_context_hold_s),
                workdir,
            )
            url = gw.base_url + "/v1/chat/completions"
            targets = {
                s.tenant_id: Target(url, {"Authorization": f"Bearer {s.secret}"}) for s in seeds
            }

            def route(spec: RequestSpec) -> Target:
                return targets[spec.tenant_id]

            model = FAMILY
        drive_started = time.perf_counter()
        raws, traces = asyncio.run(_drive(cfg, wl, route, model, replicas, arm))
        drive_s = time.perf_counter() - drive_started
    finally:
        if gw is not None:
            gw.stop()
            if trace is not None:
                _keep_spool(gw, workdir, trace)
        cluster.stop_replicas(replicas)
    # CPU of everything the arm ran (replicas, gateway, load generator) once they are reaped.
    cpu = _cpu_seconds() - cpu_before
    by_id = {r.request_id: r for r in wl.requests}
    outcomes = [
        _real_outcome(raw, classes[raw.spec.tenant_id], cfg, by_id[raw.spec.request_id])
        for raw in raws
        if raw.spec.at_s >= cfg.warmup_s
    ]
    if trace is not None:
        with (trace / "outcomes.jsonl").open("w") as f:
            for o in outcomes:
                f.write(json.dumps(dataclasses.asdict(o)) + "\n")
    return ArmResult(
        arm=arm, outcomes=outcomes, traces=traces,
        preemptions=sum(t.preemptions for t in traces.values()),
        wall_s=time.perf_counter() - started, measured_s=cfg.duration_s - cfg.warmup_s,
        chunks_per_s=sum(r.chunks for r in raws) / max(drive_s, 1e-9),
        cpu_cores=cpu / max(time.perf_counter() - started, 1e-9),
    )  # fmt: skip


def _keep_spool(gw: cluster.Gateway, workdir: Path, trace: Path) -> None:
    """Copy the gateway's usage spool (one event per admitted request: its replica, its
    TTFT as the gateway saw it) into ``trace`` before the workdir goes."""
    port = gw.base_url.rsplit(":", 1)[1]
    spool = workdir / f"spool-{port}"
    if spool.is_dir():
        shutil.copytree(spool, trace / "spool", dirs_exist_ok=True)


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# -- report ---------------------------------------------------------------------------------


def _group_name(specs: Sequence[TenantSpec]) -> Callable[[Outcome], str]:
    noisy = {t.tenant_id for t in specs if t.noisy}
    return lambda o: "noisy" if o.tenant_id in noisy else o.admission_class


def summarise(
    res: ArmResult, specs: Sequence[TenantSpec]
) -> tuple[dict[str, GroupStats], dict[str, GroupStats]]:  # noqa: E501
    by_tenant = {
        tid: GroupStats.of(tid, outs, res.measured_s)
        for tid, outs in sorted(group_by(res.outcomes, lambda o: o.tenant_id).items())
    }
    by_class = {
        c: GroupStats.of(c, outs, res.measured_s)
        for c, outs in sorted(group_by(res.outcomes, _group_name(specs)).items())
    }
    return by_tenant, by_class


def main(argv: list[str] | None = None) -> int:
    from bench.nn_report import write_report

    ap = argparse.ArgumentParser(prog="python -m bench.noisy_neighbour", description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--load-scale",
        type=float,
        default=1.0,
        help="multiply the request rate of every tenant but the noisy one (the flood stays)",
    )
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="chunked-prefill budget per step in real tokens (the long-prefill threshold "
        "keeps its 64 %% share of it)",
    )
    ap.add_argument(
        "--noisy-tenants",
        default="1",
        help="how many standard tenants flood 128k prompts at once (each at the noisy rate, "
        "inside its own plan limits); a comma list (e.g. 1,2,4) runs bench/nn_multi.py's "
        "comparison for each, with --seeds",
    )
    ap.add_argument("--seeds", default=None, help="comma list of seeds for the multi runs")
    ap.add_argument(
        "--duration",
        type=float,
        default=None,
        help="model seconds of arrivals per arm (default 150; the first 40 are not counted): "
        "longer runs let the flooders' served counts resolve a 2x fairness check",
    )
    ap.add_argument(
        "--speed",
        type=float,
        default=None,
        help="model seconds per wall second of the replicas (default 3); lower halves what "
        "a loaded machine's stalls add to the model-time latencies, at twice the wall time",
    )
    ap.add_argument(
        "--design-load",
        action="store_true",
        help="the fixed tenant rates sized when the emulator used the design's flat prefill "
        "rate (an overload of the realistic replicas) instead of rates derived from the "
        "replica profile at the design's utilisation (bench/nn_capacity.py)",
    )
    ap.add_argument(
        "--client-retries",
        type=int,
        default=None,
        help="retries each client makes after a 429/503 (or a connection failure), with the "
        f"openai Python SDK's delays; default {SDK_MAX_RETRIES}, the SDK's default; 0 sends "
        "every request once, as runs before this option did",
    )
    ap.add_argument(
        "--long-context-hold",
        type=float,
        default=None,
        metavar="S",
        help="arm c's gateways hold a long-context refusal up to S wall seconds, asking the "
        "budget again after each told wait, instead of answering 503 "
        "(GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S); default 0, off",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--trace-dir",
        default="",
        help="keep per-request diagnostics of every arm here: each replica's finished "
        "requests, the gateway's usage events, the load generator's outcomes "
        "(bench/nn_trace.py reads them)",
    )
    args = ap.parse_args(argv)
    cfg = NNConfig.smoke() if args.smoke else NNConfig()
    if args.trace_dir:
        cfg = dataclasses.replace(cfg, trace_dir=str(Path(args.trace_dir).resolve()))
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    if args.speed is not None:
        cfg = dataclasses.replace(cfg, speed=args.speed)
    if args.duration is not None:
        cfg = dataclasses.replace(cfg, duration_s=args.duration)
    if args.client_retries is not None:
        if args.client_retries < 0:
            ap.error("--client-retries must be >= 0")
        cfg = dataclasses.replace(cfg, client_retries=args.client_retries)
    if args.long_context_hold is not None:
        if args.long_context_hold < 0:
            ap.error("--long-context-hold must be >= 0")
        cfg = dataclasses.replace(cfg, long_context_hold_s=args.long_context_hold)
    if args.chunk_tokens is not None:
        share = cfg.long_prefill_tokens / cfg.chunk_tokens
        cfg = dataclasses.replace(
            cfg,
            chunk_tokens=args.chunk_tokens,
            long_prefill_tokens=round(args.chunk_tokens * share),
        )
    load_note = ""
    if not (args.smoke or args.design_load):
        from bench.nn_capacity import derived_load

        load = derived_load(
            coarse_profile(LLAMA_70B_TP4_H100, cfg.k, cfg.chunk_tokens),
            k=cfg.k,
            long_prefill_tokens=cfg.long_prefill_tokens,
            shared_replicas=cfg.shared_replicas,
            reserved_replicas=cfg.reserved_replicas,
            standard_tenants=cfg.standard_tenants,
        )
        cfg = dataclasses.replace(
            cfg,
            standard_rps=load.standard_rps,
            free_rps=load.free_rps,
            enterprise_rps=load.enterprise_rps,
        )
        load_note = load.describe()
        print(f"[noisy_neighbour] {load_note}", flush=True)
    if args.load_scale != 1.0:
        f = args.load_scale
        cfg = dataclasses.replace(
            cfg,
            standard_rps=cfg.standard_rps * f,
            enterprise_rps=cfg.enterprise_rps * f,
            free_rps=cfg.free_rps * f,
        )
    counts = [int(x) for x in str(args.noisy_tenants).split(",") if x]
    if len(counts) > 1 or args.seeds:
        from bench.nn_multi import run_multi

        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [cfg.seed]
        arms_multi = [a for a in args.arms.split(",") if a] if args.arms != ",".join(ARMS) else None
        command = " ".join(
            ["python -m bench.noisy_neighbour", *(sys.argv[1:] if argv is None else argv)]
        )
        run_multi(cfg, counts, seeds, args.out, command, arms=arms_multi, load_note=load_note)
        return 0
    cfg = dataclasses.replace(cfg, noisy_tenants=counts[0])
    arms = [a for a in args.arms.split(",") if a]
    command = " ".join(
        ["python -m bench.noisy_neighbour", *(sys.argv[1:] if argv is None else argv)]
    )
    run(cfg, arms, args.out, command, write_report)
    return 0


def run(cfg: NNConfig, arms: Sequence[str], out: Path, command: str,
        report: Callable[..., Path]) -> dict[str, ArmResult]:  # fmt: skip
    unknown = set(arms) - set(ARMS) - set(EXTRA_ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {ARMS + EXTRA_ARMS}")
    specs = tenants(cfg)
    wl = build_workload(specs, cfg.duration_s, cfg.seed)
    profile = coarse_profile(LLAMA_70B_TP4_H100, cfg.k, cfg.chunk_tokens)
    workdir = cluster.workdir()
    profile_file = cluster.write_profile_file([profile], workdir)
    print(f"[noisy_neighbour] {cfg}", flush=True)
    print(f"[noisy_neighbour] replica profile {profile}", flush=True)
    results: dict[str, ArmResult] = {}
    try:
        with cluster.bench_redis() as redis_url:
            print(f"[noisy_neighbour] redis {redis_url}; {len(wl.requests)} requests per arm",
                  flush=True)  # fmt: skip
            for arm in arms:
                arm_wl = wl.without_noisy() if arm in QUIET_ARMS else wl
                res = run_arm(arm, cfg, arm_wl, profile, profile_file, redis_url, workdir)
                results[arm] = res
                print(f"[noisy_neighbour] arm {arm}: {len(res.outcomes)} measured requests, "
                      f"{res.wall_s:.0f} s wall", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    path = report(results, cfg, specs, profile, out, command)
    print(f"[noisy_neighbour] wrote {path}", flush=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
