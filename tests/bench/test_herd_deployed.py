"""The herd's deployed configuration (bench/herd.py: ``--replica-cap``, ``--drain``,
``--classes``, ``--heavy-tenants``, the new policy's arm with the long-context budget) and the
fleet ledger it shares with the fleet simulation (``bench.sim.LongContextLedger``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.herd import ARMS, HerdConfig, arrivals, main, run_arm, workload
from bench.sim import HEAVY_PROMPT, LongContextLedger, replica_records, sim_engine, sim_version
from emulator.profiles import get_profile
from gateway.admission.config import AdmissionConfig
from gateway.admission.long_context import long_context_budget

BASE = HerdConfig(duration_s=20.0, warmup_s=5.0)
OLD = next(a for a in ARMS if a.label == "P2C + optimistic in-flight")
PLACEMENT = next(a for a in ARMS if a.label == "P2C + in-flight + long-context placement")
NEW = next(a for a in ARMS if a.budget)


def test_without_the_options_the_work_is_the_herds_arrivals_all_standard() -> None:
    assert not BASE.deployed
    work = workload(BASE)
    assert [(w.t, w.prompt, w.first) for w in work] == arrivals(BASE)
    assert {w.cls for w in work} == {"standard"} and not any(w.heavy for w in work)


def test_the_options_keep_the_herds_arrivals_and_add_to_them() -> None:
    cfg = replace(BASE, drain_s=10.0, class_mix=(0.1, 0.8, 0.1), heavy_tenants=2,
                  heavy_rates=(0.5, 1.0))  # fmt: skip
    assert cfg.deployed
    work = workload(cfg)
    shape = [w for w in work if not w.heavy]
    first = [(w.t, w.prompt, w.first) for w in shape if w.t < cfg.duration_s]
    assert first == arrivals(BASE)  # the drain, the classes and the flood change none of it
    drained = [w for w in shape if w.t >= cfg.duration_s]
    assert drained and max(w.t for w in drained) < cfg.duration_s + cfg.drain_s
    assert {w.cls for w in shape} == {"reserved", "standard", "best_effort"}
    heavy = [w for w in work if w.heavy]
    assert {w.tenant for w in heavy} == {"heavy-1", "heavy-2"}
    assert all(w.prompt == HEAVY_PROMPT and w.cls == "standard" for w in heavy)
    assert all(0 < w.output <= 3_000 for w in heavy)
    assert len({w.first for w in work}) == len(work)  # every prompt its own
    assert [w.t for w in work] == sorted(w.t for w in work)
    # one seed replays the same work
    assert workload(cfg) == work


def test_only_the_new_policys_arm_enforces_the_long_context_budget() -> None:
    assert NEW.isolation and NEW.strategy == "p2c" and NEW.optimistic
    assert NEW.admission().enforces("long_context")
    assert not OLD.admission().enforces("long_context")
    assert not PLACEMENT.admission().enforces("long_context")


def test_the_replica_cap_reaches_the_engines() -> None:
    profile = get_profile(BASE.profile)
    assert sim_engine(profile, 0, 5_242).long_prefill_token_threshold == 5_242
    assert sim_engine(profile, 0).long_prefill_token_threshold == 0


def test_the_ledger_holds_a_prefill_slot_until_the_first_token_and_the_kv_until_release() -> None:
    profile = get_profile(BASE.profile)
    records = replica_records(4)
    version = sim_version("v", "llama-70b", profile, records,
                          kv_capacity_tokens=profile.kv_capacity_tokens,
                          prefill_tokens_per_s=10_000.0)  # fmt: skip
    adm = AdmissionConfig(short_long_prefill_slots_per_replica=0)  # one tier: no lane
    ledger = LongContextLedger(version, 4, adm)
    _, slots = long_context_budget(version, 4, "standard", adm)
    need = 20_000 * profile.kv_bytes_per_token
    assert slots == 1  # 4 shared replicas: one designated
    assert ledger.admit("a", "l1", need, 20_000, now=0.0)
    assert not ledger.admit("b", "l2", need, 20_000, now=1.0)  # the one slot is prefilling
    assert "b" in ledger.waiting
    ledger.prefilled("l1", at=2.0)
    assert ledger.fleet_bytes() == need and ledger.fleet_bytes(but="l1") == 0
    assert ledger.admit("b", "l2", need, 20_000, now=3.0)  # slot back, room left: b's turn
    ledger.release("l1")
    ledger.release("l2")
    assert ledger.fleet_bytes() == 0
    assert ledger.admitted_by == {"a": 1, "b": 1}


def test_the_budget_refuses_a_flood_that_placement_alone_lets_through() -> None:
    """Same arrivals, a small fleet with room, one tenant flooding 128k prompts: placement
    alone admits them as KV allows; the budget runs one long prefill per designated replica
    and refuses the rest."""
    cfg = HerdConfig(replicas=4, rate_rps=4.0, duration_s=40.0, warmup_s=0.0, drain_s=5.0,
                     long_prefill_tokens=5_242, class_mix=(0.1, 0.8, 0.1), heavy_tenants=1,
                     heavy_rates=(1.0,))  # fmt: skip
    work = workload(cfg)
    placed = run_arm(cfg, PLACEMENT, work)
    budget = run_arm(cfg, NEW, work)
    assert placed.long_refused == 0 and budget.long_refused > 0
    assert budget.heavy_admitted >= 1
    assert budget.heavy_admitted < placed.heavy_admitted
    assert set(budget.ttft_by_class) <= {"reserved", "standard", "best_effort"}
    assert len(budget.ttft) == sum(len(v) for v in budget.ttft_by_class.values())


def test_main_writes_the_policy_report_with_both_policies(tmp_path: Path) -> None:
    arms = f"{OLD.label},{NEW.label}"
    rc = main(["--rates", "8", "--replicas", "3", "--duration", "12", "--warmup", "4",
               "--drain", "4", "--replica-cap", "5242", "--classes", "--heavy-tenants", "1",
               "--heavy-rps", "0.5", "--arms", arms, "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    text = (tmp_path / "herd_policy.md").read_text()
    assert "**Deployed configuration:**" in text and "5,242" in text
    rows = [line for line in text.splitlines() if line.startswith("| 8 req/s")]
    assert [row.split(" | ")[1] for row in rows] == [OLD.label, NEW.label]
    assert "new policy (placement + budget) against old" in text


def test_a_reserved_pool_needs_the_classes_and_runs_with_them(tmp_path: Path) -> None:
    argv = ["--rates", "8", "--replicas", "3", "--duration", "12", "--warmup", "4",
            "--reserved-pool", "1", "--arms", NEW.label, "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)  # only reserved traffic enters the pool: no classes, no pool
    assert main([*argv, "--classes", "--report", "pool"]) == 0
    text = (tmp_path / "pool.md").read_text()
    assert "the first 1 replicas a reserved pool" in text
