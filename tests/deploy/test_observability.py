"""deploy/prometheus and deploy/grafana: promtool checks, rule unit tests, and every metric a
rule or a dashboard queries is one the platform exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from bench.prom_parse import sample_names
from tests.deploy.conftest import DEPLOY, tool

PROM = DEPLOY / "prometheus"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def _promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_checks_the_rules() -> None:
    done = _promtool("check", "rules", "rules/fairway.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_checks_the_scrape_config() -> None:
    done = _promtool("check", "config", "--syntax-only", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_unit_tests_pass() -> None:
    done = _promtool("test", "rules", "tests/fairway_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_wrong_expectation_fails_the_unit_test(tmp_path: Path) -> None:
    """The unit tests are not vacuous: expecting the reserved page to be absent fails."""
    text = (PROM / "tests" / "fairway_test.yml").read_text()
    broken = text.replace("../rules/fairway.yml", str(PROM / "rules" / "fairway.yml"))
    broken = broken.replace(
        "admission_class: reserved\n              severity: page",
        "admission_class: standard\n              severity: page",
    )
    assert broken != text
    (tmp_path / "t.yml").write_text(broken)
    assert _promtool("test", "rules", "t.yml", cwd=tmp_path).returncode != 0


def exported_metrics() -> set[str]:
    """Family names the platform's processes export (as scraped: counters with _total)."""
    from gateway.metrics import AdmissionMetrics, GatewayMetrics

    gw = GatewayMetrics()
    AdmissionMetrics(gw.registry)
    names = set()
    registries: list[CollectorRegistry] = [gw.registry]
    from prometheus_client import REGISTRY

    import metering.metrics as ingest  # noqa: F401 - registers on the default registry

    registries.append(REGISTRY)
    for registry in registries:
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
            if family.type == "histogram":
                names |= {family.name + s for s in ("_bucket", "_count", "_sum")}
    return names | _emulator_metrics()


def _emulator_metrics() -> set[str]:
    """vLLM's names as the emulator exports them (emulator/metrics.py), from a real scrape."""
    from emulator.engine import Engine, EngineConfig
    from emulator.metrics import MetricsRenderer
    from emulator.profiles import BUILTIN_PROFILES

    engine = Engine(BUILTIN_PROFILES["llama-8b-tp1-h100"], EngineConfig())
    text = MetricsRenderer(engine, "m").render().decode()
    return sample_names(text)


def _rule_names() -> tuple[set[str], list[str]]:
    rules = yaml.safe_load((PROM / "rules" / "fairway.yml").read_text())
    recorded, exprs = set(), []
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recorded.add(rule["record"])
            exprs.append(rule["expr"])
    return recorded, exprs


def _referenced(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:fairway|vllm)[a-z0-9_:]*)", expr)) - {"fairway"}


def test_rules_and_dashboards_query_metrics_that_exist() -> None:
    exported = exported_metrics()
    recorded, exprs = _rule_names()
    assert DASHBOARDS and len(DASHBOARDS) >= 4
    dashboard_exprs = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] and board["title"] and board["panels"]
        for panel in board["panels"]:
            assert panel["targets"], (path.name, panel["title"])
            dashboard_exprs += [t["expr"] for t in panel["targets"]]
    missing = {}
    for expr in exprs + dashboard_exprs:
        for name in _referenced(expr):
            if name not in exported and name not in recorded:
                missing[name] = expr
    assert not missing, missing
    # And the checks are not vacuous: each source is queried somewhere.
    every = " ".join(exprs + dashboard_exprs)
    for needle in (
        "fairway_gateway_ttft_seconds_bucket",
        "fairway_admission_limits_store_up",
        "fairway_ingest_consumer_lag",
        "vllm:num_preemptions_total",
        "fairway_gateway_usage_spool_depth",
        "fairway_gateway_usage_broker_up",
        "fairway_ingest_dead_letters_total",
    ):
        assert needle in every and needle in exported, needle


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each dashboard query is valid PromQL: promtool parses it as a rule expression."""
    recorded = [
        {"record": f"dashboard:{path.stem}:{i}{target['refId']}", "expr": target["expr"]}
        for path in DASHBOARDS
        for i, panel in enumerate(json.loads(path.read_text())["panels"])
        for target in panel["targets"]
    ]
    rules = {"groups": [{"name": "dashboards", "rules": recorded}]}
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump(rules))
    done = _promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisioning_points_at_the_mounted_dashboards_and_prometheus() -> None:
    from tests.deploy.conftest import DOCKER, compose

    provisioning = DOCKER / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "fairway.yaml").read_text())[
        "providers"
    ]
    done = compose("config")
    grafana = yaml.safe_load(done.stdout)["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert Path(mounts[provider["options"]["path"]]) == DEPLOY / "grafana" / "dashboards"
    # Every dashboard queries the provisioned data source by its uid.
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            assert panel["datasource"]["uid"] == source["uid"]
