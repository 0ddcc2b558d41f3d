"""deploy/k8s: rendered with kustomize and validated against Kubernetes' own schemas."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from catalog.deployfiles import K8S_REPLICAS_FILE, demo_fleet, render_k8s
from catalog.replica import replica_argv
from gateway.config import GatewayConfig
from tests.deploy.conftest import base_documents

K8S_VERSION = "1.33.0"


def _by(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    return containers


def test_every_rendered_object_is_valid_for_kubernetes(
    k8s_production: list[dict[str, Any]],
) -> None:
    kinds = {d["kind"] for d in k8s_production}
    assert {"Deployment", "StatefulSet", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ConfigMap", "Service", "Job", "Namespace"} <= kinds  # fmt: skip
    for doc in k8s_production:
        # strict: unknown fields are errors too (a typo'd key is not silently ignored).
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"].get("namespace") == "fairway"


def test_the_validator_rejects_a_broken_manifest(k8s_production: list[dict[str, Any]]) -> None:
    broken = _by(k8s_production, "StatefulSet", "gateway")
    broken = {**broken, "spec": {**broken["spec"], "replicas": "three"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_base_files_are_valid_without_kustomize() -> None:
    for doc in base_documents():
        if doc["kind"] != "Kustomization":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_no_secret_is_committed(k8s_production: list[dict[str, Any]]) -> None:
    assert not [d for d in k8s_production if d["kind"] == "Secret"]
    config = _by(k8s_production, "ConfigMap", "fairway-config")["data"]
    for key in config:
        assert not re.search(r"SECRET|PEPPER|SALT|PASSWORD|TOKEN", key), key


def test_gateway_drains_within_its_grace_period(k8s_production: list[dict[str, Any]]) -> None:
    gw = _by(k8s_production, "StatefulSet", "gateway")
    pod = gw["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    config = _by(k8s_production, "ConfigMap", "fairway-config")["data"]
    drain = float(config["GATEWAY_DRAIN_DEADLINE_S"])
    assert drain == GatewayConfig().drain_deadline_s
    # preStop, the drain, then the supervisor's 20 s for workers to flush and exit.
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain + 20
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    hpa = _by(k8s_production, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "gateway"
    }  # fmt: skip
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = _by(k8s_production, "PodDisruptionBudget", "gateway")
    assert pdb["spec"]["selector"]["matchLabels"] == gw["spec"]["selector"]["matchLabels"]
    assert any(t["metadata"]["name"] == "spool" for t in gw["spec"]["volumeClaimTemplates"])


def test_one_consumer_per_usage_partition(k8s_production: list[dict[str, Any]]) -> None:
    config = _by(k8s_production, "ConfigMap", "fairway-config")["data"]
    consumer = _by(k8s_production, "Deployment", "consumer")
    assert consumer["spec"]["replicas"] == int(config["USAGE_TOPIC_PARTITIONS"])
    topics = _by(k8s_production, "Job", "kafka-topics")
    assert '--partitions "$USAGE_TOPIC_PARTITIONS"' in _containers(topics)[0]["args"][0]
    assert _containers(consumer)[0]["args"] == ["consumer"]
    # Its readiness probe and Prometheus reach the metrics port on the pod's address.
    assert config["FAIRWAY_INGEST_METRICS_ADDR"] == "0.0.0.0"
    probe = _containers(consumer)[0]["readinessProbe"]["tcpSocket"]["port"]
    ports = {p["name"]: p["containerPort"] for p in _containers(consumer)[0]["ports"]}
    assert ports[probe] == int(config["FAIRWAY_INGEST_METRICS_PORT"])
    assert _by(k8s_production, "Deployment", "beat")["spec"]["replicas"] == 1


def test_every_long_running_container_has_probes_and_requests(
    k8s_production: list[dict[str, Any]],
) -> None:
    for doc in k8s_production:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        for c in _containers(doc):
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            if doc["kind"] != "Job":
                assert "livenessProbe" in c, doc["metadata"]["name"]
            if doc["metadata"]["name"] in ("gateway", "controlplane", "consumer"):
                assert "readinessProbe" in c


def test_replicas_run_the_catalog_command(k8s_production: list[dict[str, Any]]) -> None:
    assert K8S_REPLICAS_FILE.read_text() == render_k8s(demo_fleet())
    fleet = demo_fleet()
    for spec in fleet.specs:
        sts = _by(k8s_production, "StatefulSet", f"replica-{spec.version}")
        (vllm,) = _containers(sts)
        assert vllm["command"] + vllm["args"] == replica_argv(spec, engine="vllm")
        gpus = vllm["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) == spec.tensor_parallel_size
        svc = _by(k8s_production, "Service", f"replica-{spec.version}")
        assert svc["spec"]["clusterIP"] == "None"  # one DNS name per replica pod
    seeds = _by(k8s_production, "ConfigMap", "fairway-replicas")["data"]["REPLICA_ARGS"]
    assert "replica-llama-70b-2026-05-0.replica-llama-70b-2026-05:8000" in seeds
    job = _containers(_by(k8s_production, "Job", "register-replicas"))[0]
    assert "register_replicas $REPLICA_ARGS" in " ".join(job["args"])
    assert {"configMapRef": {"name": "fairway-replicas"}} in job["envFrom"]


def test_prometheus_scrapes_the_gateway_metrics_port(k8s_production: list[dict[str, Any]]) -> None:
    """/metrics is on GATEWAY_METRICS_PORT: the pods are scraped there, and the Service (the
    way in from outside) does not expose it."""
    config = _by(k8s_production, "ConfigMap", "fairway-config")["data"]
    port = int(config["GATEWAY_METRICS_PORT"])
    gw = _by(k8s_production, "StatefulSet", "gateway")
    assert gw["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    (container,) = gw["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == port
    service = _by(k8s_production, "Service", "gateway")
    assert [p["port"] for p in service["spec"]["ports"]] == [8080]
