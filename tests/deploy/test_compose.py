"""docker/: the image, the compose stack, and the replica services generated from the catalog."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import yaml

from catalog.deployfiles import COMPOSE_FILE, demo_fleet, render_compose, write_all
from catalog.replica import KV_EVENTS_PORT, ServingSpec, kv_events_args, replica_argv
from tests.deploy.conftest import COMPOSE_SECRETS, DEPLOY, DOCKER, ROOT, compose
from tests.support import free_port


def test_compose_config_is_valid_offline() -> None:
    done = compose("config", "-q")
    assert done.returncode == 0, done.stderr


def test_compose_refuses_to_render_without_each_secret() -> None:
    from tests.deploy.conftest import COMPOSE_SECRETS

    for name in COMPOSE_SECRETS:
        env = {k: v for k, v in COMPOSE_SECRETS.items() if k != name}
        done = compose("config", "-q", env=env)
        assert done.returncode != 0 and name in done.stderr, (name, done.stderr)


def test_generated_replica_services_are_up_to_date() -> None:
    # `manage.py deploy_files --demo --check` in-process: nothing differs.
    assert write_all(demo_fleet(), check=True) == []
    assert render_compose(COMPOSE_FILE.read_text(), demo_fleet()) == COMPOSE_FILE.read_text()


def _spec(version: str) -> ServingSpec:
    return next(s for s in demo_fleet().specs if s.version == version)


def test_every_replica_runs_the_catalog_command(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    fleet = demo_fleet()
    for spec in fleet.specs:
        for host in fleet.compose_hosts(spec):
            suffix = host.removeprefix("replica-")
            emu, vllm = services[f"emulator-{suffix}"], services[f"vllm-{suffix}"]
            assert emu["command"] == replica_argv(spec, engine="emulator") + kv_events_args()
            assert vllm["entrypoint"] + vllm["command"] == replica_argv(spec, engine="vllm")
            # One address for either engine: the catalog's URL does not depend on it.
            assert emu["networks"]["default"]["aliases"] == [host]
            assert vllm["networks"]["default"]["aliases"] == [host]
            assert emu["profiles"] == ["emulator"] and vllm["profiles"] == ["gpu"]
            gpus = vllm["deploy"]["resources"]["reservations"]["devices"][0]["count"]
            assert gpus == spec.tensor_parallel_size
    seed = " ".join(services["setup"]["command"])
    for spec in fleet.specs:
        urls = ",".join(f"http://{h}:8000" for h in fleet.compose_hosts(spec))
        assert f"--replicas {spec.version}={urls}" in seed
    vllm70 = " ".join(services["vllm-llama-70b-2026-05-1"]["command"])
    for flag in (
        "--served-model-name llama-70b-2026-05",
        "--max-model-len 131072",
        "--tensor-parallel-size 4",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--long-prefill-token-threshold 5242",
        "--scheduling-policy priority",
        "--enable-prompt-tokens-details",
        "--tool-call-parser llama3_json",
    ):
        assert flag in vllm70
    assert _spec("llama-70b-2026-05").weights in vllm70


def test_both_gateways_follow_every_emulated_replicas_kv_events(
    compose_config: dict[str, Any],
) -> None:
    """Each emulator publishes its KV-cache events (as the emulator parses its flag), and
    both gateways subscribe to every one of them (as the gateway parses its config), under
    the replica id the setup service's seed gives that replica's URL."""
    from catalog.replica import replica_name
    from emulator.kv_events import KVEventsConfig
    from gateway.config import GatewayConfig
    from tenants.management.commands.seed_demo import parse_replicas

    services = compose_config["services"]
    published: dict[str, str] = {}  # replica URL -> the endpoint a gateway reaches it at
    for name, svc in services.items():
        argv = svc.get("command") or []
        if name.startswith("vllm-"):
            # real vLLM's hashes come from the real tokenizer and a random hash seed: the
            # gateway's index cannot match them, so they are not published
            assert "--kv-events-config" not in argv, name
        if not name.startswith("emulator-"):
            continue
        config = KVEventsConfig.from_json(argv[argv.index("--kv-events-config") + 1])
        assert config.enable_kv_cache_events and config.resolved_publisher == "zmq"
        host, port = config.endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "*" and int(port) == KV_EVENTS_PORT  # every interface of its container
        assert str(port) in svc["expose"]
        (alias,) = svc["networks"]["default"]["aliases"]
        published[f"http://{alias}:8000"] = f"tcp://{alias}:{port}"
    assert len(published) == 4
    seed = services["setup"]["command"][-1].split()
    specs = [seed[i + 1] for i, arg in enumerate(seed) if arg == "--replicas"]
    expected = {
        replica_name(version, url): published[url]
        for version, entries in parse_replicas(specs).items()
        for url, _ in entries
    }
    for gateway in ("gateway-1", "gateway-2"):
        env = services[gateway]["environment"]
        gw = GatewayConfig.from_env({**env, "FAIRWAY_ENV": "development"})
        assert dict(gw.prefix_kv_events) == expected, gateway
        # with events, a prompt nobody holds is placed as P2C places it (not by rendezvous)
        assert not gw.admission.affinity_rendezvous
        assert gw.admission.strategy == "p2c"  # cache-aware stays opt-in
        assert env["FAIRWAY_KEY_PEPPER"] == "p" * 32  # and the shared environment is kept
    done = compose("config", env={**COMPOSE_SECRETS, "GATEWAY_ADMISSION_STRATEGY": "cache_aware"})
    assert done.returncode == 0, done.stderr
    opted = yaml.safe_load(done.stdout)["services"]
    for gateway in ("gateway-1", "gateway-2"):
        assert opted[gateway]["environment"]["GATEWAY_ADMISSION_STRATEGY"] == "cache_aware"


def test_the_stack_has_its_parts_wired(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    for name in (
        "postgres", "redis", "kafka", "kafka-init", "setup", "controlplane", "worker", "beat",
        "consumer", "gateway-1", "gateway-2", "lb", "prometheus", "grafana",
    ):  # fmt: skip
        assert name in services, name
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    topic = services["kafka-init"]["command"]
    assert topic[topic.index("--topic") + 1] == "usage.v1"
    assert int(topic[topic.index("--partitions") + 1]) >= 2
    # Every platform process waits for the schema and the topic; secrets come from the env.
    for name in ("controlplane", "worker", "beat", "consumer", "gateway-1", "gateway-2"):
        svc = services[name]
        assert svc["depends_on"]["setup"]["condition"] == "service_completed_successfully"
        assert svc["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
        assert svc["environment"]["FAIRWAY_KEY_PEPPER"] == "p" * 32
        assert svc["environment"]["DJANGO_SETTINGS_MODULE"] == "fairway.settings.production"
    # The consumer's metrics are reachable from Prometheus' container, not loopback only.
    consumer_env = services["consumer"]["environment"]
    assert consumer_env["FAIRWAY_INGEST_METRICS_ADDR"] == "0.0.0.0"
    assert consumer_env["FAIRWAY_INGEST_METRICS_PORT"] == "9108"
    # Each gateway keeps its own usage spool on a volume, and is given time to drain.
    spools = {services[g]["volumes"][0].split(":")[0] for g in ("gateway-1", "gateway-2")}
    assert len(spools) == 2
    assert services["gateway-1"]["stop_grace_period"] in ("1m", "60s", "1m0s")
    # Metrics on their own port, scraped there by Prometheus and the console.
    gateway_env = services["gateway-1"]["environment"]
    metrics = gateway_env["GATEWAY_METRICS_PORT"]
    assert metrics in services["gateway-1"]["expose"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "gateway"]
    assert job["static_configs"][0]["targets"] == [f"gateway-{i}:{metrics}" for i in (1, 2)]
    console_urls = gateway_env["FAIRWAY_GATEWAY_METRICS_URLS"].split(",")
    assert console_urls == [f"http://gateway-{i}:{metrics}/metrics" for i in (1, 2)]
    # The load balancer sends API traffic to both gateways, unbuffered (SSE).
    nginx = (DOCKER / "nginx" / "nginx.conf").read_text()
    assert "server gateway-1:8080" in nginx and "server gateway-2:8080" in nginx
    assert "proxy_buffering off" in nginx
    assert "location = /metrics { return 404; }" in nginx  # tenant ids stay internal


def test_each_compose_role_is_one_the_image_knows(compose_config: dict[str, Any]) -> None:
    entrypoint = (DOCKER / "entrypoint.sh").read_text()
    roles = set(re.findall(r"^  ([a-z]+)\)$", entrypoint, re.M))
    assert {"controlplane", "gateway", "worker", "beat", "consumer", "run"} <= roles
    for name, svc in compose_config["services"].items():
        if svc.get("image", "").startswith("${FAIRWAY_IMAGE") or "build" in svc:
            role = svc.get("entrypoint", [None, None])[1] if svc.get("entrypoint") else None
            role = role or svc["command"][0]
            assert role in roles, (name, role)
    assert subprocess.run(["sh", "-n", str(DOCKER / "entrypoint.sh")], check=False).returncode == 0


def test_dockerfile_is_multistage_pinned_and_non_root() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base.group(1))
    assert len(re.findall(r"^FROM ", text, re.M)) == 2
    assert re.search(r"^USER fairway:fairway$", text, re.M)
    assert "HEALTHCHECK" in text
    # Every package the image's processes import is copied in.
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    packages = {"fairway", "tenants", "catalog", "metering", "billing", "contracts", "gateway"}
    assert packages | {"emulator"} <= copied
    for package in copied:
        assert (ROOT / package / "__init__.py").exists()


def test_the_health_check_follows_the_role(tmp_path: Any) -> None:
    from emulator.testing import spawn_emulator

    def check(role: str, port: int | None = None) -> int:
        env = {"PATH": "/usr/bin:/bin", "FAIRWAY_ROLE": role}
        if port is not None:
            env["PORT"] = str(port)
        done = subprocess.run(
            [sys.executable, str(DOCKER / "healthcheck.py")], env=env, timeout=30, check=False
        )
        return done.returncode

    with spawn_emulator("llama-8b-tp1-h100", "m", 10.0) as emu:
        assert check("emulator", int(emu.base_url.rsplit(":", 1)[1])) == 0
    assert check("emulator", free_port()) == 1  # nothing listening: unhealthy
    assert check("gateway", free_port()) == 1
    assert check("run") == 0 and check("migrate") == 0


def test_nginx_accepts_the_load_balancer_config(tmp_path: Any) -> None:
    """`nginx -t` on the committed config; the compose service names (resolved by Docker's
    DNS at start) are swapped for loopback addresses, nothing else changes."""
    from tests.deploy.conftest import tool

    text = (DOCKER / "nginx" / "nginx.conf").read_text()
    names = {"gateway-1:8080": "127.0.0.1:18081", "gateway-2:8080": "127.0.0.1:18082"}
    names["controlplane:8000"] = "127.0.0.1:18000"
    for name, addr in names.items():
        assert f"server {name}" in text
        text = text.replace(f"server {name}", f"server {addr}")
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    done = subprocess.run(
        [tool("nginx"), "-t", "-c", str(conf), "-p", str(tmp_path), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # And it would refuse a broken one (the check is not vacuous).
    conf.write_text(text.replace("proxy_buffering off;", "proxy_buffering sideways;"))
    bad = subprocess.run(
        [tool("nginx"), "-t", "-c", str(conf), "-p", str(tmp_path), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert bad.returncode != 0 and "proxy_buffering" in bad.stderr


def test_the_documented_replica_command_is_the_generated_one() -> None:
    from catalog.replica import shell

    docs = (ROOT / "docs" / "operations.md").read_text()
    (line,) = [ln for ln in docs.splitlines() if ln.startswith("vllm serve ")]
    assert line == shell(replica_argv(_spec("llama-70b-2026-05"), engine="vllm"))


def test_the_image_collects_static_files_with_its_build_time_settings() -> None:
    """The Dockerfile's collectstatic step, with exactly its placeholder environment:
    the production settings accept it (no secret, no connection needed)."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    step = re.search(r"RUN env (.*?) python manage\.py collectstatic --noinput", text)
    assert step, "the Dockerfile collects static files"
    env = dict(pair.split("=", 1) for pair in step.group(1).split())
    assert "SECRET_KEY" in env and "DATABASE_URL" in env
    done = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "--dry-run"],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "fairway.settings.production",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "static files copied" in done.stdout
