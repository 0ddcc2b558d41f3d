"""The demo fleet and plans that ``seed_demo`` creates, with the arithmetic behind them.

Model profiles match the emulator's (docs/design.md §2):

- ``llama-70b-2026-05``: Llama-3-70B FP16, TP=4 on H100. GQA-8: 80 layers x 8 KV heads x
  128 dims x 2 (K, V) x 2 bytes = 320 KiB per token. KV budget 172.5 GiB per replica after
  weights and activations = 565,248 tokens. TPOT target 50 ms (the SLO).
- ``llama-8b-2026-05``: Llama-3-8B FP16, TP=1 on one H100 80 GB. GQA-8: 32 layers x 8 x 128
  x 2 x 2 bytes = 128 KiB per token. KV budget as in the emulator's profile: 80 GiB x 0.92
  minus 15 GiB of weights and ~4.6 GiB of activations and CUDA graphs = 54 GiB = 442,368
  tokens. TPOT target 50 ms: the product's SLO is the same for every model (docs/design.md §1).

Limits per plan. ``kv_seconds_cap`` (GiB·s, the in-flight KV·seconds budget of docs/design.md §6)
is sized in units of the plan's largest request -- max_context prompt tokens plus max_output output
tokens -- costed at 4x the TPOT target (the ceiling of the measured-TPOT clamp, docs/design.md R1),
so even a degraded fleet's estimate admits that many such requests at once: free 1, standard 4,
enterprise 8. The enterprise reserved floor is 2 of them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from contracts.formulas import kv_gib_seconds_ceil

if TYPE_CHECKING:
    from catalog.models import ModelVersion

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
    # Serving (catalog.replica): the weights vLLM loads, GPUs per replica, tool parser.
    weights: str
    tensor_parallel_size: int
    tool_call_parser: str
    emulator_profile: str
    # The profile's prefill rate at the long-context threshold (prompt tokens/s,
    # emulator/profiles.py's ``threshold_prefill_rate``) and the share of that prompt's
    # prefill time that is attention (``prefill_attention_share``, to 4 places): with them
    # the gateway's long-context budget estimates a long prompt's first token. The control
    # plane does not import the emulator; tests/controlplane/test_version_profile.py checks
    # the figures against the profiles.
    prefill_tokens_per_s: int
    prefill_attention_share: float
    # Capabilities of the replicas (the emulator serves all of them, as vLLM does for
    # Llama 3.x with --enable-auto-tool-choice --tool-call-parser llama3_json).
    supports_tools: bool = True
    supports_structured_output: bool = True
    max_n: int = 8
    supports_logprobs: bool = True
    max_top_logprobs: int = 20

    def capabilities(self) -> dict[str, object]:
        return {
            "supports_tools": self.supports_tools,
            "supports_structured_output": self.supports_structured_output,
            "max_n": self.max_n,
            "supports_logprobs": self.supports_logprobs,
            "max_top_logprobs": self.max_top_logprobs,
        }

    def upsert(self, *, make_current: bool = False) -> ModelVersion:
        """This version (and its family) in the catalog, through the catalog's services."""
        from catalog import services

        family = services.family_upsert(name=self.family, display_name=self.display_name)
        version = services.version_upsert(
            family=family,
            name=self.version,
            context_length=self.context_length,
            kv_bytes_per_token=self.kv_bytes_per_token,
            tpot_target_ms=self.tpot_target_ms,
            kv_capacity_tokens=self.kv_capacity_tokens,
            price_prompt_per_mtok=self.price_prompt_per_mtok,
            price_cached_prompt_per_mtok=self.price_cached_prompt_per_mtok,
            price_completion_per_mtok=self.price_completion_per_mtok,
            weights=self.weights,
            tensor_parallel_size=self.tensor_parallel_size,
            tool_call_parser=self.tool_call_parser,
            emulator_profile=self.emulator_profile,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            prefill_attention_share=self.prefill_attention_share,
            is_active=True,
            actor_label="system:seed_demo",
            price_reason="The demo catalog's price (tenants/demo.py).",
            **self.capabilities(),
        )
        if make_current and not version.is_current:
            services.version_make_current(version=version)
        return version


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
        weights="meta-llama/Llama-3.3-70B-Instruct",
        tensor_parallel_size=4,
        tool_call_parser="llama3_json",
        emulator_profile="llama-70b-tp4-h100",
        prefill_tokens_per_s=12_548,
        prefill_attention_share=0.1043,
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
        weights="meta-llama/Llama-3.1-8B-Instruct",
        tensor_parallel_size=1,
        tool_call_parser="llama3_json",
        emulator_profile="llama-8b-tp1-h100",
        prefill_tokens_per_s=24_262,
        prefill_attention_share=0.2837,
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
    base_fee: Decimal = Decimal(0)  # monthly, in the plan's currency (usd)


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
        base_fee=Decimal("49.00"),
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
        base_fee=Decimal("1500.00"),
    ),
)


def plan_limits(plan: DemoPlan, model: DemoVersion) -> dict[str, int]:
    largest = kv_gib_seconds_ceil(
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


# -- demo usage --------------------------------------------------------------------------

# Requests per hour at the daily peak, per plan and model family; prompt and completion sizes.
DEMO_TRAFFIC = {
    "free": {"llama-8b": 40, "llama-70b": 6},
    "standard": {"llama-8b": 600, "llama-70b": 220},
    "enterprise": {"llama-8b": 1500, "llama-70b": 900},
}
DEMO_PROMPT_TOKENS = 1400
DEMO_COMPLETION_TOKENS = 320
DEMO_CACHED_SHARE = 0.35


@dataclass(frozen=True)
class DemoUsageRow:
    version: str
    counts: dict[str, Any]


def demo_usage_rows(
    *, plan: str, days: int, seed: str, now: datetime | None = None
) -> list[DemoUsageRow]:
    """Plausible hourly rollup rows for the last ``days`` days up to the current hour: a
    daily curve peaking mid-afternoon UTC, quieter weekends, seeded noise. Only for demos."""
    rng = random.Random(seed)
    end = (now or datetime.now(UTC)).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(days=days)
    rows: list[DemoUsageRow] = []
    hour = start
    while hour <= end:
        daily = 0.15 + 0.85 * max(0.0, math.sin(math.pi * (hour.hour - 6) / 16)) ** 2
        weekly = 0.45 if hour.weekday() >= 5 else 1.0
        for model in MODELS:
            peak = DEMO_TRAFFIC[plan][model.family]
            requests = int(peak * daily * weekly * rng.uniform(0.7, 1.3))
            if requests == 0:
                continue
            prompt = int(requests * DEMO_PROMPT_TOKENS * rng.uniform(0.6, 1.4))
            rows.append(
                DemoUsageRow(
                    model.version,
                    {
                        "hour": hour,
                        "requests": requests,
                        "prompt_tokens": prompt,
                        "cached_tokens": int(prompt * DEMO_CACHED_SHARE * rng.uniform(0.5, 1.5)),
                        "completion_tokens": int(
                            requests * DEMO_COMPLETION_TOKENS * rng.uniform(0.6, 1.4)
                        ),
                        "errored_requests": int(requests * 0.002),
                        "cancelled_requests": int(requests * 0.01),
                    },
                )
            )
        hour += timedelta(hours=1)
    return rows
