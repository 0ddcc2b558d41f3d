"""Hardware/model profiles: the numbers the emulated engine's timing and memory come from.

A profile is data (a frozen record); the engine derives everything else from it. Extra
profiles can be loaded from a JSON file whose objects carry the same field names
(``load_profiles``).

Timing is a roofline. Each engine step schedules some tokens (prefill chunks plus one decode
token per running sequence), reads the weights once plus the KV of every scheduled sequence,
and does the arithmetic of a forward pass over the scheduled tokens::

    flops(chunk of n tokens after c computed) = n * flops_per_token
                                              + attn_flops_per_token_ctx * n * (c + (n + 1) / 2)
    compute_s = prefill flops / (peak * prefill_mfu) + decode flops / (peak * decode_mfu)
    memory_s  = (weights_bytes + kv_bytes_read) / effective_bandwidth
    step_s    = max(compute_s, memory_s)

``flops_per_token`` is the dense matmul work, 2 FLOPs per parameter. The attention term is
the QK^T and AV products: each of a token's query heads multiplies against every earlier
token's keys and then values, 2 FLOPs per multiply-add, so 4 x layers x (heads x head dim)
FLOPs per (token, context token) pair; a causal chunk of ``n`` tokens after ``c`` computed
ones has ``n * (c + (n + 1) / 2)`` pairs. For a 128k-token prompt on a 70B model this term
is larger than the matmuls. ``peak`` is the replica's dense BF16 peak (per GPU x tensor
parallel); the MFUs are the realised fractions, lower for decode's skinny matmuls.

A decode-only step is memory-bound (weights plus KV per step); a big prefill chunk is
compute-bound; a chunk riding along a decode batch is nearly free until compute dominates,
which is the behaviour chunked prefill (Sarathi) exploits.

Two families of built-in profiles:

* the **realistic** ones (``llama-70b-tp4-h100``, ``llama-8b-tp1-h100``), the default
  everywhere: prefill at 50-55 % MFU plus the attention term;
* the **design** ones (``...-design``), which reproduce docs/design.md §2's arithmetic
  exactly: a flat prefill rate (70B: 4,096 tokens in 146 ms = 28,000 tok/s; 8B:
  60,000 tok/s) and no attention term. Expressed in the same terms, that rate is 99.9 %
  (70B) and 97 % (8B) of dense BF16 peak, which no real deployment reaches; they exist
  so that the design's own numbers can still be checked, not to size anything.

Sources of the numbers (public datasheets and model cards):

* NVIDIA H100 SXM5: 989 TFLOP/s dense BF16 (1,979 with 2:4 sparsity, not used by dense
  LLM inference) and 3.35 TB/s of HBM3 per GPU, 80 GB.
* Llama-3.1-70B: 70.6 B parameters, 80 layers, d_model 8,192, 64 query heads, 8 KV heads,
  head dim 128. Llama-3.1-8B: 8.03 B parameters, 32 layers, d_model 4,096, 32 query heads,
  8 KV heads, head dim 128.
* Prefill MFU: published measurements of large-model prefill on H100 (vendor inference
  benchmarks, FlashAttention-3 and serving-system papers) sit around 50-65 % of dense
  peak; tensor parallelism over 4 GPUs adds two all-reduces per layer, so the 70B TP4
  replica is put at the low end (50 %), the single-GPU 8B at 55 %. Decode matmuls have
  as many rows as there are sequences in the batch and reach well under that (35 %); they
  are memory-bound in all but the largest batches anyway.
* Realised HBM bandwidth 40 % of datasheet for decode, as the design has it: with kernel
  launches, TP all-reduces and sampling, a lone 70B stream on 4 x H100 decodes at about
  26 ms per token in practice.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

GIB = 1024**3
KIB = 1024
H100_SXM_BF16_DENSE_FLOPS = 989e12
H100_SXM_HBM3_BYTES_PER_S = 3.35e12


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
    peak_flops_per_gpu: float  # dense BF16 FLOP/s, datasheet
    flops_per_token: float  # matmul FLOPs of one token's forward pass (2 x parameters)
    attn_flops_per_token_ctx: float  # attention FLOPs per (token, context token) pair
    prefill_mfu: float  # realised fraction of peak on prefill chunks
    decode_mfu: float  # realised fraction of peak on decode tokens
    max_model_len: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192  # vLLM's default on H100/H200 (>= 70 GiB, not A100)
    max_num_seqs: int = 1024  # vLLM's default on H100/H200
    gpu_memory_utilization: float = 0.92  # vLLM 0.33 default; reported in cache_config_info
    tpot_target_ms: int = 50  # the platform SLO: TPOT p95 < 50 ms
    ttft_target_ms: int = 1000  # the platform SLO: TTFT p95 < 1 s

    @property
    def context_length(self) -> int:
        """Alias of ``max_model_len`` (the control plane's name for it)."""
        return self.max_model_len

    @property
    def effective_bandwidth(self) -> float:
        """Bytes per second a decode step really reads at (all GPUs of the replica)."""
        return self.bandwidth_efficiency * self.tensor_parallel * self.hbm_bandwidth_per_gpu

    @property
    def peak_flops(self) -> float:
        """Dense peak of the whole replica."""
        return self.peak_flops_per_gpu * self.tensor_parallel

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill rate at zero context (matmuls only); longer contexts are slower."""
        return self.peak_flops * self.prefill_mfu / self.flops_per_token

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

    def prefill_flops(self, tokens: int, context: int = 0) -> float:
        """FLOPs of a causal prefill chunk of ``tokens`` after ``context`` computed ones."""
        pairs = tokens * (context + (tokens + 1) / 2)
        return tokens * self.flops_per_token + pairs * self.attn_flops_per_token_ctx

    def prefill_seconds(self, tokens: int, context: int = 0) -> float:
        """Compute time of a lone prefill (no decode batch alongside), chunking ignored."""
        return self.prefill_flops(tokens, context) / (self.peak_flops * self.prefill_mfu)

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


def attention_flops_per_token_ctx(layers: int, heads: int, head_dim: int) -> float:
    """QK^T plus AV: 2 products x 2 FLOPs per multiply-add x layers x query heads x head dim."""
    return 4.0 * layers * heads * head_dim


# 70B FP16 with GQA-8 on 4 x H100 SXM (3.35 TB/s each, 40 % realised).
# 320 KiB/token = 80 layers x 8 KV heads x 128 dims x (K+V) x 2 bytes.
# 172.5 GiB / 320 KiB = 565,248 tokens = 35,328 blocks of 16.
# Matmuls: 2 x 70.6 B = 141.2 GFLOP/token; attention 4 x 80 x 64 x 128 = 2.62 MFLOP per pair.
LLAMA_70B_TP4_H100 = Profile(
    name="llama-70b-tp4-h100",
    hf_model="meta-llama/Llama-3.1-70B-Instruct",
    tensor_parallel=4,
    weights_bytes=140_000_000_000,
    kv_bytes_per_token=320 * KIB,
    kv_budget_bytes=int(172.5 * GIB),
    hbm_bandwidth_per_gpu=H100_SXM_HBM3_BYTES_PER_S,
    bandwidth_efficiency=0.40,
    peak_flops_per_gpu=H100_SXM_BF16_DENSE_FLOPS,
    flops_per_token=2 * 70.6e9,
    attn_flops_per_token_ctx=attention_flops_per_token_ctx(80, 64, 128),
    prefill_mfu=0.50,
    decode_mfu=0.35,
    max_model_len=131_072,
)

# 8B FP16 on one H100: 16.06 GB of weights; 128 KiB/token = 32 layers x 8 KV heads x 128 x 2 x 2.
# KV budget: 80 GiB x 0.92 - 15 GiB weights - ~4.6 GiB activations/graphs = 54 GiB.
# Matmuls: 2 x 8.03 B = 16.06 GFLOP/token; attention 4 x 32 x 32 x 128 = 0.52 MFLOP per pair.
LLAMA_8B_TP1_H100 = Profile(
    name="llama-8b-tp1-h100",
    hf_model="meta-llama/Llama-3.1-8B-Instruct",
    tensor_parallel=1,
    weights_bytes=16_060_000_000,
    kv_bytes_per_token=128 * KIB,
    kv_budget_bytes=54 * GIB,
    hbm_bandwidth_per_gpu=H100_SXM_HBM3_BYTES_PER_S,
    bandwidth_efficiency=0.40,
    peak_flops_per_gpu=H100_SXM_BF16_DENSE_FLOPS,
    flops_per_token=2 * 8.03e9,
    attn_flops_per_token_ctx=attention_flops_per_token_ctx(32, 32, 128),
    prefill_mfu=0.55,
    decode_mfu=0.35,
    max_model_len=131_072,
)


def long_context_threshold_tokens(profile: Profile, ttft_s: float | None = None) -> int:
    """The shortest prompt whose lone prefill takes at least ``ttft_s`` (model time; default
    the profile's TTFT target): the long-context threshold, where the prefill rate the
    control plane pushes for a version is measured. ``max_model_len`` when no prompt the
    profile takes reaches it."""
    ttft = profile.ttft_target_ms / 1000 if ttft_s is None else ttft_s
    lo, hi = 1, max(2, profile.max_model_len)
    if profile.prefill_seconds(hi) < ttft:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if profile.prefill_seconds(mid) < ttft else (lo, mid)
    return hi


def threshold_prefill_rate(profile: Profile, ttft_s: float | None = None) -> float:
    """The profile's prefill rate at the long-context threshold: the ``n`` tokens whose lone
    prefill takes ``ttft_s`` (model time; default the profile's TTFT target), over the time
    they take. Realistic prefill grows faster than linearly with the prompt (attention), so
    this is the rate that matters there, and the one the control plane pushes with a
    version (``prefill_tokens_per_s``)."""
    ttft = profile.ttft_target_ms / 1000 if ttft_s is None else ttft_s
    n0 = long_context_threshold_tokens(profile, ttft)
    return n0 / min(ttft, profile.prefill_seconds(n0))


def prefill_attention_share(profile: Profile, ttft_s: float | None = None) -> float:
    """The share of the threshold prompt's prefill time that is attention (the part of a
    prefill's cost that grows with the context, ``attn_flops_per_token_ctx``): 1 minus the
    matmuls' share of ``prefill_flops`` at ``long_context_threshold_tokens``. With it and
    the threshold rate, the gateway's ``a*n + b*n*n`` prefill estimate
    (gateway/admission/estimates.py, ``prefill_expected_seconds``) is this cost model's
    exactly; the control plane pushes it with the version (``prefill_attention_share``).
    About 0.10 for the realistic 70B profile and 0.28 for the 8B one; 0 without an
    attention term (the design profiles)."""
    n0 = long_context_threshold_tokens(profile, ttft_s)
    total = profile.prefill_flops(n0)
    return max(0.0, 1.0 - n0 * profile.flops_per_token / total) if total > 0 else 0.0


def design_profile(base: Profile, prefill_tokens_per_s: float) -> Profile:
    """``base`` with the design's flat prefill rate: no attention term, and the MFU that
    makes the matmuls alone run at ``prefill_tokens_per_s`` (decode tokens at the same rate,
    as the design's single compute rate has it)."""
    mfu = prefill_tokens_per_s * base.flops_per_token / base.peak_flops
    return replace(
        base,
        name=f"{base.name}-design",
        attn_flops_per_token_ctx=0.0,
        prefill_mfu=mfu,
        decode_mfu=mfu,
    )


# The design's arithmetic, kept to check it (tests/emulator/test_calibration.py): 70B
# prefill at 28,000 tok/s (4,096 tokens in 146 ms) = 99.9 % of 4 x H100 dense peak; 8B at
# 60,000 tok/s (the 70B rate scaled by FLOPs per token and GPU count) = 97 % of one H100.
LLAMA_70B_TP4_H100_DESIGN = design_profile(LLAMA_70B_TP4_H100, 28_000.0)
LLAMA_8B_TP1_H100_DESIGN = design_profile(LLAMA_8B_TP1_H100, 60_000.0)

BUILTIN_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        LLAMA_70B_TP4_H100,
        LLAMA_8B_TP1_H100,
        LLAMA_70B_TP4_H100_DESIGN,
        LLAMA_8B_TP1_H100_DESIGN,
    )
}


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
