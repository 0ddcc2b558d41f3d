"""The replica parts of the deployment files, generated from the catalog.

``manage.py deploy_files`` writes them; a test checks the committed files equal what this
module generates for the demo catalog (``tenants.demo.MODELS``), so a change of flags in
``catalog.replica`` or of a version in the catalog shows up as a diff in review.

- ``docker/compose.yaml``: between the ``BEGIN/END generated replicas`` markers, one
  emulator service per replica (profile ``emulator``, the default through docker/.env) and
  one vLLM service per replica (profile ``gpu``), both answering to the same network alias
  ``replica-<version>-<n>``, so the catalog's replica URLs are the same for both; and the
  ``setup`` service that migrates and seeds the catalog with those URLs. Both engines
  publish their KV-cache events (``--kv-events-config`` on ``:5557``; the vLLM services
  with the block size and hash scheme explicit, ``catalog.replica.prefix_cache_args``, as
  on Kubernetes) and, between the ``BEGIN/END generated kv events`` markers in the
  gateways' environment, both gateways subscribe to every replica's endpoint
  (``GATEWAY_PREFIX_KV_EVENTS``, keyed by the replica ids the seed gives those URLs; one
  list for both profiles, since the aliases are the same).
- ``docker/compose.gpu.yaml``, all generated: what the ``gpu`` profile adds for the
  gateways to hash as real vLLM does, in a file of its own because compose cannot give a
  service settings per profile, and the ``emulator`` profile's gateways must keep the
  emulator's hashing and must not require a hash seed. Given after compose.yaml (``-f
  docker/compose.yaml -f docker/compose.gpu.yaml``, with ``COMPOSE_PROFILES=gpu``), it
  gives every vLLM service ``PYTHONHASHSEED`` from the variable ``GATEWAY_PREFIX_HASH_SEED``
  (required: compose refuses to render without it), adds a one-shot ``tokenizer-fetch``
  service (profile ``gpu``; ``catalog.tokenizer_fetch``) that writes each model's tokenizer
  files into the ``tokenizers`` volume, and gives both gateways that volume read-only, the
  same seed, and the block size, hash scheme and tokenizer files of ``prefix_config`` (the
  Kubernetes ConfigMap's values), starting them only after the fetch succeeded.
- ``deploy/k8s/base/replicas.yaml``: per version a StatefulSet of vLLM pods behind a
  headless Service (the gateway routes to each replica by its own address, so each pod has
  a stable DNS name: ``replica-<version>-<i>.replica-<version>``), and the catalog's
  replica URLs in a ConfigMap that the seed Job reads. The pods publish their KV-cache
  events on ``:5557`` of that name, with the block size and hash scheme set explicitly
  (``catalog.replica.prefix_cache_args``) and ``PYTHONHASHSEED`` from the Secret's
  ``GATEWAY_PREFIX_HASH_SEED``, the same key the gateways read; the ConfigMap
  ``fairway-prefix-cache`` (the gateways' ``envFrom``) gives them the same block size and
  scheme, every pod's event endpoint, and where their init container puts each model's
  tokenizer files (``catalog.tokenizer_fetch``). docs/operations.md, "Cache-aware routing
  on real vLLM".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from catalog import tokenizer_fetch
from catalog.replica import (
    KV_BLOCK_SIZE,
    KV_EVENTS_PORT,
    PREFIX_HASH_ALGO,
    REPLICA_PORT,
    ServingSpec,
    kv_events_args,
    prefix_cache_args,
    replica_argv,
    replica_name,
)

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
COMPOSE_GPU_FILE = ROOT / "docker" / "compose.gpu.yaml"
K8S_REPLICAS_FILE = ROOT / "deploy" / "k8s" / "base" / "replicas.yaml"
BEGIN = "  # BEGIN generated replicas (manage.py deploy_files; do not edit by hand)\n"
END = "  # END generated replicas\n"
KV_EVENTS_BEGIN = (
    "      # BEGIN generated kv events (manage.py deploy_files; do not edit by hand)\n"
)
KV_EVENTS_END = "      # END generated kv events\n"
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
FAIRWAY_IMAGE = "${FAIRWAY_IMAGE:-fairway:dev}"
REPLICAS_PER_VERSION = 2
# The gateways' cache-aware settings (Kubernetes: a ConfigMap in replicas.yaml, generated
# with the replicas it names), the Secret key (compose: the variable) both sides take the
# hash seed from, and where the models' tokenizer files are put for the gateways (the
# gateway pod's init container; compose's tokenizer-fetch service and volume).
PREFIX_CONFIG = "fairway-prefix-cache"
SECRETS = "fairway-secrets"
HASH_SEED_KEY = "GATEWAY_PREFIX_HASH_SEED"
TOKENIZER_DIR = "/app/var/tokenizers"
TOKENIZER_VOLUME = "tokenizers"
GATEWAYS = ("gateway-1", "gateway-2")


@dataclass(frozen=True, slots=True)
class Fleet:
    specs: tuple[ServingSpec, ...]
    replicas_per_version: int = REPLICAS_PER_VERSION

    def compose_hosts(self, spec: ServingSpec) -> list[str]:
        return [f"replica-{spec.version}-{n}" for n in range(1, self.replicas_per_version + 1)]

    def k8s_hosts(self, spec: ServingSpec) -> list[str]:
        name = f"replica-{spec.version}"
        return [f"{name}-{i}.{name}" for i in range(self.replicas_per_version)]


def demo_fleet() -> Fleet:
    from tenants.demo import MODELS

    return Fleet(tuple(ServingSpec.of(m) for m in MODELS))


def replica_url(host: str) -> str:
    return f"http://{host}:{REPLICA_PORT}"


def seed_args(fleet: Fleet, hosts: Any) -> list[str]:
    args: list[str] = []
    for spec in fleet.specs:
        urls = ",".join(replica_url(h) for h in hosts(spec))
        args += ["--replicas", f"{spec.version}={urls}"]
    return args


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1000)


# -- what the replicas and the gateways share -------------------------------------------


def vllm_argv(spec: ServingSpec) -> list[str]:
    """A deployed vLLM replica's command (compose's ``gpu`` profile, Kubernetes): the
    catalog's, its block size and hash scheme explicit, publishing its KV-cache events."""
    return replica_argv(spec, engine="vllm") + prefix_cache_args() + kv_events_args()


def prefix_config(fleet: Fleet, hosts: Any = None) -> dict[str, str]:
    """The gateways' side of what the replicas' prefix caches are (``fairway-prefix-cache``;
    compose's gpu file), with the event endpoints of ``hosts`` (Kubernetes' by default).
    The hash seed is not here: it is a secret, in ``fairway-secrets`` (compose: the
    variable ``GATEWAY_PREFIX_HASH_SEED``) for both sides."""

    def files(name: str) -> str:
        return ",".join(f"{s.version}={TOKENIZER_DIR}/{s.version}/{name}" for s in fleet.specs)

    return {
        "GATEWAY_PREFIX_HASH": PREFIX_HASH_ALGO,
        "GATEWAY_PREFIX_BLOCK_SIZE": str(KV_BLOCK_SIZE),
        "GATEWAY_PREFIX_KV_EVENTS": kv_events_setting(fleet, hosts or fleet.k8s_hosts),
        "GATEWAY_TOKENIZER_FILES": files("tokenizer.json"),
        "GATEWAY_CHAT_TEMPLATES": files("tokenizer_config.json"),
        # catalog.tokenizer_fetch: the repository of each version's files (its weights).
        "TOKENIZER_REPOS": ",".join(f"{s.version}={s.weights}" for s in fleet.specs),
    }


# -- compose ------------------------------------------------------------------------------


def compose_services(fleet: Fleet) -> dict[str, Any]:
    services: dict[str, Any] = {
        "setup": {
            "image": FAIRWAY_IMAGE,
            "environment": "*fairway-env",
            "entrypoint": ["/usr/local/bin/entrypoint.sh", "run"],
            "command": [
                "sh",
                "-c",
                "python manage.py migrate --noinput"
                " && python manage.py seed_demo "
                + " ".join(seed_args(fleet, fleet.compose_hosts))
                + " --keys-out /app/var/demo-keys.json"
                " && python manage.py push_config",
            ],
            "depends_on": {
                "postgres": {"condition": "service_healthy"},
                "redis": {"condition": "service_healthy"},
            },
            "volumes": ["setup-var:/app/var"],
            "restart": "no",
        }
    }
    for spec in fleet.specs:
        for host in fleet.compose_hosts(spec):
            suffix = host.removeprefix("replica-")
            services[f"emulator-{suffix}"] = {
                "image": FAIRWAY_IMAGE,
                "profiles": ["emulator"],
                "entrypoint": ["/usr/local/bin/entrypoint.sh", "run"],
                "command": replica_argv(spec, engine="emulator") + kv_events_args(),
                "expose": [str(REPLICA_PORT), str(KV_EVENTS_PORT)],
                "environment": {"FAIRWAY_ROLE": "emulator", "PORT": str(REPLICA_PORT)},
                "networks": {"default": {"aliases": [host]}},
                "restart": "unless-stopped",
            }
            argv = vllm_argv(spec)
            services[f"vllm-{suffix}"] = {
                "image": VLLM_IMAGE,
                "profiles": ["gpu"],
                "entrypoint": argv[:2],
                "command": argv[2:],
                "expose": [str(REPLICA_PORT), str(KV_EVENTS_PORT)],
                "environment": {"HF_TOKEN": "${HF_TOKEN:-}"},
                "volumes": ["hf-cache:/root/.cache/huggingface"],
                "ipc": "host",
                "networks": {"default": {"aliases": [host]}},
                "healthcheck": {
                    "test": [
                        "CMD",
                        "python3",
                        "-c",
                        "import urllib.request as u; "
                        f"u.urlopen('http://127.0.0.1:{REPLICA_PORT}/health', timeout=4)",
                    ],
                    "interval": "15s",
                    "timeout": "5s",
                    "retries": 3,
                    # Loading 140 GB of weights and capturing CUDA graphs takes minutes.
                    "start_period": "900s",
                },
                "deploy": {
                    "resources": {
                        "reservations": {
                            "devices": [
                                {
                                    "driver": "nvidia",
                                    "count": spec.tensor_parallel_size,
                                    "capabilities": ["gpu"],
                                }
                            ]
                        }
                    }
                },
                "restart": "unless-stopped",
            }
    return services


def compose_block(fleet: Fleet) -> str:
    text = _dump(compose_services(fleet))
    # The shared environment is a YAML alias of the hand-written file's anchor.
    text = text.replace("environment: '*fairway-env'", "environment: *fairway-env")
    body = "".join(f"  {line}\n" if line else "\n" for line in text.splitlines())
    return BEGIN + body + END


def kv_event_endpoints(fleet: Fleet, hosts: Any = None) -> dict[str, str]:
    """Replica id -> its KV-event endpoint, for every replica (of compose, or of ``hosts``):
    the gateways' ``GATEWAY_PREFIX_KV_EVENTS``."""
    hosts = hosts or fleet.compose_hosts
    return {
        replica_name(spec.version, replica_url(host)): f"tcp://{host}:{KV_EVENTS_PORT}"
        for spec in fleet.specs
        for host in hosts(spec)
    }


def kv_events_setting(fleet: Fleet, hosts: Any = None) -> str:
    return ",".join(f"{rid}={ep}" for rid, ep in kv_event_endpoints(fleet, hosts).items())


def kv_events_block(fleet: Fleet) -> str:
    line = _dump({"GATEWAY_PREFIX_KV_EVENTS": kv_events_setting(fleet)}).strip()
    return KV_EVENTS_BEGIN + f"      {line}\n" + KV_EVENTS_END


def _region(current: str, begin: str, end: str, block: str, what: str) -> str:
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(current):
        raise ValueError(f"docker/compose.yaml has no generated-{what} markers")
    return pattern.sub(lambda _: block, current, count=1)


def render_compose(current: str, fleet: Fleet) -> str:
    text = _region(current, BEGIN, END, compose_block(fleet), "replicas")
    return _region(text, KV_EVENTS_BEGIN, KV_EVENTS_END, kv_events_block(fleet), "kv events")


# -- compose: the gpu profile's file -------------------------------------------------------


def compose_gpu_services(fleet: Fleet) -> dict[str, Any]:
    """docker/compose.gpu.yaml's services, which compose merges into compose.yaml's."""
    seed = f"${{{HASH_SEED_KEY}:?set {HASH_SEED_KEY} (gpu profile: an integer in 0..4294967295)}}"
    config = prefix_config(fleet, fleet.compose_hosts)
    files = {k: config[k] for k in tokenizer_fetch.SETTINGS}
    # GATEWAY_PREFIX_KV_EVENTS is compose.yaml's already (the same aliases for both engines).
    gateway_env = {
        "GATEWAY_PREFIX_HASH": config["GATEWAY_PREFIX_HASH"],
        "GATEWAY_PREFIX_BLOCK_SIZE": config["GATEWAY_PREFIX_BLOCK_SIZE"],
        HASH_SEED_KEY: seed,
        **files,
    }
    services: dict[str, Any] = {
        "tokenizer-fetch": {
            "image": FAIRWAY_IMAGE,
            "profiles": ["gpu"],
            "command": ["run", "python", "-m", "catalog.tokenizer_fetch"],
            "environment": {
                "TOKENIZER_REPOS": config["TOKENIZER_REPOS"],
                **files,
                "HF_TOKEN": "${HF_TOKEN:-}",
                "HF_ENDPOINT": "${HF_ENDPOINT:-}",
                "TOKENIZER_REVISION": "${TOKENIZER_REVISION:-}",
            },
            "volumes": [f"{TOKENIZER_VOLUME}:{TOKENIZER_DIR}"],
            "restart": "no",
        }
    }
    for name in GATEWAYS:
        services[name] = {
            "environment": dict(gateway_env),
            "volumes": [f"{TOKENIZER_VOLUME}:{TOKENIZER_DIR}:ro"],
            "depends_on": {"tokenizer-fetch": {"condition": "service_completed_successfully"}},
        }
    for spec in fleet.specs:
        for host in fleet.compose_hosts(spec):
            # The first block's parent hash; the gateways read the same variable.
            services[f"vllm-{host.removeprefix('replica-')}"] = {
                "environment": {"PYTHONHASHSEED": seed}
            }
    return services


COMPOSE_GPU_HEADER = (
    "# Generated by `manage.py deploy_files` from the catalog (catalog/deployfiles.py);\n"
    "# do not edit by hand. The gpu profile's cache-aware routing, merged into compose.yaml:\n"
    "# with COMPOSE_PROFILES=gpu and GATEWAY_PREFIX_HASH_SEED in docker/.env,\n"
    "#   docker compose -f docker/compose.yaml -f docker/compose.gpu.yaml up -d\n"
    '# (docs/operations.md, "Cache-aware routing on real vLLM"). Not for the emulator\n'
    "# profile, whose gateways keep the emulator's hashing.\n"
)


def render_compose_gpu(fleet: Fleet) -> str:
    services = compose_gpu_services(fleet)
    return COMPOSE_GPU_HEADER + _dump({"services": services, "volumes": {TOKENIZER_VOLUME: {}}})


# -- kubernetes ---------------------------------------------------------------------------


def k8s_documents(fleet: Fleet) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    urls = {" ".join(seed_args(fleet, fleet.k8s_hosts))}
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "fairway-replicas"},
            "data": {"REPLICA_ARGS": urls.pop()},
        }
    )
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": PREFIX_CONFIG},
            "data": prefix_config(fleet),
        }
    )
    for spec in fleet.specs:
        name = f"replica-{spec.version}"
        labels = {"app.kubernetes.io/name": "replica", "fairway.dev/model-version": spec.version}
        argv = vllm_argv(spec)
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "clusterIP": "None",  # headless: one DNS name per pod
                    "publishNotReadyAddresses": False,
                    "selector": labels,
                    "ports": [
                        {"name": "http", "port": REPLICA_PORT, "targetPort": "http"},
                        {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": "kv-events"},
                    ],
                },
            }
        )
        gpus = str(spec.tensor_parallel_size)
        docs.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "serviceName": name,
                    "replicas": fleet.replicas_per_version,
                    "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {
                            "labels": labels,
                            "annotations": {
                                "prometheus.io/scrape": "true",
                                "prometheus.io/port": str(REPLICA_PORT),
                            },
                        },
                        "spec": {
                            "terminationGracePeriodSeconds": 60,
                            "nodeSelector": {"nvidia.com/gpu.present": "true"},
                            "tolerations": [
                                {
                                    "key": "nvidia.com/gpu",
                                    "operator": "Exists",
                                    "effect": "NoSchedule",
                                }
                            ],
                            "containers": [
                                {
                                    "name": "vllm",
                                    "image": VLLM_IMAGE,
                                    "command": argv[:2],
                                    "args": argv[2:],
                                    "ports": [
                                        {"name": "http", "containerPort": REPLICA_PORT},
                                        {"name": "kv-events", "containerPort": KV_EVENTS_PORT},
                                    ],
                                    "env": [
                                        {
                                            "name": "HF_TOKEN",
                                            "valueFrom": {
                                                "secretKeyRef": {
                                                    "name": SECRETS,
                                                    "key": "HF_TOKEN",
                                                    "optional": True,
                                                }
                                            },
                                        },
                                        {
                                            # The first block's parent hash; the gateways
                                            # read the same key (envFrom the Secret).
                                            "name": "PYTHONHASHSEED",
                                            "valueFrom": {
                                                "secretKeyRef": {
                                                    "name": SECRETS,
                                                    "key": HASH_SEED_KEY,
                                                }
                                            },
                                        },
                                    ],
                                    "resources": {
                                        "requests": {
                                            "cpu": "8",
                                            "memory": "64Gi",
                                            "nvidia.com/gpu": gpus,
                                        },
                                        "limits": {"nvidia.com/gpu": gpus},
                                    },
                                    "startupProbe": {
                                        "httpGet": {"path": "/health", "port": "http"},
                                        "periodSeconds": 10,
                                        "failureThreshold": 90,  # 15 min to load weights
                                    },
                                    "readinessProbe": {
                                        "httpGet": {"path": "/health", "port": "http"},
                                        "periodSeconds": 5,
                                    },
                                    "livenessProbe": {
                                        "httpGet": {"path": "/health", "port": "http"},
                                        "periodSeconds": 15,
                                        "failureThreshold": 4,
                                    },
                                    "volumeMounts": [
                                        {
                                            "name": "hf-cache",
                                            "mountPath": "/root/.cache/huggingface",
                                        },
                                        {"name": "shm", "mountPath": "/dev/shm"},  # noqa: S108 - vLLM's shared memory
                                    ],
                                }
                            ],
                            "volumes": [
                                {
                                    "name": "shm",
                                    "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"},
                                }
                            ],
                        },
                    },
                    "volumeClaimTemplates": [
                        {
                            "metadata": {"name": "hf-cache"},
                            "spec": {
                                "accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": "300Gi"}},
                            },
                        }
                    ],
                },
            }
        )
    return docs


HEADER = (
    "# Generated by `manage.py deploy_files` from the catalog (catalog/deployfiles.py);\n"
    "# do not edit by hand.\n"
)


def render_k8s(fleet: Fleet) -> str:
    return HEADER + "---\n".join(_dump(doc) for doc in k8s_documents(fleet))


def write_all(fleet: Fleet, *, check: bool) -> list[Path]:
    """Write (or with ``check``, compare) the generated files; returns those that differ."""
    outputs = {
        COMPOSE_FILE: render_compose(COMPOSE_FILE.read_text(), fleet),
        COMPOSE_GPU_FILE: render_compose_gpu(fleet),
        K8S_REPLICAS_FILE: render_k8s(fleet),
    }
    stale: list[Path] = []
    for path, text in outputs.items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return stale


def fleet_from(specs: Sequence[ServingSpec], per_version: int) -> Fleet:
    return Fleet(tuple(specs), per_version)
