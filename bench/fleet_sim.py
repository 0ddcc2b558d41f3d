"""Scenario 4: fleet-scale discrete-event simulation of the 70B fleet at the design's scale.

Drives the gateway's own admission and routing code (``gateway.router.Router`` over
``gateway.policy``: class ceilings, P2C / pick-emptiest / round robin, optimistic
in-flight; R6 jitter and the retry budget — imported, not copied) against 44 of the
emulator's own ``Engine`` (70B profile: continuous batching, paged KV, preemption) stepped
in virtual time, at 333 req/s with the §2 token shape. Several gateways each keep their
own optimistic in-flight view, as in production; all of them see replica occupancy only
through a scrape every 250 ms.
Simplified: no network or gateway CPU time, prefix caching off (the prompts are unique),
clients retry as described per experiment.

``python -m bench.fleet_sim`` writes bench/results/fleet_sim.md and fleet_sim_*.png.
"""

from __future__ import annotations

import heapq
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.cliff import CliffPoint, run_engine
from bench.stats import TPOT_SLO_S, TTFT_SLO_S
from bench.workload import DESIGN_OUTPUT, DESIGN_PROMPT
from emulator.engine import Engine, EngineConfig
from emulator.profiles import Profile, get_profile
from gateway import schema
from gateway.policy import (
    VLLM_PRIORITY,
    AdmissionConfig,
    Strategy,
    capacity_retry_after_ms,
    in_retry_storm,
    sheds_retry,
    storm_retry_after_ms,
)
from gateway.replicas import ReplicaState
from gateway.router import Router

RESULTS = Path(__file__).parent / "results"
PROFILE = "llama-70b-tp4-h100"
SIM_VERSION = "llama-70b-sim"

# Event kinds, ordered so that at equal times steps finish before new arrivals are routed.
_STEP, _SCRAPE, _KILL, _ARRIVE = range(4)


@dataclass(slots=True)
class SimRequest:
    """One client request as the simulator tracks it (times in model seconds)."""

    rid: int
    tenant_class: str
    prompt: int
    output: int
    arrival: float  # first attempt's arrival at the gateway
    priority: int = 1
    attempt: int = 0
    sent: float = 0.0  # this attempt's dispatch time
    first_token: float | None = None
    finished: float | None = None
    status: str = "pending"  # pending | ok | rejected | error
    replica: int = -1
    gateway: int = -1
    final: bool = False  # completed, or the client gave up
    ended: float = 0.0  # when it became final


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int = 44
    rate_rps: float = 333.0
    duration_s: float = 150.0
    warmup_s: float = 60.0  # statistics skip the fill-up of an empty fleet
    gateways: int = 4
    scrape_s: float = 0.25
    scrape_failures_unhealthy: int = 3
    strategy: Strategy = "p2c"
    optimistic: bool = True
    class_mix: tuple[float, float, float] = (0.10, 0.80, 0.10)  # reserved, standard, free
    seed: int = 1
    # C6: kill these replicas at kill_at_s; r6 = jittered retry-after + retry budget.
    kill_at_s: float | None = None
    kill_count: int = 1
    r6: bool = True
    max_attempts: int = 4
    unjittered_retry_after_s: float = 5.0
    sample_s: float = 1.0
    # §2's arithmetic taken literally: every request is the median (800 in, 300 out).
    literal: bool = False

    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(strategy=self.strategy, optimistic_inflight=self.optimistic)


@dataclass(slots=True)
class Series:
    t: list[float] = field(default_factory=list)
    occ_max: list[float] = field(default_factory=list)
    occ_mean: list[float] = field(default_factory=list)
    occ_all: list[np.ndarray] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)  # first attempts + retries offered
    retries: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    rejected_first: list[int] = field(default_factory=list)  # 503s to first attempts
    errors: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SimResult:
    cfg: FleetConfig
    requests: list[SimRequest]
    series: Series
    tokens_out: np.ndarray  # per replica, over the measured window
    preemptions: int
    wall_s: float
    attempts: int = 0
    gave_up: int = 0

    def measured(self) -> list[SimRequest]:
        """Requests that arrived after the fill-up and resolved before the end of the run
        (still streaming at the end: censored, not counted either way)."""
        lo = self.cfg.warmup_s
        return [r for r in self.requests if r.arrival >= lo and r.final]

    def ttfts(self, reqs: list[SimRequest] | None = None) -> list[float]:
        rs = self.measured() if reqs is None else reqs
        return [r.first_token - r.sent for r in rs if r.first_token is not None]

    def tpots(self, reqs: list[SimRequest] | None = None) -> list[float]:
        rs = self.measured() if reqs is None else reqs
        return [
            (r.finished - r.first_token) / (r.output - 1)
            for r in rs
            if r.finished is not None and r.first_token is not None and r.output > 1
        ]

    def attainment(self, reqs: list[SimRequest] | None = None) -> float:
        rs = self.measured() if reqs is None else reqs
        if not rs:
            return math.nan
        ok = 0
        for r in rs:
            if r.status != "ok" or r.first_token is None or r.finished is None:
                continue
            tpot = (r.finished - r.first_token) / (r.output - 1) if r.output > 1 else 0.0
            if r.first_token - r.sent < TTFT_SLO_S and tpot < TPOT_SLO_S:
                ok += 1
        return ok / len(rs)


class _Gateway:
    """One gateway process: its own ``gateway.router.Router`` (P2C / emptiest / round robin
    over ``gateway.policy``, optimistic in-flight per dispatch) fed by its own scrapes."""

    def __init__(self, n: int, profile: Profile, cfg: AdmissionConfig, seed: int,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        records = [schema.ReplicaRecord(str(i), f"http://sim/{i}", "shared") for i in range(n)]
        self._states = [ReplicaState(record=rec, version=SIM_VERSION) for rec in records]
        self.records = records
        self.version = schema.ModelVersionRecord(
            version=SIM_VERSION, family="llama-70b", context_length=profile.max_model_len,
            kv_bytes_per_token=profile.kv_bytes_per_token, tpot_target_ms=profile.tpot_target_ms,
            kv_capacity_tokens=profile.kv_capacity_tokens, replicas=tuple(records),
        )  # fmt: skip
        self.rng = random.Random(seed)
        self.router = Router(self, self.rng, config=cfg, clock=clock)

    # ReplicaSource, as gateway.replicas.ReplicaRegistry provides it.
    def states(self, version: str) -> list[ReplicaState]:
        return self._states

    def state(self, replica_id: str) -> ReplicaState | None:
        return self._states[int(replica_id)]


class _Replica:
    """An ``Engine`` plus what the event loop needs to know about it."""

    def __init__(self, idx: int, profile: Profile, seed: int) -> None:
        self.idx = idx
        self.engine = Engine(profile, EngineConfig(enable_prefix_caching=False), seed=seed)
        self.alive = True
        self.stepping = False

    @property
    def occupancy(self) -> float:
        return self.engine.kv_usage()

    def kill(self) -> list[SimRequest]:
        """The replica dies: every stream on it ends in an error."""
        self.alive = False
        return [req.handle for req in self.engine.requests.values()]


class FleetSim:
    def __init__(self, cfg: FleetConfig, profile: Profile) -> None:
        self.cfg = cfg
        self.profile = profile
        self.kv_bytes = profile.kv_bytes_per_token
        self.adm = cfg.admission()
        self.replicas = [_Replica(i, profile, cfg.seed * 7919 + i) for i in range(cfg.replicas)]
        self.now = 0.0
        self.gws = [
            _Gateway(cfg.replicas, profile, self.adm, cfg.seed * 1000 + g, lambda: self.now)
            for g in range(cfg.gateways)
        ]
        self.rng = random.Random(cfg.seed)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.series = Series()
        self.requests: list[SimRequest] = []
        # R6's retry budget is one shared window (Redis in production): (time, is_retry).
        self.window: list[tuple[float, bool]] = []
        self.window_head = 0
        self.attempts = 0
        self.gave_up = 0
        self.tokens_at_warmup = np.zeros(cfg.replicas, dtype=np.int64)
        self._tick = {"arrivals": 0, "retries": 0, "rejected": 0, "rejected_first": 0, "errors": 0}

    # -- events ------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))  # type: ignore[arg-type]

    def _generate(self) -> None:
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed)
        n = int(cfg.rate_rps * cfg.duration_s * 1.2) + 100
        times = np.cumsum(rng.exponential(1.0 / cfg.rate_rps, size=n))
        times = times[times < cfg.duration_s]
        prompts = DESIGN_PROMPT.sample(rng, len(times))
        outputs = DESIGN_OUTPUT.sample(rng, len(times))
        if cfg.literal:
            prompts[:] = 800
            outputs[:] = 300
        classes = rng.choice(3, size=len(times), p=np.asarray(cfg.class_mix))
        names = ("reserved", "standard", "best_effort")
        for i, t in enumerate(times):
            cls = names[int(classes[i])]
            r = SimRequest(
                rid=i,
                tenant_class=cls,
                prompt=int(prompts[i]),
                output=int(outputs[i]),
                arrival=float(t),
                priority=VLLM_PRIORITY[cls],
            )
            self.requests.append(r)
            self.push(float(t), _ARRIVE, r)

    # -- the gateway's decision ----------------------------------------------------------

    def _retry_counts(self, now: float) -> tuple[int, int]:
        w, lo = self.window, now - self.adm.retry_budget_window_s
        while self.window_head < len(w) and w[self.window_head][0] < lo:
            self.window_head += 1
        live = w[self.window_head :]
        return len(live), sum(1 for _, r in live if r)

    def _reject(self, r: SimRequest, now: float, retry_after_s: float) -> None:
        self._tick["rejected"] += 1
        if r.attempt == 0:
            self._tick["rejected_first"] += 1
        self._client_retry(r, now + retry_after_s, status="rejected")

    def _client_retry(self, r: SimRequest, at: float, status: str) -> None:
        r.status = status
        if r.attempt + 1 >= self.cfg.max_attempts:
            self.gave_up += 1
            r.final = True
            r.ended = at
            return
        r.attempt += 1
        r.first_token = None
        r.finished = None
        self.push(at, _ARRIVE, r)

    def _arrive(self, r: SimRequest, now: float) -> None:
        cfg = self.cfg
        is_retry = r.attempt > 0
        self.attempts += 1
        self._tick["arrivals"] += 1
        if is_retry:
            self._tick["retries"] += 1
        g = self.rng.randrange(cfg.gateways)
        gw = self.gws[g]
        if cfg.r6:
            admitted, retries = self._retry_counts(now)
            storm = in_retry_storm(admitted, retries, self.adm)
            if sheds_retry(is_retry, r.tenant_class, storm):  # type: ignore[arg-type]
                self._reject(r, now, storm_retry_after_ms(self.adm, gw.rng) / 1000)
                return
        # The gateway's optimistic in-flight charge (gateway/admission.py): prompt + max output.
        est_bytes = (r.prompt + r.output) * self.kv_bytes
        record = gw.router.choose(gw.version, r.tenant_class, est_bytes)
        if record is None:
            if cfg.r6:
                wait = capacity_retry_after_ms(self.adm, gw.rng) / 1000
            else:
                wait = cfg.unjittered_retry_after_s
            self._reject(r, now, wait)
            return
        idx = int(record.replica_id)
        rep = self.replicas[idx]
        self.window.append((now, is_retry))
        if not rep.alive:
            # Connection refused until the scrape marks it unhealthy: the client retries
            # at once, as client libraries do on a transport error.
            self._tick["errors"] += 1
            self._client_retry(r, now, status="error")
            return
        gw.router.on_dispatch(record, f"{r.rid}.{r.attempt}", est_bytes)
        r.gateway = g
        r.sent = now
        r.status = "pending"
        r.replica = idx
        eng = rep.engine
        eng.advance_to(now)
        req = eng.add_request(
            f"{r.rid}.{r.attempt}",
            [4096 + r.rid % 100_000] * r.prompt,
            r.output,
            priority=r.priority,
            arrival_time=now,
            ignore_eos=True,
        )
        req.handle = r
        if not rep.stepping:
            rep.stepping = True
            self.push(now, _STEP, idx)

    # -- replicas ------------------------------------------------------------------------

    def _step(self, idx: int, now: float) -> None:
        rep = self.replicas[idx]
        if not rep.alive:
            rep.stepping = False
            return
        eng = rep.engine
        eng.advance_to(now)
        res = eng.step()
        if res.duration == 0.0:
            rep.stepping = False
            return
        end = res.end
        for req in res.emitted:
            if req.num_output == 1:
                req.handle.first_token = end
                gw = self.gws[req.handle.gateway]
                gw.router.on_first_token(gw.records[idx], req.request_id)
        for req in res.finished:
            r = req.handle
            gw = self.gws[r.gateway]
            gw.router.on_finish(gw.records[idx], req.request_id)
            r.finished = end
            r.status = "ok"
            r.final = True
            r.ended = end
        self.push(end, _STEP, idx)

    def _scrape(self, g: int, now: float) -> None:
        gw = self.gws[g]
        for rep, st in zip(self.replicas, gw._states, strict=True):
            if rep.alive:
                st.kv_usage = rep.occupancy
                st.running, st.waiting = rep.engine.num_running, rep.engine.num_waiting
                st.scraped_at, st.failures, st.healthy = now, 0, True
            else:
                st.failures += 1
                if st.failures >= self.cfg.scrape_failures_unhealthy:
                    st.healthy = False
        self.push(now + self.cfg.scrape_s, _SCRAPE, g)

    def _kill(self, now: float) -> None:
        alive = [r for r in self.replicas if r.alive]
        for rep in alive[: self.cfg.kill_count]:
            for r in rep.kill():
                # The stream ends with an in-stream error (the gateway's terminal handler
                # settles it); the client retries at once.
                gw = self.gws[r.gateway]
                gw.router.on_finish(gw.records[rep.idx], f"{r.rid}.{r.attempt}")
                self._tick["errors"] += 1
                self._client_retry(r, now, status="error")

    def _sample(self, now: float) -> None:
        s = self.series
        occ = np.array([r.occupancy if r.alive else np.nan for r in self.replicas])
        s.t.append(now)
        s.occ_all.append(occ)
        s.occ_max.append(float(np.nanmax(occ)))
        s.occ_mean.append(float(np.nanmean(occ)))
        s.running.append(sum(r.engine.num_running for r in self.replicas if r.alive))
        s.arrivals.append(self._tick["arrivals"])
        s.retries.append(self._tick["retries"])
        s.rejected.append(self._tick["rejected"])
        s.rejected_first.append(self._tick["rejected_first"])
        s.errors.append(self._tick["errors"])
        self._tick = dict.fromkeys(self._tick, 0)

    def _tokens(self) -> np.ndarray:
        return np.array([r.engine.stats.generation_tokens for r in self.replicas])

    # -- main loop ------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        cfg = self.cfg
        started = time.perf_counter()
        self._generate()
        for g in range(cfg.gateways):
            self.push(cfg.scrape_s * g / cfg.gateways, _SCRAPE, g)
        if cfg.kill_at_s is not None:
            self.push(cfg.kill_at_s, _KILL, None)
        next_sample = cfg.sample_s
        warm_done = False
        end = cfg.duration_s
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            if t > end:
                break
            self.now = t
            while t >= next_sample:
                self._sample(next_sample)
                if progress:
                    progress(next_sample)
                next_sample += cfg.sample_s
            if not warm_done and t >= cfg.warmup_s:
                warm_done = True
                self.tokens_at_warmup = self._tokens()
            if kind == _STEP:
                self._step(payload, t)  # type: ignore[arg-type]
            elif kind == _ARRIVE:
                self._arrive(payload, t)  # type: ignore[arg-type]
            elif kind == _SCRAPE:
                self._scrape(payload, t)  # type: ignore[arg-type]
            else:
                self._kill(t)
        return SimResult(
            cfg=cfg,
            requests=self.requests,
            series=self.series,
            tokens_out=self._tokens() - self.tokens_at_warmup,
            preemptions=sum(r.engine.stats.num_preemptions for r in self.replicas),
            wall_s=time.perf_counter() - started,
            attempts=self.attempts,
            gave_up=self.gave_up,
        )


def simulate(cfg: FleetConfig, profile: Profile | None = None, label: str = "") -> SimResult:
    from tqdm import tqdm

    bar = tqdm(
        total=int(cfg.duration_s),
        desc=f"fleet_sim {label or cfg.strategy}",
        unit="model-s",
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    last = [0]

    def tick(t: float) -> None:
        bar.update(int(t) - last[0])
        last[0] = int(t)

    res = FleetSim(cfg, profile or get_profile(PROFILE)).run(progress=tick)
    bar.close()
    return res


__all__ = ["FleetConfig", "FleetSim", "SimResult", "simulate", "replace"]


# -- experiments ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scale:
    """Durations of the experiments (``quick`` for smoke tests)."""

    duration_s: float = 100.0
    warmup_s: float = 40.0
    kill_at_s: float = 60.0
    replicas: int = 44
    rate_rps: float = 333.0
    gateways: int = 4
    cliff_duration_s: float = 240.0
    cliff_warmup_s: float = 80.0

    @classmethod
    def quick(cls) -> Scale:
        return cls(
            duration_s=16.0,
            warmup_s=6.0,
            kill_at_s=9.0,
            replicas=6,
            rate_rps=40.0,
            gateways=2,
            cliff_duration_s=30.0,
            cliff_warmup_s=10.0,
        )


def experiments(scale: Scale, seed: int = 1) -> dict[str, FleetConfig]:
    base = FleetConfig(
        replicas=scale.replicas,
        rate_rps=scale.rate_rps,
        duration_s=scale.duration_s,
        warmup_s=scale.warmup_s,
        gateways=scale.gateways,
        seed=seed,
    )
    return {
        "design-literal": replace(base, literal=True),
        "p2c+inflight": base,
        "emptiest (stale)": replace(base, strategy="emptiest", optimistic=False),
        "round robin": replace(base, strategy="round_robin", optimistic=False),
        "kill, no R6": replace(base, kill_at_s=scale.kill_at_s, r6=False),
        "kill, R6": replace(base, kill_at_s=scale.kill_at_s, r6=True),
        # The same failure with headroom: 90 % of the rate, no free tier (whose 0.60 ceiling
        # sheds by design), so that any 503 after the kill is the kill's.
        "kill at 90 % load, R6": replace(
            base, rate_rps=0.9 * scale.rate_rps, class_mix=(0.1, 0.9, 0.0),
            kill_at_s=scale.kill_at_s, r6=True,
        ),
    }  # fmt: skip


def _run_named(item: tuple[str, FleetConfig]) -> tuple[str, SimResult]:
    name, cfg = item
    return name, FleetSim(cfg, get_profile(PROFILE)).run()


def run_all(configs: dict[str, FleetConfig], workers: int = 2) -> dict[str, SimResult]:
    """Run the simulations, ``workers`` at a time, with one progress bar over them."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    out: dict[str, SimResult] = {}
    bar = tqdm(total=len(configs), desc="fleet_sim runs", unit="run", file=sys.stderr)
    if workers <= 1:
        for item in configs.items():
            name, res = _run_named(item)
            out[name] = res
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_run_named, item) for item in configs.items()]
            for fut in as_completed(futures):
                name, res = fut.result()
                out[name] = res
                bar.update(1)
    bar.close()
    return {name: out[name] for name in configs}


# -- report -----------------------------------------------------------------------------


def _ms(x: float) -> str:
    return "—" if math.isnan(x) else f"{x * 1000:.0f}"


def _pct(x: float, d: int = 1) -> str:
    return "—" if math.isnan(x) else f"{x * 100:.{d}f} %"


def _md_row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def _after(res: SimResult, t: float) -> list[SimRequest]:
    """Resolved requests that were in the system after ``t`` (ended after it)."""
    return [r for r in res.requests if r.final and r.ended > t]


def _series_window(res: SimResult, lo: float) -> np.ndarray:
    return np.asarray(res.series.t) >= lo


def sizing(profile: Profile, scale: Scale, seed: int = 1) -> tuple[float, list[CliffPoint]]:
    """Highest per-replica rate whose TTFT p95 < 1 s and TPOT p95 < 50 ms (bisection)."""
    lo, hi = 0.5, 12.0
    probes: list[CliffPoint] = []
    for _ in range(7):
        mid = (lo + hi) / 2
        pt = run_engine(profile, mid, scale.cliff_duration_s, scale.cliff_warmup_s, seed)
        probes.append(pt)
        if pt.tpot_p95 < TPOT_SLO_S and pt.ttft_p95 < TTFT_SLO_S:
            lo = mid
        else:
            hi = mid
    return lo, probes


def cliff_sweep(profile: Profile, scale: Scale, seed: int = 1) -> list[CliffPoint]:
    rates = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.5, 7.0, 7.5, 8.0, 9.0, 11.0)
    return [
        run_engine(profile, r, scale.cliff_duration_s, scale.cliff_warmup_s, seed) for r in rates
    ]


def write_report(
    results: dict[str, SimResult],
    cliff: list[CliffPoint],
    per_replica_rate: float,
    scale: Scale,
    command: str,
    out_dir: Path = RESULTS,
) -> Path:
    from bench.plots import Series as Line
    from bench.plots import lines

    out_dir.mkdir(parents=True, exist_ok=True)
    lines_md: list[str] = []
    w = lines_md.append
    w("# Scenario 4 — fleet-scale simulation\n")
    w(f"Command: `{command}`  ")
    w(
        f"{scale.replicas} emulator `Engine`s ({PROFILE}) stepped in virtual time, "
        f"{scale.rate_rps:g} req/s Poisson, §2 token shape (prompt p50 800 / p95 6,000, "
        f"output p50 300 / p95 1,200), classes 10 % reserved / 80 % standard / 10 % free, "
        f"{scale.gateways} gateways each with its own optimistic in-flight view, occupancy "
        f"scraped every 250 ms. Routing and admission are `gateway.policy` itself. "
        f"{scale.duration_s:g} model-s per run, statistics after {scale.warmup_s:g} s of "
        "fill-up. All times are model time.\n"
    )
    # §2 arithmetic.
    lit, heavy = results["design-literal"], results["p2c+inflight"]
    meas_s = scale.duration_s - scale.warmup_s
    w("## §2 fleet arithmetic\n")
    w(
        "| | design §2 | simulated: every request 800 in / 300 out | simulated: §2 heavy-tailed shape |"  # noqa: E501
    )
    w("|---|---|---|---|")
    mean_out = float(np.mean([r.output for r in heavy.requests]))
    w(f"| output tokens per request | 300 (the p50) | 300 | mean {mean_out:.0f} |")
    w(
        f"| decode demand at {scale.rate_rps:g} req/s | {scale.rate_rps * 300:,.0f} tok/s | "
        f"{scale.rate_rps * 300:,.0f} tok/s | {scale.rate_rps * mean_out:,.0f} tok/s |"
    )
    w(
        "| out tok/s per replica | ≈2,259 (40 % of 5,647) | "
        f"{lit.tokens_out.mean() / meas_s:,.0f} | {heavy.tokens_out.mean() / meas_s:,.0f} |"
    )
    for label, fn in (
        (
            "mean KV occupancy",
            lambda r: _pct(
                float(np.mean(np.asarray(r.series.occ_mean)[_series_window(r, scale.warmup_s)]))
            ),
        ),
        ("TTFT p95 (ms)", lambda r: _ms(_p(r.ttfts(), 95))),
        ("TPOT p50 / p95 (ms)", lambda r: f"{_ms(_p(r.tpots(), 50))} / {_ms(_p(r.tpots(), 95))}"),
        ("SLO attainment (TTFT < 1 s and TPOT < 50 ms)", lambda r: _pct(r.attainment())),
        (
            "requests refused 503 (free tier above 0.60 first)",
            lambda r: _pct(
                sum(1 for q in r.measured() if q.status == "rejected") / max(1, len(r.measured()))
            ),
        ),
        ("preemptions", lambda r: f"{r.preemptions}"),
    ):
        design = {
            "mean KV occupancy": "—",
            "TTFT p95 (ms)": "< 1,000",
            "TPOT p50 / p95 (ms)": "≈31 / < 50",
        }.get(label, "—")
        w(f"| {label} | {design} | {fn(lit)} | {fn(heavy)} |")
    need = math.ceil(scale.rate_rps / per_replica_rate) if per_replica_rate > 0 else 0
    w(
        f"\nSizing from the same Engine: one replica holds TTFT p95 < 1 s and TPOT p95 < 50 ms "
        f"up to **{per_replica_rate:.2f} req/s** of the heavy-tailed shape (bisection on a "
        f"single Engine, {scale.cliff_duration_s:g} model-s per probe), so {scale.rate_rps:g} "
        f"req/s needs **{need} replicas** ({need * 4} GPUs) — "
        f"{need / 44:.1f}× the design's 44, before the R6 headroom of 15 %.\n"
    )
    mean_prompt = float(np.mean([r.prompt for r in heavy.requests]))
    w(
        f"Reading: with every request at the median, {scale.replicas} replicas carry "
        f"{scale.rate_rps:g} req/s at {lit.tokens_out.mean() / meas_s:,.0f} out tok/s each with "
        f"TPOT p95 {_ms(_p(lit.tpots(), 95))} ms — §2's arithmetic, reproduced. With the "
        f"heavy tail the mean output is {mean_out:.0f} tokens, not 300, and the mean prompt "
        f"{mean_prompt:,.0f}, not 800 (prefill demand {scale.rate_rps * mean_prompt:,.0f} tok/s): "
        f"the same fleet runs at TPOT p95 {_ms(_p(heavy.tpots(), 95))} ms. This is §2's own "
        "warning that a mean-based (here: median-based) capacity model is wrong, quantified.\n"
    )
    # §7 cliff.
    w("## §7 — the occupancy cliff (one replica, no admission control)\n")
    w(
        "| offered req/s | mean KV occupancy | TPOT p50 (ms) | TPOT p95 (ms) | TTFT p95 (ms) | preemptions/min | out tok/s |"  # noqa: E501
    )
    w("|---|---|---|---|---|---|---|")
    for c in cliff:
        w(
            f"| {c.rate_rps:g} | {_pct(c.occupancy)} | {_ms(c.tpot_p50)} | {_ms(c.tpot_p95)} | "
            f"{_ms(c.ttft_p95)} | {c.preemptions_per_min:.1f} | {c.out_tokens_per_s:,.0f} |"
        )
    w("")
    # C5 herd.
    w("## C5 / R5 — routing herd on 250 ms stale occupancy\n")
    w(
        "| routing | mean occupancy | mean of per-second max | max − mean p95 | TTFT p99 (ms) | TPOT p95 (ms) | 503 share | preemptions |"  # noqa: E501
    )
    w("|---|---|---|---|---|---|---|---|")
    herd_names = ["p2c+inflight", "emptiest (stale)", "round robin"]
    for name in herd_names:
        r = results[name]
        m = _series_window(r, scale.warmup_s)
        mx = np.asarray(r.series.occ_max)[m]
        mean = np.asarray(r.series.occ_mean)[m]
        meas = r.measured()
        rej = sum(1 for q in meas if q.status == "rejected") / max(1, len(meas))
        w(
            f"| {name} | {_pct(float(mean.mean()))} | {_pct(float(mx.mean()))} | "
            f"{_pct(float(np.percentile(mx - mean, 95)))} | {_ms(_p(r.ttfts(), 99))} | "
            f"{_ms(_p(r.tpots(), 95))} | {_pct(rej)} | {r.preemptions} |"
        )
    w("")
    # C6 storm.
    k = scale.kill_at_s
    w(f"## C6 / R6 — one replica dies at t = {k:g} s\n")
    w(
        "Its streams end in an error and their clients retry at once. Without R6 every 503 "
        "says `Retry-After: 5` and every client honours it exactly; with R6 the 503 says "
        "5 s + uniform[0, 5 s] and the retry budget sheds non-reserved retries with 30–60 s "
        "once retries pass 20 % of admitted traffic. Clients give up after 4 attempts. The "
        f"third arm repeats the failure at {0.9 * scale.rate_rps:.0f} req/s without the free "
        "tier, below the 0.85 ceiling (R6's change 3: keep headroom).\n"
    )
    win = min(20.0, k - scale.warmup_s)
    w(
        f"Rates are per second over the {win:g} s before the kill and the {win:g} s after it "
        "(same run, same seeds); the first row is the same fleet and seeds with no failure "
        "(the C5 P2C run), i.e. what those windows hold anyway.\n"
    )
    w(
        _md_row([
            "arm", "streams lost", "offered req/s before → after", "retries/s before → after",
            "503/s before → after", "peak 503/s", "503s to first attempts after",
            "gave up after", "completed after", "TTFT p99 after (ms)", "max occupancy after",
        ])
    )  # fmt: skip
    w("|---" * 11 + "|")
    storm_names = ("kill, no R6", "kill, R6", "kill at 90 % load, R6")
    # The same seeds without the failure: what the fleet does in those windows anyway.
    for name in ("p2c+inflight", *storm_names):
        r = results[name]
        t = np.asarray(r.series.t)
        before, after = (t > k - win) & (t <= k), (t > k) & (t <= k + win)

        def rate(series: list[int], mask: np.ndarray) -> str:
            return f"{np.asarray(series)[mask].mean():.0f}" if mask.any() else "—"

        rejected = np.asarray(r.series.rejected)
        errors = int(np.asarray(r.series.errors)[(t > k) & (t <= k + 1.0)].sum())
        reqs = [q for q in _after(r, k) if q.ended <= k + win]
        done = sum(1 for q in reqs if q.status == "ok") / max(1, len(reqs))
        gave_up = sum(1 for q in reqs if q.status != "ok")
        ttft = [q.first_token - q.sent for q in reqs if q.first_token is not None]
        peak_occ = float(np.nanmax(np.asarray(r.series.occ_max)[after], initial=0))
        label = "no failure (reference, R6)" if name == "p2c+inflight" else name
        w(
            _md_row([
                label, errors,
                f"{rate(r.series.arrivals, before)} → {rate(r.series.arrivals, after)}",
                f"{rate(r.series.retries, before)} → {rate(r.series.retries, after)}",
                f"{rate(r.series.rejected, before)} → {rate(r.series.rejected, after)}",
                int(rejected[after].max(initial=0)),
                int(np.asarray(r.series.rejected_first)[after].sum()), gave_up, _pct(done),
                _ms(_p(ttft, 99)), _pct(peak_occ),
            ])
        )  # fmt: skip
    w("")
    w(
        "Plots: [cliff](fleet_sim_cliff.png) · [herd](fleet_sim_herd.png) · "
        "[storm](fleet_sim_storm.png)\n"
    )
    caption = f"{command} — model time"
    lines(
        [
            (
                "TPOT (ms)",
                [
                    Line(
                        "p95",
                        [c.occupancy * 100 for c in cliff],
                        [c.tpot_p95 * 1000 for c in cliff],
                        {"marker": "o"},
                    ),
                    Line(
                        "p50",
                        [c.occupancy * 100 for c in cliff],
                        [c.tpot_p50 * 1000 for c in cliff],
                        {"marker": "."},
                    ),
                ],
            ),
            (
                "preemptions / min",
                [
                    Line(
                        "preemptions",
                        [c.occupancy * 100 for c in cliff],
                        [c.preemptions_per_min for c in cliff],
                        {"marker": "o", "color": "tab:red"},
                    ),
                ],
            ),
            (
                "TTFT p95 (s)",
                [
                    Line(
                        "TTFT p95",
                        [c.occupancy * 100 for c in cliff],
                        [c.ttft_p95 for c in cliff],
                        {"marker": "o", "color": "tab:purple"},
                    ),
                ],
            ),
        ],
        out_dir / "fleet_sim_cliff.png",
        caption,
        xlabel="mean KV occupancy (%)",
        logy=[False, False, True],
        hlines=[[TPOT_SLO_S * 1000], [], [TTFT_SLO_S]],
    )
    herd_panels = []
    for name in herd_names:
        r = results[name]
        herd_panels.append(
            (
                f"{name}\noccupancy %",
                [
                    Line(
                        "max replica",
                        r.series.t,
                        np.asarray(r.series.occ_max) * 100,
                        {"color": "tab:red"},
                    ),
                    Line(
                        "fleet mean",
                        r.series.t,
                        np.asarray(r.series.occ_mean) * 100,
                        {"color": "tab:blue"},
                    ),
                ],
            )
        )
    lines(
        herd_panels,
        out_dir / "fleet_sim_herd.png",
        caption,
        xlabel="model s",
        hlines=[[85]] * len(herd_names),
    )
    storm_panels = []
    for name in storm_names:
        r = results[name]
        storm_panels.append(
            (
                f"{name}\nper second",
                [
                    Line("offered", r.series.t, r.series.arrivals, {"color": "gray"}),
                    Line("retries", r.series.t, r.series.retries, {"color": "tab:red"}),
                    Line("503", r.series.t, r.series.rejected, {"color": "tab:orange"}),
                ],
            )
        )
    lines(storm_panels, out_dir / "fleet_sim_storm.png", caption, xlabel="model s")
    path = out_dir / "fleet_sim.md"
    path.write_text("\n".join(lines_md) + "\n")
    (out_dir / "fleet_sim_headline.md").write_text(
        "\n".join(highlights(results, per_replica_rate, scale, command)) + "\n"
    )
    return path


def highlights(
    results: dict[str, SimResult], per_replica_rate: float, scale: Scale, command: str
) -> list[str]:
    """A few measured sentences for the results index."""
    lit, heavy = results["design-literal"], results["p2c+inflight"]
    meas_s = scale.duration_s - scale.warmup_s
    need = math.ceil(scale.rate_rps / per_replica_rate) if per_replica_rate > 0 else 0

    def herd(name: str) -> tuple[float, float]:
        r = results[name]
        m = _series_window(r, scale.warmup_s)
        return float(np.mean(np.asarray(r.series.occ_max)[m])), _p(r.ttfts(), 99)

    k = scale.kill_at_s
    win = min(20.0, k - scale.warmup_s)

    def after_rate(name: str, series: str) -> float:
        r = results[name]
        t = np.asarray(r.series.t)
        m = (t > k) & (t <= k + win)
        return float(np.asarray(getattr(r.series, series))[m].mean()) if m.any() else math.nan

    def excess(name: str, series: str) -> float:
        return after_rate(name, series) - after_rate("p2c+inflight", series)

    p2c_max, p2c_ttft = herd("p2c+inflight")
    emp_max, emp_ttft = herd("emptiest (stale)")
    return [
        f"Measured by `{command}` ({scale.replicas} emulator Engines, {scale.rate_rps:g} req/s, "
        "virtual time; routing and admission are the gateway's own code).\n",
        f"- §2: with every request at the median, {lit.tokens_out.mean() / meas_s:,.0f} out "
        f"tok/s per replica at TPOT p95 {_ms(_p(lit.tpots(), 95))} ms (design: ≈2,259); with "
        f"the heavy-tailed shape the same fleet runs at TPOT p95 {_ms(_p(heavy.tpots(), 95))} "
        f"ms; one replica holds the SLO up to {per_replica_rate:.2f} req/s, so "
        f"{scale.rate_rps:g} req/s needs {need} replicas (design: 44).",
        f"- C5: the fullest replica averages {_pct(emp_max)} under pick-emptiest on 250 ms "
        f"stale data vs {_pct(p2c_max)} under P2C + optimistic in-flight; TTFT p99 "
        f"{_ms(emp_ttft)} vs {_ms(p2c_ttft)} ms; preemptions "
        f"{results['emptiest (stale)'].preemptions} vs {heavy.preemptions}.",
        f"- C6: one replica dies at t = {k:g} s; over the next {win:g} s the failure adds "
        f"{excess('kill, no R6', 'rejected'):.0f} 503/s and {excess('kill, no R6', 'retries'):.0f}"
        f" retries/s without R6, {excess('kill, R6', 'rejected'):.0f} 503/s and "
        f"{excess('kill, R6', 'retries'):.0f} retries/s with R6 (each against the same seeds "
        f"without the failure); at {0.9 * scale.rate_rps:.0f} req/s without the free tier the "
        f"same failure leaves {after_rate('kill at 90 % load, R6', 'rejected'):.0f} 503/s.",
    ]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    scale = Scale.quick() if args.quick else Scale()
    command = (
        "python -m bench.fleet_sim"
        + (" --quick" if args.quick else "")
        + (f" --seed {args.seed}" if args.seed != 1 else "")
    )
    print(f"[fleet_sim] {scale}", flush=True)
    profile = get_profile(PROFILE)
    results = run_all(experiments(scale, args.seed), workers=args.workers)
    cliff = cliff_sweep(profile, scale, args.seed)
    rate, _ = sizing(profile, scale, args.seed)
    path = write_report(results, cliff, rate, scale, command, args.out)
    print(f"[fleet_sim] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
