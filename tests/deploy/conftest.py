"""Offline checks of the deployment files: the tools they need and the rendered outputs."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.support import ROOT

DOCKER = ROOT / "docker"
DEPLOY = ROOT / "deploy"
# Dummy values only to satisfy the compose file's mandatory-variable checks.
COMPOSE_SECRETS = {
    "POSTGRES_PASSWORD": "x" * 16,
    "SECRET_KEY": "s" * 50,
    "FAIRWAY_KEY_PEPPER": "p" * 32,
    "FAIRWAY_CACHE_SALT_KEY": "c" * 32,
    "GRAFANA_ADMIN_PASSWORD": "g" * 16,
    "GATEWAY_METRICS_TOKEN": "m" * 32,
}
# The gpu profile's file (generated: catalog/deployfiles.py), given after compose.yaml, and
# what it requires besides: the replicas' and gateways' hash seed (a dummy value).
GPU_FILES = ("compose.yaml", "compose.gpu.yaml")
GPU_ENV = {**COMPOSE_SECRETS, "COMPOSE_PROFILES": "gpu", "GATEWAY_PREFIX_HASH_SEED": "1234567"}


def tool(name: str) -> str:
    """The path of a command-line tool that `make test` installs (Makefile: system-tools);
    nginx lives in /usr/sbin, which a user's PATH may lack."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        pytest.fail(f"{name} is not installed: `make system-tools` installs it (apt)")
    return path


def compose(
    *args: str, env: dict[str, str] | None = None, files: tuple[str, ...] = ("compose.yaml",)
) -> subprocess.CompletedProcess[str]:
    """Debian's docker-compose (v1.29, Python): `config` parses, interpolates, merges the
    ``files`` of docker/ in order and validates against its schema without a Docker daemon
    (it lists every service, whatever their profiles). A clean environment: no developer's
    variables leak in; docker/.env supplies the project name and profile."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp"}
    chosen = [arg for name in files for arg in ("-f", str(DOCKER / name))]
    return subprocess.run(
        [tool("docker-compose"), "--project-directory", str(DOCKER), *chosen, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env if env is not None else COMPOSE_SECRETS)},
        check=False,
    )


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="session")
def compose_config() -> dict[str, Any]:
    done = compose("config")
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


@pytest.fixture(scope="session")
def compose_gpu_config() -> dict[str, Any]:
    """compose.yaml with compose.gpu.yaml over it, as the gpu profile runs."""
    done = compose("config", env=GPU_ENV, files=GPU_FILES)
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


@pytest.fixture(scope="session")
def k8s_production() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) is not installed; tests/deploy/test_k8s checks base files")
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / "production")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return load_all(done.stdout)


def base_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "k8s" / "base").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += load_all(path.read_text())
    return docs
