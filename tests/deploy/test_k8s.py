"""deploy/k8s: rendered with kustomize and validated against Kubernetes' own schemas."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest

from catalog import tokenizer_fetch
from catalog.deployfiles import K8S_REPLICAS_FILE, demo_fleet, render_k8s, vllm_argv
from catalog.replica import replica_argv, replica_name
from gateway.config import GatewayConfig
from tests.deploy.conftest import base_documents

K8S_VERSION = "1.33.0"
# vLLM 0.33.0's KVEventsConfig (vllm/config/kv_events.py in its wheel): the fields
# --kv-events-config accepts, and its publishers.
VLLM_KV_EVENTS_FIELDS = {
    "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
    "hwm", "max_queue_size", "topic",
}  # fmt: skip
VLLM_KV_EVENTS_PUBLISHERS = {"null", "zmq"}
# vLLM 0.33.0's CacheConfig.prefix_caching_hash_algo choices (vllm/config/cache.py).
VLLM_HASH_ALGOS = {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}


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
        argv = vllm["command"] + vllm["args"]
        assert argv == vllm_argv(spec)
        assert argv[: len(replica_argv(spec, engine="vllm"))] == replica_argv(spec, engine="vllm")
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


def _flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, name
    return args[args.index(name) + 1]


def _gateway_env(docs: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, Any]]:
    """The gateway container's environment from its ConfigMaps, and the container."""
    (container,) = _containers(_by(docs, "StatefulSet", "gateway"))
    env: dict[str, str] = {}
    for source in container["envFrom"]:
        if "configMapRef" in source:
            env.update(_by(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    return env, container


def _replica_ids(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Replica id -> URL of every replica the register Job registers."""
    seeds = _by(docs, "ConfigMap", "fairway-replicas")["data"]["REPLICA_ARGS"].split()
    ids = {}
    for flag, value in zip(seeds[::2], seeds[1::2], strict=True):
        assert flag == "--replicas"
        version, _, urls = value.partition("=")
        ids.update({replica_name(version, url): url for url in urls.split(",")})
    return ids


def test_replicas_and_gateways_agree_on_the_prefix_cache(
    k8s_production: list[dict[str, Any]],
) -> None:
    """Cache-aware routing on real vLLM: every replica's block size, hash scheme, hash seed
    and KV-event endpoint are the gateways' (docs/operations.md)."""
    env, gateway = _gateway_env(k8s_production)
    tokenizer_env = {k: env.pop(k) for k in tokenizer_fetch.SETTINGS}
    env.pop("FAIRWAY_ENV")  # production wants secrets that are not in the repository
    config = GatewayConfig.from_env(env)
    assert config.prefix_hash in VLLM_HASH_ALGOS
    secret_refs = [s["secretRef"]["name"] for s in gateway["envFrom"] if "secretRef" in s]
    ids = _replica_ids(k8s_production)
    assert set(config.prefix_kv_events) == set(ids)  # every registered replica, no other
    fleet = demo_fleet()
    for spec in fleet.specs:
        sts = _by(k8s_production, "StatefulSet", f"replica-{spec.version}")
        (vllm,) = _containers(sts)
        args = vllm["args"]
        assert int(_flag(args, "--block-size")) == config.prefix_block_size
        assert _flag(args, "--prefix-caching-hash-algo") == config.prefix_hash
        assert "--enable-prefix-caching" in args
        # The seed: the replicas' PYTHONHASHSEED is the Secret key the gateways read as
        # GATEWAY_PREFIX_HASH_SEED, required (both set, never one side alone).
        seed = next(e for e in vllm["env"] if e["name"] == "PYTHONHASHSEED")
        ref = seed["valueFrom"]["secretKeyRef"]
        assert ref["key"] == "GATEWAY_PREFIX_HASH_SEED" and ref["name"] in secret_refs
        assert not ref.get("optional", False)
        events = json.loads(_flag(args, "--kv-events-config"))
        assert set(events) <= VLLM_KV_EVENTS_FIELDS
        assert events["enable_kv_cache_events"] is True
        assert events["publisher"] == "zmq" and events["publisher"] in VLLM_KV_EVENTS_PUBLISHERS
        host, _, port = events["endpoint"].removeprefix("tcp://").rpartition(":")
        assert host == "*"  # bound on every address: the pod's DNS name reaches it
        ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
        assert ports["kv-events"] == int(port)
        svc = _by(k8s_production, "Service", f"replica-{spec.version}")
        service_port = {"name": "kv-events", "port": int(port), "targetPort": "kv-events"}
        assert service_port in svc["spec"]["ports"]
        for i in range(sts["spec"]["replicas"]):
            pod = f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}"
            rid = replica_name(spec.version, f"http://{pod}:8000")
            assert rid in ids
            assert config.prefix_kv_events[rid] == f"tcp://{pod}:{port}"
        # The gateway's tokenizer and chat template are the replicas' model's.
        assert "--tokenizer" not in args
        repos = dict(item.split("=", 1) for item in env["TOKENIZER_REPOS"].split(","))
        assert repos[spec.version] == args[0] == spec.weights
        for setting in tokenizer_fetch.SETTINGS:
            assert f"{spec.version}=" in tokenizer_env[setting]
    # Nothing of the seed is committed.
    for doc in k8s_production:
        if doc["kind"] == "ConfigMap":
            assert not {"GATEWAY_PREFIX_HASH_SEED", "PYTHONHASHSEED"} & set(doc["data"])


def test_gateway_pods_fetch_the_tokenizer_files_before_start(
    k8s_production: list[dict[str, Any]],
) -> None:
    env, gateway = _gateway_env(k8s_production)
    pod = _by(k8s_production, "StatefulSet", "gateway")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"] == ["run", "python", "-m", "catalog.tokenizer_fetch"]
    assert {"configMapRef": {"name": "fairway-prefix-cache"}} in init["envFrom"]
    assert {"configMapRef": {"name": "fairway-prefix-cache"}} in gateway["envFrom"]
    hf = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert hf["valueFrom"]["secretKeyRef"]["name"] == "fairway-secrets"
    mount = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["tokenizers"]
    assert {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}["tokenizers"] == mount
    files = tokenizer_fetch.plan(env)
    assert len(files) == 2 * len(demo_fleet().specs)  # tokenizer.json + tokenizer_config.json
    for url, path in files:
        assert str(path).startswith(mount + "/")
        assert url.startswith("https://huggingface.co/meta-llama/")
        assert url.endswith(f"/resolve/main/{path.name}")


def test_production_routes_by_p2c_until_real_hashes_are_checked(
    k8s_production: list[dict[str, Any]],
) -> None:
    """The index is fed (events subscribed) but cache_aware stays off in production:
    docs/operations.md, "Cache-aware routing on real vLLM", says why."""
    env, _ = _gateway_env(k8s_production)
    assert env["GATEWAY_ADMISSION_STRATEGY"] == "p2c"
    assert env["GATEWAY_PREFIX_KV_EVENTS"]
