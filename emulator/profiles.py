"""Hardware/model profiles: the numbers the emulated engine's timing and memory come from.

A profile is data (a frozen record); the engine derives everything else from it. The two
built-in profiles are the design's 70B replica (§2) and an 8B single-GPU replica. Extra
profiles can be loaded from a JSON file whose objects carry the same field names
(``load_profiles``).

Timing is a roofline. Each engine step schedules some tokens (prefill chunks plus one decode
token per running sequence) and reads the weights once plus the KV of every scheduled
sequence::

    compute_s = scheduled_tokens / prefill_tokens_per_s              (compute-bound side)
    memory_s  = (weights_bytes + kv_bytes_read) / effective_bandwidth (memory-bound side)
    step_s    = max(compute_s, memory_s)

A decode-only step is memory-bound (the §2 decode formula exactly); a big prefill chunk is
compute-bound (4,096 tokens in ~146 ms); a chunk riding along a decode batch is nearly free
until compute dominates, which is the behaviour chunked prefill (Sarathi) exploits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

GIB = 1024**3
KIB = 1024


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    hf_model: str  # what vLLM would report as the model card's ``root``
    tensor_parallel: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int  # HBM left for KV after weights and activations, whole replica
    hbm_bandwidth_per_gpu: float  # bytes/s, datasheet
    bandwidth_efficiency: float  # realised fraction of datasheet bandwidth
    prefill_tokens_per_s: float  # compute-bound token rate of the whole replica
    max_model_len: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192  # vLLM's default on H100/H200 (>= 70 GiB, not A100)
    max_num_seqs: int = 1024  # vLLM's default on H100/H200
    gpu_memory_utilization: float = 0.92  # vLLM 0.33 default; reported in cache_config_info
    tpot_target_ms: int = 50  # design §1 SLO: TPOT p95 < 50 ms
    ttft_target_ms: int = 1000  # design §1 SLO: TTFT p95 < 1 s

    @property
    def context_length(self) -> int:
        """Alias of ``max_model_len`` (the control plane's name for it)."""
        return self.max_model_len

    @property
    def effective_bandwidth(self) -> float:
        """Bytes per second a decode step really reads at (all GPUs of the replica)."""
        return self.bandwidth_efficiency * self.tensor_parallel * self.hbm_bandwidth_per_gpu

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV budget of one replica in tokens (a whole number of blocks)."""
        return self.num_gpu_blocks * self.block_size

    @property
    def kv_capacity_bytes(self) -> int:
        return self.kv_capacity_tokens * self.kv_bytes_per_token

    def decode_step_seconds(self, context_tokens: int) -> float:
        """Model time of a decode-only step whose running sequences hold ``context_tokens``."""
        memory = (self.weights_bytes + context_tokens * self.kv_bytes_per_token) / (
            self.effective_bandwidth
        )
        return memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        return cls(**data)


# Design §2: 70B FP16 with GQA-8 on 4 x H100 SXM (3.35 TB/s each, 40 % realised).
# 320 KiB/token = 80 layers x 8 KV heads x 128 dims x (K+V) x 2 bytes.
# 172.5 GiB / 320 KiB = 565,248 tokens = 35,328 blocks of 16.
LLAMA_70B_TP4_H100 = Profile(
    name="llama-70b-tp4-h100",
    hf_model="meta-llama/Llama-3.1-70B-Instruct",
    tensor_parallel=4,
    weights_bytes=140_000_000_000,
    kv_bytes_per_token=320 * KIB,
    kv_budget_bytes=int(172.5 * GIB),
    hbm_bandwidth_per_gpu=3.35e12,
    bandwidth_efficiency=0.40,
    prefill_tokens_per_s=28_000.0,
    max_model_len=131_072,
)

# 8B FP16 on one H100: 16.06 GB of weights; 128 KiB/token = 32 layers x 8 KV heads x 128 x 2 x 2.
# KV budget: 80 GiB x 0.92 - 15 GiB weights - ~4.6 GiB activations/graphs = 54 GiB.
# Prefill scales the 70B figure by FLOPs per token (70.6B/8.03B params) and GPU count (4 -> 1).
LLAMA_8B_TP1_H100 = Profile(
    name="llama-8b-tp1-h100",
    hf_model="meta-llama/Llama-3.1-8B-Instruct",
    tensor_parallel=1,
    weights_bytes=16_060_000_000,
    kv_bytes_per_token=128 * KIB,
    kv_budget_bytes=54 * GIB,
    hbm_bandwidth_per_gpu=3.35e12,
    bandwidth_efficiency=0.40,
    prefill_tokens_per_s=60_000.0,
    max_model_len=131_072,
)

BUILTIN_PROFILES: dict[str, Profile] = {p.name: p for p in (LLAMA_70B_TP4_H100, LLAMA_8B_TP1_H100)}


def get_profile(name: str) -> Profile:
    try:
        return BUILTIN_PROFILES[name]
    except KeyError:
        raise KeyError(
            f"unknown profile {name!r}; built-in: {', '.join(sorted(BUILTIN_PROFILES))}"
        ) from None


def load_profiles(path: str | Path) -> dict[str, Profile]:
    """Read extra profiles from a JSON list of objects with ``Profile``'s field names."""
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, list):
        raise ValueError("a profile file holds a JSON list of profile objects")
    out: dict[str, Profile] = {}
    for item in raw:
        profile = Profile.from_dict(item)
        out[profile.name] = profile
    return out
