"""docker/: the image, the compose stack, and the replica services generated from the catalog."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import yaml

from catalog import tokenizer_fetch
from catalog.deployfiles import (
    COMPOSE_FILE,
    COMPOSE_GPU_FILE,
    demo_fleet,
    render_compose,
    render_compose_gpu,
    vllm_argv,
    write_all,
)
from catalog.replica import KV_EVENTS_PORT, ServingSpec, kv_events_args, replica_argv
from tests.deploy.conftest import (
    COMPOSE_SECRETS,
    DEPLOY,
    DOCKER,
    GPU_ENV,
    GPU_FILES,
    ROOT,
    compose,
)
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
    assert render_compose_gpu(demo_fleet()) == COMPOSE_GPU_FILE.read_text()


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
            argv, catalog = vllm["entrypoint"] + vllm["command"], replica_argv(spec, engine="vllm")
            assert argv == vllm_argv(spec)  # the catalog's, publishing: as on Kubernetes
            assert argv[: len(catalog)] == catalog
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


def test_both_gateways_follow_every_replicas_kv_events(
    compose_config: dict[str, Any],
) -> None:
    """Each replica, emulator or vLLM, publishes its KV-cache events (as the emulator parses
    its flag), on the same endpoint of the same alias, and both gateways subscribe to every
    one of them (as the gateway parses its config), under the replica id the setup
    service's seed gives that replica's URL."""
    from catalog.replica import replica_name
    from emulator.kv_events import KVEventsConfig
    from gateway.config import GatewayConfig
    from tenants.management.commands.seed_demo import parse_replicas

    services = compose_config["services"]
    published: dict[str, dict[str, str]] = {"emulator": {}, "vllm": {}}  # URL -> endpoint
    for name, svc in services.items():
        engine = name.split("-", 1)[0]
        if engine not in published:
            continue
        argv = svc["command"]
        config = KVEventsConfig.from_json(argv[argv.index("--kv-events-config") + 1])
        assert config.enable_kv_cache_events and config.resolved_publisher == "zmq"
        host, port = config.endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "*" and int(port) == KV_EVENTS_PORT  # every interface of its container
        assert str(port) in svc["expose"]
        (alias,) = svc["networks"]["default"]["aliases"]
        published[engine][f"http://{alias}:8000"] = f"tcp://{alias}:{port}"
    assert len(published["emulator"]) == 4
    assert published["vllm"] == published["emulator"]  # one subscription list for both
    seed = services["setup"]["command"][-1].split()
    specs = [seed[i + 1] for i, arg in enumerate(seed) if arg == "--replicas"]
    expected = {
        replica_name(version, url): published["emulator"][url]
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


# What compose.gpu.yaml adds to the gateways' environment; nothing else of theirs changes.
GPU_GATEWAY_SETTINGS = {
    "GATEWAY_PREFIX_HASH",
    "GATEWAY_PREFIX_BLOCK_SIZE",
    "GATEWAY_PREFIX_HASH_SEED",
    *tokenizer_fetch.SETTINGS,
}


def test_the_default_profile_keeps_the_emulators_hashing_without_a_seed(
    compose_config: dict[str, Any],
) -> None:
    """compose.yaml alone (the emulator profile): rendered without a hash seed (the
    fixture's environment has none), the gateways hash as the emulator does, with no
    tokenizer files, and nothing of the gpu file is there."""
    from gateway.config import GatewayConfig

    assert "GATEWAY_PREFIX_HASH_SEED" not in COMPOSE_SECRETS
    services = compose_config["services"]
    assert "tokenizer-fetch" not in services and "tokenizers" not in compose_config["volumes"]
    for gateway in ("gateway-1", "gateway-2"):
        env = services[gateway]["environment"]
        assert not GPU_GATEWAY_SETTINGS & set(env), gateway
        gw = GatewayConfig.from_env({**env, "FAIRWAY_ENV": "development"})
        assert gw.prefix_hash == "emulator" and gw.prefix_hash_seed is None
        assert not any("tokenizers" in v for v in services[gateway]["volumes"])
    for name, svc in services.items():
        if name.startswith("vllm-"):
            assert "PYTHONHASHSEED" not in svc["environment"], name


def _normalised(svc: dict[str, Any]) -> dict[str, Any]:
    # docker-compose 1.29 merges these lists as sets: their order is not the file's.
    return {k: sorted(v, key=str) if k in ("expose", "ports", "volumes") else v
            for k, v in svc.items()}  # fmt: skip


def test_the_gpu_file_adds_to_the_gateways_and_replicas_only(
    compose_config: dict[str, Any], compose_gpu_config: dict[str, Any]
) -> None:
    base, gpu = compose_config["services"], compose_gpu_config["services"]
    assert set(gpu) - set(base) == {"tokenizer-fetch"}
    for name, svc in base.items():
        merged = gpu[name]
        if name.startswith("vllm-"):
            assert merged["environment"] == {**svc["environment"], "PYTHONHASHSEED": "1234567"}
            merged = {**merged, "environment": svc["environment"]}
        elif name in ("gateway-1", "gateway-2"):
            added = set(merged["environment"]) - set(svc["environment"])
            assert added == GPU_GATEWAY_SETTINGS, name
            assert {k: merged["environment"][k] for k in svc["environment"]} == svc["environment"]
            assert set(merged["volumes"]) - set(svc["volumes"]) == {
                "tokenizers:/app/var/tokenizers:ro"
            }
            ready = {"condition": "service_completed_successfully"}
            assert merged["depends_on"] == {**svc["depends_on"], "tokenizer-fetch": ready}
            merged = {**merged, "environment": svc["environment"], "volumes": svc["volumes"]}
            merged["depends_on"] = svc["depends_on"]
        assert _normalised(merged) == _normalised(svc), name


def test_the_gpu_file_refuses_to_render_without_the_hash_seed() -> None:
    env = {k: v for k, v in GPU_ENV.items() if k != "GATEWAY_PREFIX_HASH_SEED"}
    done = compose("config", "-q", env=env, files=GPU_FILES)
    assert done.returncode != 0 and "GATEWAY_PREFIX_HASH_SEED" in done.stderr, done.stderr
    # compose.yaml alone (whatever the profile) does not ask for it
    assert compose("config", "-q", env=env).returncode == 0


def test_gpu_replicas_and_gateways_agree_on_the_prefix_cache(
    compose_gpu_config: dict[str, Any],
) -> None:
    """The gpu profile's cache-aware routing on real vLLM, as tests/deploy/test_k8s.py
    checks it for Kubernetes: every vLLM service's block size, hash scheme, hash seed and
    KV-event endpoint are the gateways', and the gateways' tokenizer files are the ones
    tokenizer-fetch writes, from the repository the replicas load, onto the volume they
    mount read-only (docs/operations.md, "Cache-aware routing on real vLLM")."""
    from catalog.replica import replica_name
    from gateway.config import GatewayConfig

    services = compose_gpu_config["services"]
    fetch = services["tokenizer-fetch"]
    assert fetch["profiles"] == ["gpu"] and fetch["restart"] == "no"
    assert fetch["command"] == ["run", "python", "-m", "catalog.tokenizer_fetch"]
    assert set(fetch["environment"]) >= {"HF_TOKEN", "HF_ENDPOINT", "TOKENIZER_REVISION"}
    (volume,) = fetch["volumes"]
    name, mount, mode = volume.split(":")
    assert mode == "rw" and name in compose_gpu_config["volumes"]
    files = tokenizer_fetch.plan(fetch["environment"])
    assert len(files) == 2 * len(demo_fleet().specs)  # tokenizer.json + tokenizer_config.json
    for url, path in files:
        assert str(path).startswith(mount + "/")
        assert url.startswith("https://huggingface.co/meta-llama/")  # HF_ENDPOINT unset
        assert url.endswith(f"/resolve/main/{path.name}")  # TOKENIZER_REVISION unset
    repos = dict(item.split("=", 1) for item in fetch["environment"]["TOKENIZER_REPOS"].split(","))
    envs = []
    for gateway in ("gateway-1", "gateway-2"):
        svc = services[gateway]
        env = dict(svc["environment"])
        assert f"{name}:{mount}:ro" in svc["volumes"]
        assert svc["depends_on"]["tokenizer-fetch"]["condition"] == "service_completed_successfully"
        for setting in tokenizer_fetch.SETTINGS:
            assert env.pop(setting) == fetch["environment"][setting]  # read where written
        envs.append(env)
    assert envs[0] == envs[1]
    config = GatewayConfig.from_env({**envs[0], "FAIRWAY_ENV": "development"})
    assert config.prefix_hash == "sha256"
    assert config.prefix_hash_seed == GPU_ENV["GATEWAY_PREFIX_HASH_SEED"]
    fleet = demo_fleet()
    for spec in fleet.specs:
        for host in fleet.compose_hosts(spec):
            vllm = services[f"vllm-{host.removeprefix('replica-')}"]
            args = vllm["command"]
            assert int(_flag(args, "--block-size")) == config.prefix_block_size
            assert _flag(args, "--prefix-caching-hash-algo") == config.prefix_hash
            assert "--enable-prefix-caching" in args
            # the first block's parent hash: the same variable on both sides
            assert vllm["environment"]["PYTHONHASHSEED"] == config.prefix_hash_seed
            events = json.loads(_flag(args, "--kv-events-config"))
            port = events["endpoint"].rpartition(":")[2]
            assert port in vllm["expose"]
            rid = replica_name(spec.version, f"http://{host}:8000")
            assert config.prefix_kv_events[rid] == f"tcp://{host}:{port}"
            # the gateway's tokenizer and chat template are the replica's model's
            assert "--tokenizer" not in args
            assert repos[spec.version] == args[0] == spec.weights


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_image_owns_the_mount_points_of_the_volumes_it_writes(
    compose_gpu_config: dict[str, Any],
) -> None:
    """A new named volume takes the owner of the image's directory it is mounted on (root
    when the image lacks it): every volume a Fairway service writes under /app/var is a
    directory the Dockerfile creates for the image's user."""
    text = (DOCKER / "Dockerfile").read_text()
    made = re.search(r"mkdir -p ([^\\\n&]+)", text)
    assert made and "chown -R fairway:fairway var" in text
    created = {f"/app/{d}" for d in made.group(1).split()}
    for name, svc in compose_gpu_config["services"].items():
        if not svc.get("image", "").startswith("fairway"):
            continue
        for volume in svc.get("volumes", []):
            _, target, mode = volume.split(":")
            if target.startswith("/app/var/") and mode == "rw":
                assert target in created, (name, target)


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


def test_each_compose_role_is_one_the_image_knows(
    compose_config: dict[str, Any], compose_gpu_config: dict[str, Any]
) -> None:
    entrypoint = (DOCKER / "entrypoint.sh").read_text()
    roles = set(re.findall(r"^  ([a-z]+)\)$", entrypoint, re.M))
    assert {"controlplane", "gateway", "worker", "beat", "consumer", "run"} <= roles
    everything = {**compose_config["services"], **compose_gpu_config["services"]}
    for name, svc in everything.items():
        if svc.get("image", "").startswith(("${FAIRWAY_IMAGE", "fairway:")) or "build" in svc:
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
