"""/metrics: parses with prometheus_client, carries vLLM's names/labels, shows preemptions."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from emulator.testing import EmulatorHandle, running_emulator

from .conftest import MODEL, chat, words

REQUIRED_SAMPLES = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:cache_config_info",
}


async def scrape(client: httpx.AsyncClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    ((_, val),) = samples[name]
    return val


async def test_metrics_parse_with_vllm_names_and_labels(
    client: httpx.AsyncClient, emu: EmulatorHandle
) -> None:
    body = chat(words(40), max_tokens=5, ignore_eos=True)
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    samples = await scrape(client)
    assert REQUIRED_SAMPLES <= set(samples)
    for name in REQUIRED_SAMPLES - {"vllm:cache_config_info"}:
        for labels, _ in samples[name]:
            assert labels["model_name"] == MODEL and labels["engine"] == "0"
    ((info, one),) = samples["vllm:cache_config_info"]
    assert one == 1.0 and "model_name" not in info and info["engine"] == "0"
    assert info["block_size"] == "16"
    assert info["num_gpu_blocks"] == str(emu.engine.num_gpu_blocks)
    assert info["enable_prefix_caching"] == "True" and info["gpu_memory_utilization"] == "0.92"
    assert value(samples, "vllm:generation_tokens_total") == 5
    assert value(samples, "vllm:prompt_tokens_total") == 47
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 4
    success = {labels["finished_reason"]: v for labels, v in samples["vllm:request_success_total"]}
    assert success["length"] == 1 and success["abort"] == 0
    # The clock-lag counters a benchmark reads to tell whether the box kept pace.
    resyncs = value(samples, "emulator_clock_resyncs_total")
    assert resyncs == emu.app.driver.clock_resyncs
    lag = value(samples, "emulator_clock_lag_seconds_total")
    assert lag == emu.app.driver.clock_lag_model_seconds and (lag > 0) == (resyncs > 0)


async def test_kv_usage_follows_vllms_formula() -> None:
    # Speed 1: the request stays in flight for a minute, whatever the machine's load.
    async with (
        running_emulator(model=MODEL, speed=1) as emu,
        httpx.AsyncClient(base_url=emu.base_url, timeout=30) as client,
    ):
        body = chat(words(500), max_tokens=5000, ignore_eos=True, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                break
            samples = await scrape(client)
        # Both numbers come from one collect() call, so they describe the same instant.
        used = value(samples, "emulator_kv_blocks_used")
        ((info, _),) = samples["vllm:cache_config_info"]
        num_gpu_blocks = int(info["num_gpu_blocks"])
        assert used >= 32  # 507 prompt tokens
        usage = value(samples, "vllm:kv_cache_usage_perc")
        assert usage == 1 - (num_gpu_blocks - 1 - used) / (num_gpu_blocks - 1)
        assert value(samples, "vllm:num_requests_running") == 1


async def test_preemptions_show_in_metrics() -> None:
    # 64 blocks of KV; six requests that each grow to ~400 tokens (25 blocks) overcommit it.
    async with (
        running_emulator(model=MODEL, speed=50, kv_capacity_tokens=64 * 16) as emu,
        httpx.AsyncClient(base_url=emu.base_url, timeout=60) as client,
    ):
        bodies = [chat(words(100, seed=i), max_tokens=300, ignore_eos=True) for i in range(6)]
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=b) for b in bodies)
        )
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in responses)
        samples = await scrape(client)
        preemptions = value(samples, "vllm:num_preemptions_total")
        assert preemptions > 0
        assert preemptions == emu.engine.stats.num_preemptions
        assert value(samples, "vllm:kv_cache_usage_perc") == 0.0
        assert value(samples, "vllm:num_requests_running") == 0
