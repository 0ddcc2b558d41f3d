"""What a request is charged before it runs (docs/design.md §6): the tokens/min estimate,
the KV·seconds inputs (output assumed, TPOT estimate per docs/design.md R1) and the prefill
facts that make a prompt a long context.

Units: tokens are ints; KV·seconds are GiB·s as the control plane writes them, carried as
integer milli-GiB·s (``KV_MILLI``) wherever they are summed, so that Redis sums stay exact.
"""

from __future__ import annotations

import math

from contracts.schema import ModelVersionRecord as ModelVersionLike

KV_MILLI = 1000  # 1 GiB·s == 1000 milli-GiB·s


def tokens_estimate(prompt_tokens: int, max_tokens: int | None, max_output: int) -> int:
    """Tokens/min charge at admission: prompt estimate + min(max_tokens, max_output)."""
    out = max_output if max_tokens is None else min(max_tokens, max_output)
    return max(0, prompt_tokens) + max(0, out)


def est_out_for_kv(max_output: int, cap: int = 0) -> int:
    """Output tokens assumed by the KV estimate: the effective max_output, capped if set."""
    return max(0, min(max_output, cap) if cap > 0 else max_output)


def tpot_estimate(
    measured_p95_s: float | None,
    age_s: float,
    target_s: float,
    *,
    max_factor: float = 4.0,
    stale_after_s: float = 60.0,
    stale_factor: float = 2.0,
) -> float:
    """docs/design.md R1: clamp(measured p95, target, 4 x target); stale or missing -> 2 x target.

    The floor keeps the estimate from ever being optimistic; the ceiling stops one stuck
    replica from freezing admission; the stale fallback is pessimistic on purpose.
    """
    if measured_p95_s is None or not math.isfinite(measured_p95_s) or age_s > stale_after_s:
        return stale_factor * target_s
    return min(max(measured_p95_s, target_s), max_factor * target_s)


def to_milli(gib_seconds: float) -> int:
    """GiB·s -> integer milli-GiB·s, rounded up (never under-charge)."""
    return max(0, math.ceil(gib_seconds * KV_MILLI))


def expected_duration_ms(est_out: int, tpot_s: float) -> int:
    """How long a request is expected to hold its lease: decode time at the estimated TPOT."""
    return max(1, math.ceil(est_out * tpot_s * 1000))


def prefill_rate(version: ModelVersionLike) -> float:
    """Prompt tokens per second one replica prefills, as the control plane pushed it with
    the version (0: unknown)."""
    return max(0.0, float(version.prefill_tokens_per_s))


def long_context_threshold(version: ModelVersionLike) -> int:
    """Prompt tokens from which a request is a long context: its prefill alone takes at
    least the TTFT target on this replica profile. Such a prompt cannot meet the TTFT SLO
    anyway, and while it prefills it holds its replica's step budget for a TTFT or more.
    A version pushed without its prefill rate has no long contexts (nothing to derive the
    threshold from; the ceilings and KV·seconds still bound them)."""
    rate = prefill_rate(version)
    if rate <= 0:
        return 2**62
    return max(1, math.ceil(rate * max(1, version.ttft_target_ms) / 1000))


def prefill_seconds(prompt_tokens: int, version: ModelVersionLike) -> float:
    """How long the prompt's prefill alone takes on one replica of the profile (linear in
    the prompt: the pushed rate is the one at the long-context threshold, so a much longer
    prompt, whose attention grows with its length, takes longer than this)."""
    rate = prefill_rate(version)
    return max(0, prompt_tokens) / rate if rate > 0 else 0.0


def prefill_bound_seconds(prompt_tokens: int, version: ModelVersionLike) -> float:
    """An upper bound on the prompt's prefill time on one replica of the profile, attention
    included, from what the version pushes. A prefill's cost per token grows linearly
    with the context before it (matmuls plus attention over every earlier token, see
    emulator/profiles.py), so its time is ``a*n + b*n*n`` with a, b >= 0. The pushed rate
    says the threshold prompt ``n0`` takes the TTFT target ``T``; for ``n >= n0`` the
    time is at most ``T * (n / n0)**2`` (all of ``T`` taken as attention), which is the
    linear estimate times ``n / n0``. Below the threshold the linear estimate bounds it.
    0 when the rate is unknown."""
    linear = prefill_seconds(prompt_tokens, version)
    if linear <= 0:
        return 0.0
    return linear * max(1.0, prompt_tokens / long_context_threshold(version))


def attention_share(version: ModelVersionLike, default: float) -> float:
    """The share of the threshold prompt's prefill time that is attention on the version's
    replica profile, as the control plane pushed it with the version; ``default``
    (``AdmissionConfig.long_prefill_attention_share``) when it pushed none (0: an older
    control plane, or a version whose profile was not measured)."""
    share = float(version.prefill_attention_share)
    return min(1.0, share) if share > 0 else default


def prefill_expected_seconds(
    prompt_tokens: int, version: ModelVersionLike, attention_share: float
) -> float:
    """How long the prompt's prefill is expected to take on one replica of the profile,
    attention included: the cost model's ``a*n + b*n*n`` (see ``prefill_bound_seconds``)
    with ``attention_share`` of the threshold prompt's time taken as attention, i.e.
    ``(1 - share) * prefill_seconds + share * prefill_bound_seconds``. The pushed rate
    alone cannot split the two terms; the share is the replica profile's, pushed with the
    version (``attention_share``: 0.10 for the realistic 70B profile of
    emulator/profiles.py at its 1 s threshold, whose 128k prompt this puts at 20.3 s
    against the model's 20.7 s; 0.28 for the 8B one). 0 when the rate is unknown."""
    share = min(1.0, max(0.0, attention_share))
    linear = prefill_seconds(prompt_tokens, version)
    return (1 - share) * linear + share * prefill_bound_seconds(prompt_tokens, version)
