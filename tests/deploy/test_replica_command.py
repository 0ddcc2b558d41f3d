"""manage.py replica_command: a replica's command line from its catalog version, and the
emulator actually serving with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from decimal import Decimal
from io import StringIO
from pathlib import Path

import httpx
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from catalog import services
from catalog.models import ModelVersion
from catalog.replica import ServingSpec, long_prefill_threshold, replica_argv
from tests.support import ROOT, free_port, wait_http_ok

pytestmark = pytest.mark.django_db


@pytest.fixture
def version() -> ModelVersion:
    family = services.family_upsert(name="tiny", display_name="Tiny")
    return services.version_upsert(
        family=family,
        name="tiny-2026-01",
        context_length=32768,
        kv_bytes_per_token=131072,
        tpot_target_ms=50,
        kv_capacity_tokens=200_000,
        price_prompt_per_mtok=Decimal("0.1"),
        price_cached_prompt_per_mtok=Decimal("0.05"),
        price_completion_per_mtok=Decimal("0.2"),
        weights="org/tiny-instruct",
        tensor_parallel_size=2,
        tool_call_parser="hermes",
        emulator_profile="llama-8b-tp1-h100",
        is_active=True,
    )


def _run(*args: str) -> str:
    out = StringIO()
    call_command("replica_command", *args, stdout=out)
    return out.getvalue().strip()


def test_vllm_command_from_the_catalog(version: ModelVersion) -> None:
    argv = json.loads(_run(version.name, "--format", "json"))
    assert argv == replica_argv(ServingSpec.of(version), engine="vllm")
    text = " ".join(argv)
    assert argv[:3] == ["vllm", "serve", "org/tiny-instruct"]
    for part in (
        "--served-model-name tiny-2026-01",
        "--max-model-len 32768",
        "--tensor-parallel-size 2",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        f"--long-prefill-token-threshold {long_prefill_threshold(32768)}",
        "--scheduling-policy priority",
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice --tool-call-parser hermes",
    ):
        assert part in text
    assert _run(version.name).startswith("vllm serve org/tiny-instruct --served-model-name")


def test_no_tool_parser_no_tool_flags(version: ModelVersion) -> None:
    version.tool_call_parser = ""
    version.save()
    assert "--tool-call-parser" not in _run(version.name)


def test_refusals_are_clear(version: ModelVersion) -> None:
    with pytest.raises(CommandError, match="no model version 'nope'.*tiny-2026-01"):
        _run("nope")
    version.weights = ""
    version.save()
    with pytest.raises(CommandError, match="no weights"):
        _run(version.name)
    version.is_active = False
    version.save()
    with pytest.raises(CommandError, match="inactive"):
        _run(version.name, "--engine", "emulator")


def test_the_emulator_serves_with_the_generated_command(
    version: ModelVersion, tmp_path: Path
) -> None:
    port = free_port()
    argv = json.loads(
        _run(version.name, "--engine", "emulator", "--host", "127.0.0.1", "--port", str(port),
             "--format", "json")
    )  # fmt: skip
    assert argv[:3] == ["python", "-m", "emulator"]
    log = tmp_path / "emulator.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *argv[1:]], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    try:
        base = f"http://127.0.0.1:{port}"

        wait_http_ok(proc, f"{base}/health", log)
        models = httpx.get(f"{base}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["tiny-2026-01"]
        assert models["data"][0]["max_model_len"] == 32768
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny-2026-01",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "priority": 1,
            },
            timeout=30,
        ).json()
        # Prompt-token details are on (a platform flag): cached tokens are reported.
        assert "cached_tokens" in reply["usage"]["prompt_tokens_details"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
