"""Prompt-token estimate made before admission: an upper bound, not an average.

The estimate sizes the context check, tokens/min, the KV·seconds lease, the long-context
budget and routing, so a client that can make it low can exceed all of them. The exact
count comes back in the replica's ``usage`` chunk and is what settle reconciles and what
gets billed; the estimate only has to be safe.

Each message costs 4 tokens of chat-template overhead plus its content, and the reply
priming adds 3. Content is split on whitespace, and a word costs:

- its ASCII bytes: ``ceil(bytes / 4)``, the replicas' (emulated) tokenizer rule, exact for
  the emulated fleet and the English average of a Llama-3-style byte-level BPE (~4 bytes
  per token). Not a bound for a real BPE on adversarial ASCII (``a1b2c3``, punctuation
  soup: up to one token per byte); gateway/README.md ("Tokens") says why it is kept;
- every non-ASCII character: its UTF-8 length. A byte-level BPE (Llama 3's tiktoken-style
  tokenizer, GPT-2's) never emits more tokens than bytes — every token covers at least one
  byte — and a character its vocabulary has no merge for falls back to one token per byte.
  So per script class: 2 per character for Latin-1/Greek/Cyrillic/Hebrew/Arabic, 3 for CJK,
  kana, Hangul and the rest of the BMP, 4 for emoji and other astral characters. That is
  tight: rare CJK ideographs and many emoji do take 3–4 tokens in Llama 3's vocabulary,
  though common CJK takes ~1 per character (the bound is then ~3x the real count).
  The emulated tokenizer counts ``ceil(bytes / 4)`` for such words, so the bound is also
  above it (~4x for CJK).

That rule is what a model without a tokenizer file gets. A model whose ``tokenizer.json``
(the Hugging Face file every vLLM deployment has) is configured (``GATEWAY_TOKENIZER_FILES``,
gateway/config.py) is counted by ``ExactCounter`` instead, with the ``tokenizers`` library:
each message's content exactly, plus its leading whitespace once more at one token per
byte, plus ``EXACT_MESSAGE_OVERHEAD`` (8) per message and ``EXACT_REPLY_PRIMING`` (32) per
prompt. That is a bound for chat templates that put a message's content after a newline
or a special token and before a special token (Llama 3: ``<|start_header_id|>role
<|end_header_id|>\n\n … <|eot_id|>``, 5 tokens; ChatML/Qwen: ``<|im_start|>role\n …
<|im_end|>\n``, 5): a special token is a hard split and the byte-level pre-tokenizer's
regex looks only forward, so content that starts with a non-space splits into the same
pieces as on its own, and each piece's BPE is the same; whitespace the content starts with
can merge with the template's newline into one piece, which costs at most one token per
byte (its bytes, counted again, plus the newline's allowance cover it). 8 covers role
names of up to 3 tokens; 32 covers BOS, the reply's header (``<|start_header_id|>assistant
<|end_header_id|>\n\n``) and Llama 3.1's default system preamble (its knowledge and
today's date, ~25 tokens). A template that injects more (a long default system prompt)
is not covered. Raw completions add the post-processor's special tokens (BOS).

Cost, measured on this repository's 2-core development machine under load with the
byte-level BPE tests/hardening/test_exact_tokens.py trains: ~0.1–0.6 ms per KiB of prompt,
English, CJK or punctuation soup alike (the spread is the machine's load). ``encode``
holds the GIL; ``encode_batch_fast`` releases it, so a request body over
``INLINE_MAX_BYTES`` (4 KiB, ~0.5–2 ms) is counted in a bounded thread pool
(``CountingPool``, ``POOL_THREADS`` per process) and the event loop keeps serving:
counting 256 KiB inline stalled the loop 88–524 ms, in the pool 4–13 ms. Smaller bodies
are counted inline. Counting comes before any quota is charged, so the pool's queue is
fair between tenants: each tenant's waiting counts form their own queue and the threads
take the tenants in turn. A tenant with dozens of 1 MiB bodies waiting (up to its
concurrent-request cap, ~0.5 s each) delays another tenant's large body by the counts
already running and one more per tenant ahead in the turn, not by its whole backlog.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

MESSAGE_OVERHEAD = 4
REPLY_PRIMING = 3
BOS = 1  # the replica adds a beginning-of-sequence token to a raw prompt

EXACT_MESSAGE_OVERHEAD = 8
EXACT_REPLY_PRIMING = 32
INLINE_MAX_BYTES = 4096
POOL_THREADS = 2


_ASCII = bytes(range(0x80))


def _word_tokens(word: str) -> int:
    raw = word.encode("utf-8", "surrogatepass")
    # Bytes of non-ASCII characters, one token each at worst (C speed: a 1 MiB CJK body
    # must not cost a Python loop per character).
    other = len(raw.translate(None, _ASCII))
    return ((len(raw) - other + 3) >> 2) + other


def text_tokens(text: str) -> int:
    if text.isascii():
        # Fast path: for ASCII, characters are bytes.
        return sum((len(word) + 3) >> 2 for word in text.split())
    return sum(_word_tokens(word) for word in text.split())


def prompt_tokens(message_texts: Iterable[str]) -> int:
    """Tokens of a chat prompt given each message's text content (one entry per message)."""
    total = REPLY_PRIMING
    for text in message_texts:
        total += MESSAGE_OVERHEAD + text_tokens(text)
    return total


class Rule:
    """The estimate without the model's tokenizer: the rule above."""

    message_overhead = MESSAGE_OVERHEAD
    bos = BOS

    def text_tokens(self, text: str) -> int:
        return text_tokens(text)

    def prompt_tokens(self, message_texts: Iterable[str]) -> int:
        return prompt_tokens(message_texts)


RULE = Rule()


class ExactCounter(Rule):
    """A model's own tokenizer: exact content counts, template overheads as upper bounds."""

    message_overhead = EXACT_MESSAGE_OVERHEAD

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bos = max(BOS, tokenizer.num_special_tokens_to_add(False))

    @classmethod
    def from_file(cls, path: Path) -> ExactCounter:
        """Load a Hugging Face ``tokenizer.json``; ``ValueError`` says why it cannot be."""
        try:
            from tokenizers import Tokenizer  # only where a tokenizer file is configured

            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the library raises plain Exception for a bad file
            raise ValueError(f"{path}: {exc}") from exc

    def text_tokens(self, text: str) -> int:
        if not text:
            return 0
        (encoding,) = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)
        count: int = len(encoding)
        stripped = text.lstrip()
        if len(stripped) != len(text):  # may merge with the template's newline
            count += len(text[: len(text) - len(stripped)].encode("utf-8", "surrogatepass"))
        return count

    def prompt_tokens(self, message_texts: Iterable[str]) -> int:
        total = EXACT_REPLY_PRIMING
        for text in message_texts:
            total += EXACT_MESSAGE_OVERHEAD + self.text_tokens(text)
        return total


_T = TypeVar("_T")


@dataclass(slots=True)
class _Job:
    count: Callable[[], Any]
    done: asyncio.Future[Any]


class CountingPool:
    """The thread pool that counts large prompts off the event loop, fair between tenants:
    a queue per tenant, served in turn (round robin) whenever a thread is free. One per
    gateway process; ``close`` at shutdown."""

    def __init__(self, threads: int = POOL_THREADS) -> None:
        if threads < 1:
            raise ValueError("threads >= 1")
        self._threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tokens")
        self._queues: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()  # tenants with waiting jobs, in serving order
        self._running = 0
        self._closed = False

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def running(self) -> int:
        return self._running

    async def run(self, tenant_id: str, size: int, count: Callable[[], _T]) -> _T:
        """``count()`` inline for a body of at most INLINE_MAX_BYTES, else on a pool
        thread when ``tenant_id``'s turn comes."""
        if size <= INLINE_MAX_BYTES or self._closed:  # closed: a straggler of the drain
            return count()
        done: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(tenant_id)
        if queue is None:
            queue = self._queues[tenant_id] = deque()
            self._turns.append(tenant_id)
        queue.append(_Job(count, done))
        self._start()
        # A caller that goes away (client gone, shutdown) cancels ``done``: a job not yet
        # started is skipped; one running finishes on its thread and its result is dropped.
        return await done

    def _start(self) -> None:
        while self._running < self._threads and self._turns:
            tenant_id = self._turns.popleft()
            queue = self._queues[tenant_id]
            job = queue.popleft()
            if queue:
                self._turns.append(tenant_id)  # the tenant's next job waits for its turn
            else:
                del self._queues[tenant_id]
            if job.done.done():  # cancelled while waiting
                continue
            self._running += 1
            self._executor.submit(job.count).add_done_callback(
                functools.partial(self._back, job.done.get_loop(), job)
            )

    def _back(
        self, loop: asyncio.AbstractEventLoop, job: _Job, future: concurrent.futures.Future[Any]
    ) -> None:
        """On the pool's thread: hand the result to the event loop (unless it is gone)."""
        with contextlib.suppress(RuntimeError):  # the loop closed while this counted
            loop.call_soon_threadsafe(self._finished, future, job)

    def _finished(self, future: concurrent.futures.Future[Any], job: _Job) -> None:
        self._running -= 1
        if future.cancelled():  # by ``close``
            job.done.cancel()
        elif not job.done.done():
            if (exc := future.exception()) is not None:
                job.done.set_exception(exc)
            else:
                job.done.set_result(future.result())
        self._start()

    def close(self) -> None:
        """Stop taking jobs; waiting callers are cancelled, running counts are not awaited."""
        self._closed = True
        for queue in self._queues.values():
            for job in queue:
                job.done.cancel()
        self._queues.clear()
        self._turns.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
