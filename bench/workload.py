"""Seeded workloads: tenants, the design's heavy-tailed token shape, Poisson arrivals.

Everything here is a pure function of a seed, so two arms of one benchmark replay the
same requests. Each tenant draws from its own generator (seeded by the run seed and a
stable hash of its id), so adding or removing a tenant — the noisy one in the quiet
baseline — leaves every other tenant's request stream unchanged.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

Z95 = 1.6448536269514722  # standard normal 95th percentile


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A lognormal token-length distribution, clipped to [lo, hi] and rounded."""

    mu: float
    sigma: float
    lo: int = 1
    hi: int = 1 << 20

    @classmethod
    def from_quantiles(cls, p50: float, p95: float, lo: int = 1, hi: int = 1 << 20) -> LogNormal:
        """Fit from two quantiles: the median fixes mu, the p95/p50 ratio fixes sigma."""
        if not 0 < p50 < p95:
            raise ValueError("need 0 < p50 < p95")
        return cls(mu=math.log(p50), sigma=math.log(p95 / p50) / Z95, lo=lo, hi=hi)

    def quantile(self, q: float) -> float:
        """Unclipped quantile (inverse CDF) via the normal quantile."""
        from statistics import NormalDist

        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(q))

    def mean(self) -> float:
        """Unclipped mean."""
        return math.exp(self.mu + self.sigma**2 / 2)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(self.mu, self.sigma, size=n)
        return np.clip(np.rint(raw), self.lo, self.hi).astype(np.int64)

    def scaled(self, factor: float) -> LogNormal:
        """The same shape with every length multiplied by ``factor`` (bounds too)."""
        return LogNormal(
            mu=self.mu + math.log(factor),
            sigma=self.sigma,
            lo=max(1, round(self.lo * factor)),
            hi=max(1, round(self.hi * factor)),
        )


@dataclass(frozen=True, slots=True)
class Fixed:
    """A constant length (the noisy tenant's 128k prompts)."""

    value: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)

    def mean(self) -> float:
        return float(self.value)

    def scaled(self, factor: float) -> Fixed:
        return Fixed(max(1, round(self.value * factor)))


Lengths = LogNormal | Fixed

# docs/design.md §2: prompt p50 800 / p95 6,000; output p50 300 / p95 1,200.
DESIGN_PROMPT = LogNormal.from_quantiles(800, 6_000, lo=16, hi=32_000)
DESIGN_OUTPUT = LogNormal.from_quantiles(300, 1_200, lo=1, hi=4_096)
NOISY_PROMPT_TOKENS = 128_000


@dataclass(frozen=True, slots=True)
class TenantSpec:
    tenant_id: str
    name: str
    plan: str  # free | standard | enterprise
    admission_class: str  # best_effort | standard | reserved
    rate_rps: float  # Poisson arrival rate, requests per model second
    prompt: Lengths = DESIGN_PROMPT
    output: Lengths = DESIGN_OUTPUT
    noisy: bool = False
    # Arrivals start this many model seconds into the run (a flood that begins mid-run).
    start_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the workload; ``at_s`` is its arrival in model seconds."""

    request_id: str
    tenant_id: str
    at_s: float
    prompt_tokens: int
    max_tokens: int
    seed: int


@dataclass(slots=True)
class Workload:
    tenants: list[TenantSpec]
    duration_s: float
    seed: int
    requests: list[RequestSpec] = field(default_factory=list)

    def tenant(self, tenant_id: str) -> TenantSpec:
        for t in self.tenants:
            if t.tenant_id == tenant_id:
                return t
        raise KeyError(tenant_id)

    def without_noisy(self) -> Workload:
        """The quiet baseline: the same requests minus the noisy tenants'."""
        keep = [t for t in self.tenants if not t.noisy]
        ids = {t.tenant_id for t in keep}
        return Workload(
            tenants=keep,
            duration_s=self.duration_s,
            seed=self.seed,
            requests=[r for r in self.requests if r.tenant_id in ids],
        )


def tenant_rng(seed: int, tenant_id: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(tenant_id.encode())])


def poisson_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    """Arrival times of a Poisson process on [start, end): exponential gaps."""
    if rate <= 0 or end <= start:
        return np.empty(0)
    # Draw enough gaps in one go (mean + 6 sigma), then trim.
    expected = rate * (end - start)
    n = int(expected + 6 * math.sqrt(expected) + 10)
    times = start + np.cumsum(rng.exponential(1.0 / rate, size=n))
    while times[-1] < end:  # astronomically rare; keep it exact anyway
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))
        times = np.concatenate([times, more])
    return times[times < end]


def build_workload(tenants: Sequence[TenantSpec], duration_s: float, seed: int) -> Workload:
    """Draw every tenant's requests for ``duration_s`` model seconds, merged by arrival."""
    requests: list[RequestSpec] = []
    for t in tenants:
        rng = tenant_rng(seed, t.tenant_id)
        times = poisson_arrivals(rng, t.rate_rps, t.start_s, duration_s)
        n = len(times)
        prompts = t.prompt.sample(rng, n)
        outputs = t.output.sample(rng, n)
        seeds = rng.integers(0, 2**31 - 1, size=n)
        requests.extend(
            RequestSpec(
                request_id=f"{t.tenant_id}-{i:05d}",
                tenant_id=t.tenant_id,
                at_s=float(times[i]),
                prompt_tokens=int(prompts[i]),
                max_tokens=int(outputs[i]),
                seed=int(seeds[i]),
            )
            for i in range(n)
        )
    requests.sort(key=lambda r: (r.at_s, r.request_id))
    return Workload(tenants=list(tenants), duration_s=duration_s, seed=seed, requests=requests)


# -- prompt text ------------------------------------------------------------------------

# Words of at most four bytes: one token each for the emulator's tokenizer (4-byte pieces)
# and for whitespace tokenizers, close to one for BPE ones. A run of them is deterministic
# in (seed, length), and every prompt starts with its request's own tag so no two requests
# share a prefix-cache block by accident.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "but have an they you were her she been one all we has when what more if no out so "
    "said up its into than them can only time new some two may then do any like my now "
    "over such our man me even most made also back well way most much down just how"
).split()
# A chat request costs the template's tokens on top of its content (4 per message + 3 for
# the generation prompt in the emulator's Llama-3 style template).
CHAT_TEMPLATE_TOKENS = 7


class PromptFactory:
    """Builds prompt text whose chat request counts ``spec.prompt_tokens`` tokens.

    Exact for the emulator's tokenizer; ``tokens_per_word`` calibrates it for another one.
    """

    def __init__(self, seed: int = 0, tokens_per_word: float = 1.0) -> None:
        rng = np.random.default_rng(seed)
        vocab = np.array(_WORDS)
        self._words = [str(w) for w in vocab[rng.integers(0, len(vocab), size=8192)]]
        self._tokens_per_word = tokens_per_word
        self._cache: dict[int, str] = {}

    def words_for(self, tokens: int) -> int:
        return max(1, round(tokens / self._tokens_per_word))

    def body(self, tokens: int) -> str:
        n = self.words_for(tokens)
        text = self._cache.get(n)
        if text is None:
            reps = n // len(self._words) + 1
            text = " ".join((self._words * reps)[:n])
            if len(self._cache) < 4096:
                self._cache[n] = text
        return text

    @staticmethod
    def tag(request_id: str) -> list[str]:
        """The request id cut into words of at most four bytes (one token each)."""
        return [request_id[i : i + 4] for i in range(0, len(request_id), 4)]

    def prompt(self, spec: RequestSpec) -> str:
        tag = self.tag(spec.request_id)
        body_tokens = max(1, spec.prompt_tokens - CHAT_TEMPLATE_TOKENS - len(tag))
        return " ".join(tag) + " " + self.body(body_tokens)
