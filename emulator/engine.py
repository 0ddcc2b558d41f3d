"""The emulated vLLM engine core: continuous batching, paged KV, preemption, prefix caching.

Pure, synchronous and clock-agnostic: no asyncio, no I/O, no wall clock. Time is a float of
*model seconds* that only ``step()`` (and ``advance_to``) move. An asyncio driver
(``emulator.server``) paces steps against the wall clock; a discrete-event simulation can
drive many engines in virtual time directly.

API
---
``Engine(profile, config=None, seed=0)``
    ``profile`` (``emulator.profiles.Profile``) sets timing and memory; ``config``
    (``EngineConfig``) overrides the scheduler knobs; ``seed`` fixes output lengths and text of
    requests that carry no seed of their own.

``engine.add_request(request_id, prompt_token_ids, max_tokens, *, priority=0,
arrival_time=None, cache_salt=None, ignore_eos=False, seed=None, min_tokens=0,
output_token_ids=None) -> Request``
    Queue a request (``arrival_time`` defaults to ``engine.now``). ``request_id`` must be unique
    among live requests. Raises ``ValueError`` if the prompt is empty or leaves no room for
    one output token within ``engine.max_model_len``; ``max_tokens`` is clamped to the room
    left, as vLLM does. The output ends at ``max_tokens`` (``finish_reason="length"``) or at a
    natural end drawn from a seeded lognormal with p50 300 / p95 1,200 tokens (``"stop"``)
    unless ``ignore_eos``. ``output_token_ids`` fixes the output instead (a tool call or a
    structured-output JSON decided by the server): it ends after the last of them
    (``"stop"``) or at ``max_tokens``.

    ``n`` choices of one API request are ``n`` requests with the same prompt and salt, as
    vLLM's v1 engine fans them out: admitted together, the later ones hit the first one's
    full prompt blocks in the prefix cache (computed once, shared by reference), each
    computes only its own partial last block, and each grows its own decode blocks.

``engine.abort(request_id, reason="abort") -> Request | None``
    Finish a live request now (client disconnect: ``"abort"``; injected failure: ``"error"``),
    freeing its KV blocks immediately. Returns None if unknown or already finished.

``engine.step() -> StepResult``
    Schedule and "execute" one engine iteration starting at ``engine.now``; advances
    ``engine.now`` by ``result.duration``. Events are as of the step's end:
    ``result.emitted`` lists requests that gained exactly one output token (its id is
    ``req.token_ids[-1]``; ``req.finish_reason`` is set if that token was the last),
    ``result.finished`` the requests that finished in the step, ``result.preempted`` those
    preempted (recompute) in the step. A step with nothing to run has ``duration == 0``.

``engine.advance_to(t)``
    Move the clock forward to ``t`` (idle time); never backwards.

Read-only state: ``now``, ``requests`` (live, by id), ``num_running``, ``num_waiting``,
``kv_usage()`` (vLLM's ``1 - free/(num_gpu_blocks-1)``), ``pool`` (``emulator.kv.BlockPool``),
``stats`` (``emulator.stats.EngineStats``), ``has_work()``, and the resolved limits
``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``num_gpu_blocks``,
``block_size``, ``scheduling_policy``, ``long_prefill_token_threshold``.

Scheduling follows the v1 scheduler of vLLM 0.33.0, the release the emulator pins (what
``/version`` reports): running requests first (decode or their next prefill chunk, at most
``long_prefill_token_threshold`` tokens of it when that is set) within the
``max_num_batched_tokens`` budget, allocating blocks as they grow; when a block is missing,
preempt the victim (priority policy: max ``(priority, arrival_time)``; fcfs: last of
running), free its blocks, reset it and requeue it. Then waiting requests in queue order while
budget lasts and ``len(running) < max_num_seqs``; no admissions in a step that preempted.

* Policy: ``fcfs`` by default, as vLLM; ``priority`` only when asked for (vLLM's
  ``--scheduling-policy priority``). Under fcfs a request's ``priority`` is carried but
  ignored.
* Admission gate: in 0.33 a waiting request is admitted only if its whole sequence fits in
  free blocks (prefix-cache hits excepted; vLLM's ``scheduler_reserve_full_isl``, on by
  default). Releases before that setting existed (v0.11.x and earlier) admitted a request as
  soon as its first chunk fit, and relied on preemption when later chunks did not;
  ``EngineConfig(reserve_full_prompt=False)`` selects that behaviour.
* Prefix caching: a request's full blocks are cached when they are *scheduled* (vLLM's
  ``allocate_slots`` caches up to the tokens the step will compute), so a same-prefix request
  admitted later in the same step already hits them. Two requests that compute the same
  block in one step each keep their own copy; both copies are registered under the hash
  (vLLM does not de-duplicate, block tables are append-only) and lookups return the first.
* With ``enable_kv_cache_events`` the pool records BlockStored / BlockRemoved /
  AllBlocksCleared events (``take_kv_events()``), as vLLM's ``--kv-events-config`` does.

The occupancy cliff is not a formula here: it emerges from preemption and recompute.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

from emulator.kv import BlockPool, BlockStored, KVEvent, get_hasher, salt_key
from emulator.profiles import Profile
from emulator.stats import EngineStats
from emulator.tokenizer import OUTPUT_TABLE_MASK, output_token_table

SchedulingPolicy = Literal["priority", "fcfs"]
WAITING, RUNNING, FINISHED = 0, 1, 2
_MASK64 = (1 << 64) - 1
_STD_NORMAL = NormalDist()
_Z95 = _STD_NORMAL.inv_cdf(0.95)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler knobs; ``None`` means the profile's value."""

    scheduling_policy: SchedulingPolicy = "fcfs"  # vLLM's default
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_capacity_tokens: int | None = None  # override the profile's KV budget (scaled benches)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    output_len_median: float = 300.0  # the design output shape: p50 300, p95 1,200
    output_len_p95: float = 1200.0
    # vLLM ``--long-prefill-token-threshold``: the most prompt tokens one request may compute
    # in a step, so a long prefill leaves part of the chunk budget to others. 0 = no cap.
    # ``None`` resolves as vLLM's SchedulerConfig does: 0, unless chunked prefill (always on
    # here) runs with max_num_partial_prefills > 1, then 4 % of max_model_len.
    long_prefill_token_threshold: int | None = None
    # vLLM ``--max-num-partial-prefills`` / ``--max-long-partial-prefills``. The v1 scheduler
    # this engine follows does not limit concurrent partial prefills with them; they only
    # feed the threshold's default above (and are validated as vLLM does).
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # Admission gate: True as vLLM 0.33 (the whole sequence must fit in free blocks before a
    # waiting request is admitted); False as releases before that gate (first chunk only).
    reserve_full_prompt: bool = True
    # vLLM ``--kv-events-config`` ``enable_kv_cache_events``: record KV-cache events.
    enable_kv_cache_events: bool = False
    # Emulator-only (vLLM has no such knob): the most of the prefix cache one cache salt may
    # keep before it recycles its own cached blocks (``emulator.kv``); 0 = off.
    tenant_cache_share: float = 0.0
    # vLLM ``--prefix-caching-hash-algo`` (``contracts.blockhash.get_hasher``): the emulator's own
    # chain hash by default, or vLLM's ``sha256``/``sha256_cbor``, whose first parent derives
    # from ``prefix_hash_seed`` (vLLM reads it from PYTHONHASHSEED; None: unset, vLLM 0.33's
    # fixed default seed).
    prefix_caching_hash_algo: str = "emulator"
    prefix_hash_seed: str | None = None


def resolve_long_prefill_threshold(cfg: EngineConfig, max_model_len: int) -> int:
    """vLLM's resolution of ``long_prefill_token_threshold`` (``config/scheduler.py``)."""
    if cfg.max_num_partial_prefills < 1 or cfg.max_long_partial_prefills < 1:
        raise ValueError("max_num_partial_prefills and max_long_partial_prefills must be >= 1")
    if cfg.max_long_partial_prefills > cfg.max_num_partial_prefills:
        raise ValueError("max_long_partial_prefills must be <= max_num_partial_prefills")
    threshold = cfg.long_prefill_token_threshold
    if threshold is not None and threshold < 0:
        raise ValueError("long_prefill_token_threshold must be >= 0")
    if not threshold and cfg.max_num_partial_prefills > 1:
        return int(max_model_len * 0.04)
    return threshold or 0


class Request:
    """One sequence inside the engine. Fields are public for drivers and reports; only the
    engine mutates them. ``handle`` is a free slot for the driver (e.g. its stream object)."""

    __slots__ = (
        "request_id",
        "prompt_len",
        "token_ids",
        "num_computed",
        "max_computed",
        "blocks",
        "block_hashes",
        "first_extra",
        "hash_extra",
        "num_cached_blocks",
        "status",
        "priority",
        "arrival_time",
        "seq",
        "max_tokens",
        "target_len",
        "natural_reason",
        "tok_offset",
        "num_output",
        "num_cached_tokens",
        "num_preemptions",
        "sched_step",
        "step_tokens",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "finish_time",
        "finish_reason",
        "cache_salt",
        "forced",
        "handle",
    )

    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt, then output tokens as they are sampled
    num_computed: int  # tokens whose KV is computed (reset to 0 by preemption)
    max_computed: int  # high-water mark of num_computed (to count recompute)
    blocks: list[int]
    block_hashes: list[int]  # chained hashes of the full blocks of token_ids known so far
    first_extra: int  # the cache salt's key: the owner of its blocks (tenant cache share)
    hash_extra: Hashable  # the hash scheme's extra key of the first block (its salt)
    num_cached_blocks: int  # leading blocks already registered in the prefix cache
    status: int  # WAITING, RUNNING or FINISHED
    priority: int
    arrival_time: float
    seq: int
    max_tokens: int
    target_len: int  # output length at which the request ends
    natural_reason: str  # finish_reason when it gets there: "stop" (EOS) or "length"
    tok_offset: int
    num_output: int
    num_cached_tokens: int  # prefix-cache hit at first admission; -1 before that
    num_preemptions: int
    sched_step: int
    step_tokens: int
    first_scheduled_time: float
    first_token_time: float
    last_token_time: float
    finish_time: float
    finish_reason: str | None
    cache_salt: str | None
    forced: Sequence[int] | None  # the exact output tokens (tool calls, structured output)
    handle: Any

    def __init__(self) -> None:
        self.handle = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def ttft(self) -> float | None:
        """Model seconds from arrival to first token."""
        if self.first_token_time < 0:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean model seconds per output token after the first."""
        if self.num_output < 2 or self.first_token_time < 0:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output - 1)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.prompt_len}, out={self.num_output}, "
            f"computed={self.num_computed}, blocks={len(self.blocks)}, status={self.status})"
        )


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float
    num_scheduled_tokens: int = 0
    num_scheduled_seqs: int = 0
    emitted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


class _FcfsQueue:
    """Arrival order; preempted requests go back to the front (vLLM ``prepend_request``)."""

    __slots__ = ("_items", "live")

    def __init__(self) -> None:
        self._items: deque[Request] = deque()
        self.live = 0

    def push(self, req: Request) -> None:
        self._items.append(req)
        self.live += 1

    def requeue(self, req: Request) -> None:
        self._items.appendleft(req)
        self.live += 1

    def peek(self) -> Request | None:
        items = self._items
        while items and items[0].status != WAITING:
            items.popleft()  # lazily dropped: aborted while waiting
        return items[0] if items else None

    def pop(self) -> None:
        self._items.popleft()
        self.live -= 1


class _PriorityQueue:
    """Heap on (priority, arrival_time): lower first (``--scheduling-policy priority``)."""

    __slots__ = ("_heap", "live")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self.live = 0

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, req.seq, req))
        self.live += 1

    requeue = push

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][3].status != WAITING:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> None:
        heapq.heappop(self._heap)
        self.live -= 1


class Engine:
    """See the module docstring for the API."""

    def __init__(self, profile: Profile, config: EngineConfig | None = None, seed: int = 0):
        cfg = config or EngineConfig()
        if cfg.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(f"unknown scheduling policy {cfg.scheduling_policy!r}")
        self.profile = profile
        self.config = cfg
        self.seed = seed
        self.scheduling_policy: SchedulingPolicy = cfg.scheduling_policy
        self.block_size = profile.block_size
        self.max_num_seqs = cfg.max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or profile.max_num_batched_tokens
        capacity = cfg.kv_capacity_tokens or profile.kv_capacity_tokens
        self.num_gpu_blocks = capacity // self.block_size
        self.pool = BlockPool(
            self.num_gpu_blocks,
            enable_caching=cfg.enable_prefix_caching,
            enable_kv_cache_events=cfg.enable_kv_cache_events,
            tenant_cache_share=cfg.tenant_cache_share,
        )
        self.reserve_full_prompt = cfg.reserve_full_prompt
        usable_tokens = (self.num_gpu_blocks - 1) * self.block_size
        # vLLM refuses to start when max_model_len exceeds the KV capacity; scaled-down
        # configurations clamp instead so every admitted request can eventually run.
        self.max_model_len = min(cfg.max_model_len or profile.max_model_len, usable_tokens)
        if self.max_model_len < 2:
            raise ValueError("KV capacity too small for even a 2-token sequence")
        self.enable_prefix_caching = cfg.enable_prefix_caching
        self.hasher = get_hasher(cfg.prefix_caching_hash_algo, cfg.prefix_hash_seed)
        self.long_prefill_token_threshold = resolve_long_prefill_threshold(cfg, self.max_model_len)

        self.now = 0.0
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: _FcfsQueue | _PriorityQueue = (
            _PriorityQueue() if self.scheduling_policy == "priority" else _FcfsQueue()
        )
        self.stats = EngineStats()
        # Called with each request as it finishes (naturally or aborted), after its times
        # are final; the CLI's ``--request-log`` writes them out. None: nothing is called.
        self.on_finish: Callable[[Request], None] | None = None
        self._seq = 0
        self._step_no = 0
        self._mu = math.log(cfg.output_len_median)
        self._sigma = math.log(cfg.output_len_p95 / cfg.output_len_median) / _Z95
        self._out_table = output_token_table()
        self._kv_bytes = profile.kv_bytes_per_token
        self._weights = profile.weights_bytes
        self._bandwidth = profile.effective_bandwidth
        # Seconds per FLOP at each phase's realised rate (see emulator.profiles).
        peak = profile.peak_flops
        self._flops_tok = profile.flops_per_token
        self._flops_pair = profile.attn_flops_per_token_ctx
        self._s_per_prefill_flop = 1.0 / (peak * profile.prefill_mfu)
        self._s_per_decode_flop = 1.0 / (peak * profile.decode_mfu)

    # -- state ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self.waiting.live

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def kv_usage(self) -> float:
        return self.pool.usage()

    def has_work(self) -> bool:
        return bool(self.running) or self.waiting.live > 0

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t

    def take_kv_events(self) -> list[KVEvent]:
        """KV-cache events recorded since the last call (empty unless enabled)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody uses (vLLM's ``reset_prefix_cache``): refused
        while any request holds blocks, as vLLM refuses it."""
        return self.pool.reset_prefix_cache()

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        ignore_eos: bool = False,
        seed: int | None = None,
        min_tokens: int = 0,
        output_token_ids: Sequence[int] | None = None,
    ) -> Request:
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("empty prompt")
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves no room within max_model_len "
                f"{self.max_model_len}"
            )
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if request_id in self.requests:
            raise ValueError(f"duplicate live request id {request_id!r}")
        max_tokens = min(max_tokens, self.max_model_len - prompt_len)

        req = Request()
        self._seq += 1
        req.request_id = request_id
        req.prompt_len = prompt_len
        req.token_ids = list(prompt_token_ids)
        req.num_computed = 0
        req.max_computed = 0
        req.blocks = []
        req.block_hashes = []
        req.first_extra = salt_key(cache_salt)
        req.hash_extra = self.hasher.first_extra(cache_salt)
        req.cache_salt = cache_salt
        if self.enable_prefix_caching:
            self.hasher.chain(
                req.token_ids, self.block_size, 0, 0, req.hash_extra, req.block_hashes
            )
        req.num_cached_blocks = 0
        req.status = WAITING
        req.priority = priority
        req.arrival_time = self.now if arrival_time is None else arrival_time
        req.seq = self._seq
        req.max_tokens = max_tokens

        prompt_hash = hash(tuple(prompt_token_ids)) & _MASK64
        if seed is None:
            key = _splitmix64((self.seed * 0x100000001B3 + self._seq) & _MASK64) ^ prompt_hash
        else:
            key = _splitmix64((seed & _MASK64) ^ 0xA5A5A5A5) ^ prompt_hash
        mixed = _splitmix64(key)
        u = ((mixed >> 11) + 0.5) / float(1 << 53)
        natural = max(1, round(math.exp(self._mu + self._sigma * _STD_NORMAL.inv_cdf(u))))
        natural = max(natural, min_tokens)
        if output_token_ids is not None:
            # A decided output (tool call, JSON): it ends where the text ends, or at max_tokens.
            if not output_token_ids:
                raise ValueError("output_token_ids must not be empty")
            natural = len(output_token_ids)
            ignore_eos = False
        if ignore_eos or natural > max_tokens:
            req.target_len, req.natural_reason = max_tokens, "length"
        else:
            req.target_len, req.natural_reason = natural, "stop"
        req.forced = output_token_ids
        req.tok_offset = _splitmix64(mixed) & OUTPUT_TABLE_MASK

        req.num_output = 0
        req.num_cached_tokens = -1
        req.num_preemptions = 0
        req.sched_step = -1
        req.step_tokens = 0
        req.first_scheduled_time = -1.0
        req.first_token_time = -1.0
        req.last_token_time = -1.0
        req.finish_time = -1.0
        req.finish_reason = None
        self.requests[request_id] = req
        self.waiting.push(req)
        return req

    def abort(self, request_id: str, reason: str = "abort") -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            self.waiting.live -= 1  # the queue entry is dropped lazily
        self._finish(req, reason, self.now)
        return req

    def _finish(self, req: Request, reason: str, t: float) -> None:
        if req.blocks:
            self.pool.release(req.blocks[::-1])
            req.blocks = []
        req.status = FINISHED
        req.finish_reason = reason
        req.finish_time = t
        del self.requests[req.request_id]
        stats = self.stats
        stats.request_success[reason] = stats.request_success.get(reason, 0) + 1
        stats.e2e.observe(max(0.0, t - req.arrival_time))
        if req.num_output > 1:
            stats.tpot.observe((req.last_token_time - req.first_token_time) / (req.num_output - 1))
        if self.on_finish is not None:
            self.on_finish(req)

    def _preempt(self, req: Request) -> None:
        if req.blocks:
            self.pool.release(req.blocks[::-1])
            req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.requeue(req)

    def _choose_victim(self) -> Request:
        if self.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.seq))
        return self.running[-1]

    def _cache_full_blocks(self, req: Request, full: int) -> None:
        """Register blocks ``num_cached_blocks..full`` of ``req`` in the prefix cache (at
        schedule time, before the step computes them, as vLLM's ``allocate_slots`` does)."""
        hashes = req.block_hashes
        bs = self.block_size
        if len(hashes) < full:
            parent = hashes[-1] if hashes else 0
            self.hasher.chain(
                req.token_ids[: full * bs], bs, len(hashes), parent, req.hash_extra, hashes
            )
        pool = self.pool
        cache_block = pool.cache_block
        blocks = req.blocks
        first = req.num_cached_blocks
        owner = req.first_extra
        for index in range(first, full):
            cache_block(blocks[index], hashes[index], owner)
        req.num_cached_blocks = full
        if pool.events is not None:
            pool.events.append(
                BlockStored(
                    block_hashes=hashes[first:full],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=req.token_ids[first * bs : full * bs],
                    block_size=bs,
                    cache_salt=req.cache_salt if first == 0 else None,
                )
            )

    # -- the iteration -------------------------------------------------------------------

    def step(self) -> StepResult:
        start = self.now
        self._step_no += 1
        step_no = self._step_no
        result = StepResult(start=start, duration=0.0)
        budget = self.max_num_batched_tokens
        bs = self.block_size
        pool = self.pool
        free = pool.free
        running = self.running
        scheduled: list[Request] = []
        preempted = result.preempted
        cap = self.long_prefill_token_threshold
        caching = self.enable_prefix_caching

        # 1. Running requests: decode, or the next chunk of an unfinished prefill.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.token_ids) - req.num_computed
            if 0 < cap < n:
                n = cap
            if n > budget:
                n = budget
            need = (req.num_computed + n + bs - 1) // bs - len(req.blocks)
            if need > 0:
                if need > len(free):
                    self_preempted = False
                    while need > len(free):
                        victim = self._choose_victim()
                        index = (
                            running.index(victim) if victim is not running[-1] else len(running) - 1
                        )
                        del running[index]
                        if victim.sched_step == step_no:
                            scheduled.remove(victim)
                            budget += victim.step_tokens
                            victim.sched_step = -1
                        if index < i:
                            i -= 1
                        self._preempt(victim)
                        preempted.append(victim)
                        if victim is req:
                            self_preempted = True
                            break
                    if self_preempted:
                        break
                req.blocks.extend(pool.allocate(need, req.first_extra))
            if caching and (req.num_computed + n) // bs > req.num_cached_blocks:
                self._cache_full_blocks(req, (req.num_computed + n) // bs)
            req.sched_step = step_no
            req.step_tokens = n
            scheduled.append(req)
            budget -= n
            i += 1

        # 2. Waiting requests, unless this step preempted (vLLM: no admissions then).
        if not preempted:
            waiting = self.waiting
            stats = self.stats
            full_gate = self.reserve_full_prompt
            while budget > 0 and len(running) < self.max_num_seqs:
                head = waiting.peek()
                if head is None:
                    break
                req = head
                num_tokens = len(req.token_ids)
                hits = pool.lookup(req.block_hashes, (num_tokens - 1) // bs) if caching else []
                computed = len(hits) * bs
                n = num_tokens - computed
                if 0 < cap < n:
                    n = cap
                if n > budget:
                    n = budget
                # 0.33: the whole sequence must fit (scheduler_reserve_full_isl); older
                # releases: the first chunk. Touching evictable hit blocks takes them out of
                # the free queue, so they do not count as free.
                gate_tokens = num_tokens if full_gate else computed + n
                gate_blocks = (gate_tokens + bs - 1) // bs
                if gate_blocks - len(hits) > len(free) - (pool.num_evictable(hits) if hits else 0):
                    break
                waiting.pop()
                if hits:
                    pool.touch(hits)
                req.blocks = hits
                req.num_cached_blocks = len(hits)
                req.num_computed = computed
                need = (computed + n + bs - 1) // bs - len(hits)
                if need > 0:
                    req.blocks.extend(pool.allocate(need, req.first_extra))
                if caching and (computed + n) // bs > req.num_cached_blocks:
                    self._cache_full_blocks(req, (computed + n) // bs)
                if req.num_cached_tokens < 0:  # first admission; re-admissions not counted
                    req.num_cached_tokens = computed
                    req.first_scheduled_time = start
                    stats.queue_time.observe(
                        start - req.arrival_time if start > req.arrival_time else 0.0
                    )
                    stats.prefix_cache_queries += num_tokens
                    stats.prefix_cache_hits += computed
                req.status = RUNNING
                running.append(req)
                req.sched_step = step_no
                req.step_tokens = n
                scheduled.append(req)
                budget -= n

        if not scheduled:
            return result

        # 3. Execute: roofline duration, then advance every scheduled request. A decode is
        # one token of a request that has output; anything else is a prefill chunk
        # (including recompute after preemption).
        tokens = 0
        context = 0
        pairs_prefill = 0.0
        tokens_prefill = 0
        pairs_decode = 0
        for req in scheduled:
            n = req.step_tokens
            before = req.num_computed
            tokens += n
            context += before + n
            if n == 1 and req.num_output:
                pairs_decode += before + 1
            else:
                tokens_prefill += n
                pairs_prefill += n * (before + (n + 1) / 2)
        tokens_decode = tokens - tokens_prefill
        compute = (
            tokens_prefill * self._flops_tok + pairs_prefill * self._flops_pair
        ) * self._s_per_prefill_flop + (
            tokens_decode * self._flops_tok + pairs_decode * self._flops_pair
        ) * self._s_per_decode_flop
        memory = (self._weights + context * self._kv_bytes) / self._bandwidth
        duration = compute if compute > memory else memory
        end = start + duration
        self.now = end
        result.duration = duration
        result.num_scheduled_tokens = tokens
        result.num_scheduled_seqs = len(scheduled)

        stats = self.stats
        stats.num_steps += 1
        stats.busy_time += duration
        table = self._out_table
        emitted = result.emitted
        finished = result.finished
        itl = stats.itl
        prefill_done = 0
        recomputed = 0
        for req in scheduled:
            before = req.num_computed
            computed = before + req.step_tokens
            req.num_computed = computed
            high = req.max_computed
            prefill_end = high if high > req.prompt_len else req.prompt_len
            if before < prefill_end:
                prefill_done += (computed if computed < prefill_end else prefill_end) - before
                if before < high:
                    recomputed += (computed if computed < high else high) - before
            if computed > high:
                req.max_computed = computed
            if computed != len(req.token_ids):
                continue  # mid-prefill chunk: no token yet
            num_output = req.num_output
            forced = req.forced
            req.token_ids.append(
                table[(req.tok_offset + num_output) & OUTPUT_TABLE_MASK]
                if forced is None
                else forced[num_output]
            )
            num_output += 1
            req.num_output = num_output
            if num_output == 1:
                req.first_token_time = end
                stats.ttft.observe(end - req.arrival_time if end > req.arrival_time else 0.0)
                stats.prompt_tokens += req.prompt_len
            else:
                itl.observe(end - req.last_token_time)
            req.last_token_time = end
            emitted.append(req)
            if num_output >= req.target_len:
                finished.append(req)
        stats.generation_tokens += len(emitted)
        stats.prefill_tokens_computed += prefill_done
        stats.recomputed_tokens += recomputed
        if finished:
            for req in finished:
                req.status = FINISHED  # marks them for the filter below
            self.running = [r for r in running if r.status == RUNNING]
            for req in finished:
                self._finish(req, req.natural_reason, end)
        return result
