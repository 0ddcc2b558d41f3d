"""Which replica already holds a request's prompt prefix: block hashes, the index, KV events.

**Hashes.** A replica's prefix cache is keyed by chained hashes of full token blocks: block
``i``'s hash covers its tokens and block ``i-1``'s hash, and the first block also mixes in the
request's ``cache_salt`` (the gateway sets it per tenant), so two tenants never share a chain
and an index keyed by these hashes can never match across tenants. ``prompt_token_ids`` and
``block_hashes`` reproduce the replicas' computation exactly: the chat template and tokenizer
rules and the chain hash of the emulated fleet (``contracts.tokenizer``,
``contracts.blockhash``, which the emulator imports too: shared, not copied, so they cannot
drift; the gateway never imports the emulator). Only the blocks a replica can serve from cache
count: vLLM recomputes at least the prompt's last token, so ``(n - 1) // block_size``
blocks.

The hash scheme is selectable (``contracts.blockhash.get_hasher``; ``GATEWAY_PREFIX_HASH``, and
the replica's ``--prefix-caching-hash-algo``): the emulator's chain hash by default, or vLLM
v1's ``sha256``/``sha256_cbor`` construction seeded by the replicas' ``PYTHONHASHSEED``
(``GATEWAY_PREFIX_HASH_SEED``). The index keys on the low 64 bits (``& MASK64``) of either,
which is what vLLM's KV events carry as an int, and what a 32-byte digest in an event is
reduced to (``event_hash``). Two things must match a real vLLM replica for KV events to be
usable: the scheme with its seed, and the token ids — for a real model, its own tokenizer
and chat template, which ``prompt_token_ids`` here does not have (it renders the emulator's).
The index fed by this process's own dispatches needs neither: it only compares hashes this
process computed. The cost measured here (``python -m bench.prefix_routing --hash-cost``) is
the emulated tokenizer's with the emulator's hash.

**Index.** ``PrefixIndex``: for each replica, the block hashes it is believed to hold, in
LRU order with a last-seen time. Two writers:

* the router's own dispatches (``record``): every prompt sent to a replica leaves its full
  blocks there (cached at schedule time). Approximate — it misses other gateway processes'
  dispatches and does not see evictions — so entries age out after ``ttl_s`` and each
  replica keeps at most ``max_blocks_per_replica`` (a bound on memory: ~140 bytes a block);
* a replica's KV-cache events (``apply_events``, fed by ``KVEventSubscriber``): what the
  replica actually stored and evicted, for every gateway process alike.

``match`` walks the request's chain once per replica and stops at the first unknown block,
as the replica's own lookup does; ``match_query`` walks a lazy ``PrefixQuery`` block by block
across the replicas and stops at the first block none of them holds, hashing no further.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from contracts.blockhash import EMULATOR_HASHER, BlockHasher, salt_key
from contracts.tokenizer import PromptTokenizer

log = logging.getLogger("gateway.prefix")

MASK64 = (1 << 64) - 1
# The depth of the keys that place a prefix nobody holds yet, in blocks: the shared key (the
# chain hash at this block: deep enough to tell a tenant's system prompts apart, shallow
# enough to be shared by their conversations), and how far into a conversation's first user
# message its conversation key reaches (``conversation_block``).
PLACEMENT_BLOCK = 3


class PrefixQuery:
    """What the router needs of one request to weigh cache affinity, computed lazily.

    A chain hash means nothing past the first block no replica holds (the replica's own
    lookup stops there too), so the hot path hashes only as far as the index can follow and
    the placement key needs: ``make_query`` tokenizes up to the key's block (a chat prompt:
    its messages up to the first user message, and that message's first
    ``PLACEMENT_BLOCK`` blocks; otherwise the first ``PLACEMENT_BLOCK`` blocks; a prompt
    that cannot fill one block, all of it), ``PrefixIndex.match_query`` hashes further only
    while some replica holds the chain. The rest, every block, is computed by ``settle``
    only for the request dispatched (``Router.on_dispatch`` records them), not for the
    choice, tokenizing from where ``make_query`` stopped. ``block_hashes`` and
    ``prompt_tokens`` settle the query first, so they always give the whole (capped)
    prompt's figures.

    Keys: ``placement_key`` places a prompt nobody holds (a client hint's key; else the
    conversation key, the chain hash of ``conversation_block``, with ``key_tokens`` the
    tokens through that block; else the chain hash at ``PLACEMENT_BLOCK``); ``shared_key``,
    with a conversation key, is the chain hash at ``PLACEMENT_BLOCK`` (or the conversation
    key's block if that comes first): what the tenant's conversations with the same
    system prompt share (``gateway.admission.placement``)."""

    __slots__ = (
        "tenant_id",
        "block_size",
        "placement_key",
        "hinted",
        "_messages",
        "_cap",
        "_tokens",
        "_tokenized",
        "_hasher",
        "_extra",
        "_hashes",
        "_resume",
        "key_tokens",
        "shared_key",
        "turns",
    )

    def __init__(
        self,
        tenant_id: str,
        block_size: int,
        tokens: Sequence[int],
        *,
        cache_salt: str,
        hasher: BlockHasher = EMULATOR_HASHER,
        hint: str | None = None,
        messages: Sequence[Mapping[str, str]] = (),
        cap: int = 0,
        first_user: tuple[int, int | None] | None = None,
        resume: tuple[int, int] = (0, 0),
        turns: int = 0,
    ) -> None:
        """``tokens``: the prompt's token ids; with ``messages``, only the first ones of
        those messages' prompt, whose first ``cap`` tokens are the whole query (``resume``:
        the first ``resume[1]`` of ``tokens`` are those of ``messages[:resume[0]]`` whole,
        and tokenizing the rest starts there). ``first_user``: where the first user
        message's content starts in the prompt and where that message ends (None: past the
        tokens known), for the conversation key (``conversation_block``). ``turns``: the
        assistant turns the prompt holds (``assistant_turns``): 0 for a conversation's first
        turn, which nothing has cached yet (``placement._place_conversation``)."""
        self.tenant_id = tenant_id
        self.turns = turns
        self.block_size = block_size
        self._messages = messages
        self._cap = cap
        self._resume = resume
        self._tokens = tokens
        self._tokenized = not messages
        self._hasher = hasher
        self._extra = hasher.first_extra(cache_salt)
        self._hashes: list[int] = []
        self.hinted = hint is not None
        # The prompt tokens through the conversation key's block (0: not a conversation key).
        self.key_tokens = 0
        self.shared_key = 0
        # Placement key for a prefix no replica holds: the client's ``prompt_cache_key`` (or
        # ``user``) hashed with the tenant's salt, else the conversation key (the chain hash
        # of ``conversation_block``), else the chain hash at ``PLACEMENT_BLOCK``.
        block = None
        if hint is None and first_user is not None:
            block = conversation_block(first_user[0], first_user[1], block_size)
        if hint is not None:
            self.placement_key = hint_key(hint, cache_salt)
        elif block is not None and (key := self.hash_at(block)) is not None:
            self.placement_key = key & MASK64
            self.key_tokens = (block + 1) * block_size
            self.shared_key = self._hashes[min(block, PLACEMENT_BLOCK - 1)] & MASK64
        elif self.hash_at(0) is not None:
            if self.hash_at(PLACEMENT_BLOCK - 1) is None:  # a whole prompt of fewer blocks
                self.settle()
            self.placement_key = self._hashes[min(len(self._hashes), PLACEMENT_BLOCK) - 1] & MASK64
        else:  # under one block: nothing to share, spread like any unique prompt
            self.placement_key = hash((salt_key(cache_salt), tuple(self._tokens))) & MASK64

    def _usable(self) -> int:
        """Cacheable blocks among the tokens known: vLLM recomputes at least the prompt's
        last token, so ``(n - 1) // block_size`` of a whole prompt; of a prompt known only
        in part (``n`` tokens, more to come) all ``n // block_size`` are full and usable."""
        n = len(self._tokens)
        if not n:
            return 0
        return (n - 1) // self.block_size if self._tokenized else n // self.block_size

    def _tokenize(self) -> None:
        if not self._tokenized:
            done, whole = self._resume
            head = list(self._tokens[:whole])
            self._tokens = head + prompt_token_ids(self._messages[done:], self._cap - whole)
            self._tokenized = True

    def hash_at(self, index: int) -> int | None:
        """Block ``index``'s chain hash, or None past the prompt's cacheable blocks. Hashes
        ahead in doubling steps (linear in all), tokenizing the rest of the prompt only when
        the known tokens run out."""
        hashes = self._hashes
        if index < len(hashes):
            return hashes[index]
        if index >= self._usable():
            self._tokenize()
        usable = self._usable()
        if index >= usable:
            return None
        have = len(hashes)
        end = min(usable, max(index + 1, 2 * have))
        self._hasher.chain(
            self._tokens, self.block_size, have, hashes[-1] if have else 0, self._extra, hashes, end
        )
        return hashes[index]

    def known_hashes(self) -> Sequence[int]:
        """The blocks hashed so far: a prefix of ``block_hashes`` (no work)."""
        return self._hashes

    @property
    def known_prompt_tokens(self) -> int:
        """The prompt tokens counted so far: ``prompt_tokens`` once settled, less before."""
        return len(self._tokens)

    @property
    def settled(self) -> bool:
        return self._tokenized and len(self._hashes) == self._usable()

    def settle(self) -> None:
        """Tokenize and hash the whole (capped) prompt."""
        self._tokenize()
        usable = self._usable()
        if len(self._hashes) < usable:
            self.hash_at(usable - 1)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """Cacheable full blocks, in chain order (settles the query)."""
        self.settle()
        return tuple(self._hashes)

    @property
    def prompt_tokens(self) -> int:
        """Tokens examined: a long prompt's first ``max_blocks`` blocks (settles)."""
        self._tokenize()
        return len(self._tokens)


# One per process: its word cache is bounded by the tokenizer itself.
_TOKENIZER = PromptTokenizer()


def prompt_token_ids(messages: Sequence[Mapping[str, str]], limit: int | None = None) -> list[int]:
    """The prompt's token ids as the replica computes them (its chat template); with
    ``limit``, only the first ``limit`` of them (messages past it are not tokenized)."""
    if limit is None:
        return _TOKENIZER.apply_chat_template(
            [{"role": m["role"], "content": m.get("content")} for m in messages]
        )
    out: list[int] = []
    for m in messages:  # the template is per message: a prefix of messages is a prefix
        # [start_header, role, end_header, eot] around the content's tokens
        frame = _TOKENIZER.apply_chat_template(
            [{"role": m["role"], "content": None}], add_generation_prompt=False
        )
        out += frame[:-1]
        content = m.get("content") or ""
        if len(content) <= limit:
            _TOKENIZER.encode_text(content, out)
        else:  # every word is at least one token: the first ``limit`` words are enough,
            # tokenized a slice at a time so a huge message stops where the cap is reached
            words = content.split(None, limit)[:limit]
            for start in range(0, len(words), 1024):
                _TOKENIZER.encode_text(" ".join(words[start : start + 1024]), out)
                if len(out) > limit:
                    break
        if len(out) > limit:
            return out[:limit]
        out.append(frame[-1])
    out += _TOKENIZER.apply_chat_template([], add_generation_prompt=True)
    return out[:limit]


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    hasher: BlockHasher = EMULATOR_HASHER,
) -> list[int]:
    """Chained hashes of the blocks a replica can serve from cache (not the last token's)."""
    usable = ((len(token_ids) - 1) // block_size) * block_size if token_ids else 0
    out: list[int] = []
    hasher.chain(token_ids[:usable], block_size, 0, 0, hasher.first_extra(cache_salt), out)
    return out


def event_hash(h: int | bytes) -> int:
    """A block hash from a KV event as the index keys it: an int's low 64 bits, or a
    digest's big-endian value's (vLLM sends the digest's last 8 bytes as an int by default,
    the digest with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: both give the same key)."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h, "big") & MASK64
    return h & MASK64


def hint_key(hint: str, cache_salt: str) -> int:
    """A client affinity hint (``prompt_cache_key``/``user``) as a per-tenant placement key:
    the same hint from two tenants gives unrelated keys."""
    digest = hashlib.blake2b(
        hint.encode("utf-8"), digest_size=8, key=cache_salt.encode("ascii")[:64]
    ).digest()
    return int.from_bytes(digest, "little")


def conversation_block(user_start: int, user_end: int | None, block_size: int) -> int | None:
    """The block whose chain hash keys a conversation's placement: the last full block of its
    first user message, at most ``PLACEMENT_BLOCK`` blocks past the one where that message's
    content starts (``user_start``: its first content token's position in the prompt;
    ``user_end``: the position just past the message, its end-of-turn token included, None
    when it goes on past the tokens known). Every turn of a conversation resends that
    message after the same system prompt, so every turn, in every gateway process, has the
    same key; two conversations have different keys as soon as their first user messages
    differ within the key's block, however long the system prompt they share. A first user
    message too short to end a block past its start gives the last block it ends, the
    system prompt's (a key shared with the tenant's other such conversations); none at all
    (under one block): None. Conversations that open with the same user message (few-shot
    examples before the question) share a key, as all of a tenant's did before."""
    last = user_start // block_size + PLACEMENT_BLOCK
    if user_end is not None:
        last = min(last, user_end // block_size)
    return last - 1 if last > 0 else None


def _conversation_head(
    messages: Sequence[Mapping[str, str]], cap: int, block_size: int
) -> tuple[list[int], tuple[int, int | None] | None, tuple[int, int], bool]:
    """The prompt's tokens (``prompt_token_ids``, capped at ``cap``) as far as the
    conversation key needs them: the messages before the first user message whole, and that
    message's content up to its key block (``conversation_block``). Returns (tokens,
    (user_start, user_end) or None when the capped prompt ends before that message, (how
    many messages are tokenized whole, their tokens), whether the tokens are the whole
    capped prompt)."""
    out: list[int] = []
    for i, m in enumerate(messages):
        frame = _TOKENIZER.apply_chat_template(
            [{"role": m["role"], "content": None}], add_generation_prompt=False
        )
        whole = len(out)
        out += frame[:-1]
        start = len(out)
        user = m["role"] == "user"
        if start >= cap:
            return out[:cap], (start, None) if user else None, (0, 0), True
        # every word is at least one token: a message's first ``limit`` words reach as far
        # as it needs (the cap; for the first user message, its key block)
        limit = cap - start
        if user:
            limit = min(limit, (start // block_size + PLACEMENT_BLOCK) * block_size - start)
        content = m.get("content") or ""
        cut = False
        if len(content) > limit:
            words = content.split(None, limit)
            cut = len(words) > limit
            content = " ".join(words[:limit])
        _TOKENIZER.encode_text(content, out)
        if len(out) >= cap:  # the capped prompt ends in this message
            return out[:cap], (start, None) if user else None, (0, 0), True
        if not user:
            out.append(frame[-1])
            continue
        if cut:  # the rest of the message is tokenized with the rest of the prompt
            return out, (start, None), (i, whole), False
        out.append(frame[-1])
        end = len(out)
        if i + 1 == len(messages) or end >= cap:  # the whole prompt (the generation
            # prompt closes it), or as much of it as is examined
            out += _TOKENIZER.apply_chat_template([], add_generation_prompt=True)
            return out[:cap], (start, end), (0, 0), True
        return out, (start, end), (i + 1, end), False
    raise ValueError("no user message")


def make_query(
    tenant_id: str,
    messages: Sequence[Mapping[str, str]],
    cache_salt: str,
    block_size: int,
    hint: str | None = None,
    max_blocks: int = 2048,
    hasher: BlockHasher = EMULATOR_HASHER,
) -> PrefixQuery:
    """A request's query. At most ``max_blocks`` leading blocks are ever hashed: it bounds
    the cost for very long prompts (tokenizing and hashing ~60 ns a token here), and a match
    that long already decides the choice. Only what the placement key needs is tokenized and
    hashed here: with a user message and no hint, the messages up to the conversation key's
    block (``conversation_block``: a system prompt, whole, and the first ``PLACEMENT_BLOCK``
    blocks of the first user message), else the first ``PLACEMENT_BLOCK`` blocks (a prompt
    that cannot fill one block: all of it, and no hash); the rest when the index follows the
    chain, or when the dispatch is recorded (``PrefixQuery``), from where this stopped."""
    cap = max_blocks * block_size + 1
    first_user: tuple[int, int | None] | None = None
    resume = (0, 0)
    if hint is None and any(m.get("role") == "user" for m in messages):
        tokens, first_user, resume, whole = _conversation_head(messages, cap, block_size)
    else:
        head = min(cap, PLACEMENT_BLOCK * block_size + 1)
        tokens = prompt_token_ids(messages, head)
        whole = not len(tokens) == head < cap  # not cut at ``head``: the whole prompt
    return PrefixQuery(
        tenant_id,
        block_size,
        tokens,
        cache_salt=cache_salt,
        hasher=hasher,
        hint=hint,
        messages=() if whole else messages,
        cap=cap,
        first_user=first_user,
        resume=resume,
        turns=assistant_turns(messages),
    )


def query_from_tokens(
    tenant_id: str,
    tokens: Sequence[int],
    cache_salt: str,
    block_size: int,
    hint: str | None = None,
    hasher: BlockHasher = EMULATOR_HASHER,
    first_user: tuple[int, int | None] | None = None,
    turns: int = 0,
) -> PrefixQuery:
    """The query of a prompt already tokenized (all of ``tokens``); ``first_user``: where
    its first user message's content starts and where that message ends, when known (the
    conversation key, ``conversation_block``); ``turns``: as ``PrefixQuery``'s
    (``assistant_turns`` of the messages)."""
    return PrefixQuery(
        tenant_id,
        block_size,
        tokens,
        cache_salt=cache_salt,
        hasher=hasher,
        hint=hint,
        first_user=first_user,
        turns=turns,
    )


def assistant_turns(messages: Sequence[Mapping[str, object]]) -> int:
    """How many assistant turns a chat prompt holds: 0 for a conversation's first turn (a
    system prompt and a user message, however long: no earlier turn is cached anywhere, and
    there may never be a second), n for its (n+1)th."""
    return sum(1 for m in messages if m.get("role") == "assistant")


class PrefixIndex:
    """Replica -> block hashes it is believed to hold; bounded per replica, aged by TTL.

    Single-threaded (the gateway's event loop); the KV-event subscriber applies events on the
    same loop."""

    def __init__(
        self,
        *,
        max_blocks_per_replica: int = 200_000,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks_per_replica < 1 or ttl_s <= 0:
            raise ValueError("the index needs a positive bound and TTL")
        self.max_blocks = max_blocks_per_replica
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[str, OrderedDict[int, float]] = {}
        self.evicted = 0  # entries dropped for the bound (not by TTL or events)

    def __len__(self) -> int:
        return sum(len(b) for b in self._blocks.values())

    def replicas(self) -> list[str]:
        return list(self._blocks)

    def blocks_of(self, replica_id: str) -> int:
        held = self._blocks.get(replica_id)
        return len(held) if held else 0

    def record(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica holds these blocks now (a dispatch, or a BlockStored event)."""
        held = self._blocks.get(replica_id)
        if held is None:
            held = self._blocks[replica_id] = OrderedDict()
        now = self._clock()
        move = held.move_to_end
        for h in hashes:
            h &= MASK64
            if h in held:
                move(h)
            held[h] = now
        over = len(held) - self.max_blocks
        if over > 0:
            self.evicted += over
            for _ in range(over):
                held.popitem(last=False)

    def remove(self, replica_id: str, hashes: Iterable[int]) -> None:
        held = self._blocks.get(replica_id)
        if held is None:
            return
        for h in hashes:
            held.pop(h & MASK64, None)

    def clear(self, replica_id: str) -> None:
        self._blocks.pop(replica_id, None)

    def _expire(self, held: OrderedDict[int, float], now: float) -> None:
        cutoff = now - self.ttl_s
        while held:
            h, seen = next(iter(held.items()))
            if seen >= cutoff:
                break
            del held[h]

    def match(self, hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each replica holds (0 where none)."""
        now = self._clock()
        out: dict[str, int] = {}
        for rid in replica_ids:
            held = self._blocks.get(rid)
            if not held:
                out[rid] = 0
                continue
            self._expire(held, now)
            n = 0
            for h in hashes:
                if (h & MASK64) not in held:
                    break
                n += 1
            out[rid] = n
        return out

    def match_query(self, query: PrefixQuery, replica_ids: Iterable[str]) -> dict[str, int]:
        """``match`` of the query's chain, hashing it only as far as some replica holds it:
        block by block across the replicas, stopping at the first block none holds (nothing
        after it can match), so a prompt nobody holds costs one lookup per replica."""
        now = self._clock()
        out: dict[str, int] = {}
        live: list[tuple[str, OrderedDict[int, float]]] = []
        for rid in replica_ids:
            out[rid] = 0
            held = self._blocks.get(rid)
            if held:
                self._expire(held, now)
                if held:
                    live.append((rid, held))
        # In chunks of what the query has hashed (it hashes ahead in doubling steps):
        # each replica still matching walks the chunk, as ``match`` walks the chain.
        hashes = query.known_hashes()
        index = 0
        while live:
            if index >= len(hashes) and query.hash_at(index) is None:
                break
            end = len(hashes)
            still = []
            for rid, held in live:
                n = index
                while n < end and hashes[n] & MASK64 in held:
                    n += 1
                out[rid] = n
                if n == end:
                    still.append((rid, held))
            live = still
            index = end
        return out

    def apply_events(self, replica_id: str, events: Sequence[Mapping[str, Any]]) -> None:
        """vLLM KV-cache events (decoded maps) from ``replica_id``."""
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self.record(replica_id, map(event_hash, ev.get("block_hashes") or ()))
            elif kind == "BlockRemoved":
                self.remove(replica_id, map(event_hash, ev.get("block_hashes") or ()))
            elif kind == "AllBlocksCleared":
                self.clear(replica_id)


def decode_event_batch(payload: bytes) -> list[dict[str, Any]]:
    """vLLM's ``KVEventBatch`` (msgpack ``[ts, events, dp_rank]``) into event maps.

    Events arrive as maps tagged with ``type`` (the emulator's and vLLM's encoding with
    ``array_like=False``) or as arrays whose first item is the tag (msgspec's
    ``array_like=True``); arrays are mapped by vLLM's field order."""
    import msgpack  # imported here: only gateways that subscribe need it

    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError("not a KV event batch")
    out: list[dict[str, Any]] = []
    for ev in batch[1]:
        if isinstance(ev, dict):
            out.append(ev)
        elif isinstance(ev, list | tuple) and ev:
            tag = ev[0]
            if tag == "BlockStored":
                out.append({"type": tag, "block_hashes": ev[1]})
            elif tag == "BlockRemoved":
                out.append({"type": tag, "block_hashes": ev[1]})
            elif tag == "AllBlocksCleared":
                out.append({"type": tag})
    return out


class KVEventSubscriber:
    """A ZMQ SUB consumer of one replica's KV-cache events, applied to a ``PrefixIndex``.

    Sequence numbers are checked: a gap (dropped messages under the high-water mark, a
    replica restart) means the index no longer knows what the replica holds, so the
    replica's entries are dropped and rebuilt from the events that follow (and from the
    router's own dispatches)."""

    def __init__(self, index: PrefixIndex, replica_id: str, endpoint: str, topic: str = "") -> None:
        self.index = index
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.topic = topic
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self._next_seq: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: Any = None
        self._ctx: Any = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def handle(self, frames: Sequence[bytes]) -> None:
        """One message ``(topic, seq, payload)``."""
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big")
        if self._next_seq is not None and seq != self._next_seq:
            self.gaps += 1
            self.index.clear(self.replica_id)
            log.warning("kv events from %s: gap at seq %d", self.replica_id, seq)
        self._next_seq = seq + 1
        try:
            events = decode_event_batch(frames[2])
        except Exception:  # a foreign or corrupt message must not stop the consumer
            log.warning("kv events from %s: undecodable batch %d", self.replica_id, seq)
            return
        self.index.apply_events(self.replica_id, events)
        self.batches += 1
        self.events += len(events)

    async def _run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self.handle(frames)


def parse_endpoints(raw: str) -> dict[str, str]:
    """``GATEWAY_PREFIX_KV_EVENTS``: ``replica_id=tcp://host:port,...``."""
    out: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        rid, sep, endpoint = item.partition("=")
        if not sep or not rid or not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"bad kv events endpoint {item!r} (want replica_id=tcp://host:port)")
        out[rid] = endpoint
    return out
