"""The fleet simulation's long-context ledger with the whole-context budget
(``AdmissionConfig.long_context_fit``): it judges each ask against the budget its own size
gives (``long_context.fit_budget``), as the gateway's ask carries it to the admit script,
and so refuses the ask that the designated replicas' KV counted as one pool would admit and
that no replica could hold whole."""

from __future__ import annotations

from bench import fleet_sim
from bench.sim import LongContextLedger, replica_records, sim_version
from emulator.profiles import get_profile
from gateway.admission.config import AdmissionConfig
from gateway.admission.long_context import fit_budget, long_context_budget

PROFILE = get_profile(fleet_sim.PROFILE)
KV = PROFILE.kv_bytes_per_token
OUT = 100


def _ledger(fit: bool) -> LongContextLedger:
    """8 shared replicas, 2 designated (1.7 replicas' worth of KV at the standard ceiling)."""
    version = sim_version("v", "llama-70b", PROFILE, replica_records(8),
                          kv_capacity_tokens=PROFILE.kv_capacity_tokens,
                          prefill_tokens_per_s=10_000.0)  # fmt: skip
    return LongContextLedger(version, 8, AdmissionConfig(long_context_fit=fit))


def _fill(ledger: LongContextLedger) -> list[bool]:
    """One tenant asks for contexts of 0.3 of a replica (prompt and output), one at a time,
    each done prefilling before the next asks (the prefill slots stay free): which of six
    the budget admits."""
    prompt = int(0.3 * PROFILE.kv_capacity_tokens) - OUT
    out = []
    for i in range(6):
        t = float(i)
        admitted = ledger.ask("a", f"l{i}", (prompt + OUT) * KV, prompt, t, output=OUT) is None
        ledger.prefilled(f"l{i}", t + 0.5)
        out.append(admitted)
    return out


def test_the_whole_context_budget_refuses_what_no_designated_replica_holds() -> None:
    # two designated replicas under the 0.85 ceiling hold two 0.3 contexts each, not three:
    # the fifth would fit only in the pool's arithmetic (1.5 <= 1.7)
    assert _fill(_ledger(fit=False)) == [True, True, True, True, True, False]
    assert _fill(_ledger(fit=True)) == [True, True, True, True, False, False]


def test_the_ledger_judges_each_ask_by_its_own_size() -> None:
    ledger = _ledger(fit=True)
    need = 1 << 34
    pool, _ = long_context_budget(ledger.version, 8, "standard", AdmissionConfig())
    got, _ = long_context_budget(ledger.version, 8, "standard", ledger.adm, need)
    assert got == fit_budget(pool, need, 2) == pool - need - 1


def test_short_requests_land_in_the_placement_bands() -> None:
    """``landed``: the band a short request's replica was in (the second task of
    bench/results/fleet_sim_isolation_fit.md)."""
    designated, hosting = frozenset({4, 5, 6}), frozenset({5})
    assert fleet_sim.landed(0, True, designated, hosting) == fleet_sim.LANDED_POOL
    assert fleet_sim.landed(5, False, designated, hosting) == fleet_sim.LANDED_HOSTING
    assert fleet_sim.landed(4, False, designated, hosting) == fleet_sim.LANDED_IDLE
    assert fleet_sim.landed(9, False, designated, hosting) == fleet_sim.LANDED_OTHER
