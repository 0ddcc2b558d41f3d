"""The demo fleet and plans that ``seed_demo`` creates, with the arithmetic behind them.

Model profiles match the emulator's (design §2):

- ``llama-70b-2026-05``: Llama-3-70B FP16, TP=4 on H100. GQA-8: 80 layers x 8 KV heads x
  128 dims x 2 (K, V) x 2 bytes = 320 KiB per token. KV budget 172.5 GiB per replica after
  weights and activations = 565,248 tokens. TPOT target 50 ms (the SLO).
- ``llama-8b-2026-05``: Llama-3-8B FP16, TP=1 on one H100 80 GB. GQA-8: 32 layers x 8 x 128
  x 2 x 2 bytes = 128 KiB per token. KV budget as in the emulator's profile: 80 GiB x 0.92
  minus 15 GiB of weights and ~4.6 GiB of activations and CUDA graphs = 54 GiB = 442,368
  tokens. TPOT target 50 ms: the product's SLO is the same for every model (design §1).

Limits per plan. ``kv_seconds_cap`` (GiB·s, the in-flight KV·seconds budget of §6) is sized
in units of the plan's largest request -- max_context prompt tokens plus max_output output
tokens -- costed at 4x the TPOT target (R1's clamp ceiling), so even a degraded fleet's
estimate admits that many such requests at once: free 1, standard 4, enterprise 8. The
enterprise reserved floor is 2 of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

KIB = 1024
GIB = 1024**3


@dataclass(frozen=True)
class DemoVersion:
    family: str
    display_name: str
    version: str
    context_length: int
    kv_bytes_per_token: int
    tpot_target_ms: int
    kv_capacity_tokens: int
    price_prompt_per_mtok: Decimal
    price_cached_prompt_per_mtok: Decimal
    price_completion_per_mtok: Decimal


MODELS = (
    DemoVersion(
        "llama-70b",
        "Llama 3 70B",
        "llama-70b-2026-05",
        context_length=131072,
        kv_bytes_per_token=320 * KIB,
        tpot_target_ms=50,
        kv_capacity_tokens=int(Decimal("172.5") * GIB) // (320 * KIB),
        price_prompt_per_mtok=Decimal("0.60"),
        price_cached_prompt_per_mtok=Decimal("0.15"),
        price_completion_per_mtok=Decimal("0.80"),
    ),
    DemoVersion(
        "llama-8b",
        "Llama 3 8B",
        "llama-8b-2026-05",
        context_length=131072,
        kv_bytes_per_token=128 * KIB,
        tpot_target_ms=50,
        kv_capacity_tokens=54 * GIB // (128 * KIB),
        price_prompt_per_mtok=Decimal("0.06"),
        price_cached_prompt_per_mtok=Decimal("0.015"),
        price_completion_per_mtok=Decimal("0.08"),
    ),
)


@dataclass(frozen=True)
class DemoPlan:
    name: str
    display_name: str
    admission_class: str
    max_context: int
    max_output: int
    rpm: dict[str, int]  # per family
    tpm: dict[str, int]
    concurrent_max_requests: int
    reserved_max_requests: int = 0


PLANS = (
    DemoPlan(
        "free",
        "Free",
        "best_effort",
        max_context=8192,
        max_output=2048,
        rpm={"llama-70b": 20, "llama-8b": 60},
        tpm={"llama-70b": 40_000, "llama-8b": 100_000},
        concurrent_max_requests=1,
    ),
    DemoPlan(
        "standard",
        "Standard",
        "standard",
        max_context=32768,
        max_output=4096,
        rpm={"llama-70b": 600, "llama-8b": 1200},
        tpm={"llama-70b": 1_000_000, "llama-8b": 2_000_000},
        concurrent_max_requests=4,
    ),
    DemoPlan(
        "enterprise",
        "Enterprise",
        "reserved",
        max_context=131072,
        max_output=8192,
        rpm={"llama-70b": 3000, "llama-8b": 6000},
        tpm={"llama-70b": 6_000_000, "llama-8b": 12_000_000},
        concurrent_max_requests=8,
        reserved_max_requests=2,
    ),
)


def kv_gib_seconds(*, prompt: int, output: int, kv_bytes_per_token: int, tpot_ms: int) -> int:
    """Design §6: (prompt + output/2) x KV bytes/token x output x TPOT, in GiB·s, rounded up.
    Integer arithmetic: numerator and denominator both doubled to keep output/2 exact."""
    numerator = (2 * prompt + output) * kv_bytes_per_token * output * tpot_ms
    denominator = 2 * 1000 * GIB
    return -(-numerator // denominator)


def plan_limits(plan: DemoPlan, model: DemoVersion) -> dict[str, int]:
    largest = kv_gib_seconds(
        prompt=plan.max_context,
        output=plan.max_output,
        kv_bytes_per_token=model.kv_bytes_per_token,
        tpot_ms=4 * model.tpot_target_ms,
    )
    return {
        "rpm": plan.rpm[model.family],
        "tpm": plan.tpm[model.family],
        "max_context": min(plan.max_context, model.context_length),
        "max_output": plan.max_output,
        "kv_seconds_cap": largest * plan.concurrent_max_requests,
        "reserved_kv": largest * plan.reserved_max_requests,
    }
