"""The billing rule: what a request is charged, whatever way it ended.

It is decided in two places, because its inputs are seen in two places:

- **The gateway decides the counts an event reports** (``StreamTracker.prompt_tokens``,
  ``completion_tokens`` and ``cached_tokens`` in gateway/upstream/relay.py): only it sees
  the stream, so the choice in rule 1 of which prompt count stands (the replica's, the
  gateway's estimate, or 0) and the count of completion tokens relayed are made there, and
  a usage event carries just the resulting numbers. The gateway imports nothing from here
  (the import-linter contracts in pyproject.toml), so that part cannot live in this module.
- **This module applies the rest, at the consumer** (``metering.events.check`` calls it on
  every event): the zero completion of rule 3 for an error status, and the finish reasons
  counted in rule 5 (metering/store.py rolls them up). The check that cached tokens are
  within the prompt (rule 2) is ``metering.events.check``'s, which refuses such an event
  before it gets here.

1. **Prompt tokens are billed once prefill ran** — once the replica accepted the request
   and started on it, the fleet did that work for the customer, whatever happened next
   (finished, failed mid-way, cancelled). The gateway reports the replica's exact prompt
   count when the replica sent its usage (the final usage chunk, else the last per-chunk
   continuous usage of a stream cut off before it), its own estimate when tokens came back
   but no usage did (a cancelled or broken stream: prefill certainly ran), and 0 when
   nothing shows that prefill ran (refused by the replica, replica unreachable, failed or
   cancelled before the first token). The consumer bills that reported number as is.
2. **Cached tokens** are the part of those prompt tokens the prefix cache served; billed at
   the cached price, never more than the prompt tokens (an event claiming more is refused
   as impossible before it gets here).
3. **Completion tokens are those actually delivered.** A stream keeps status 200 from its
   first byte on, even when it fails or is cancelled later, and what it relayed until then
   is billed (cancelling must not be a free way to get output the client already has). A
   request whose client saw an error status (4xx/5xx, including 499 for a JSON client that
   left) received no completion: 0 completion tokens, whatever the replica generated.
4. **Refused before reaching a replica** (and refused by it): all zero, by 1 and 3.
5. Every event counts once in ``requests``; ``cancelled_requests`` counts finish_reason
   ``cancelled``, ``errored_requests`` counts ``error`` and ``timeout``.

The hour a request belongs to is the UTC hour of its ``started_at`` (not when it finished
nor when the event arrived), so a late or out-of-order event lands in its own hour.
"""

from __future__ import annotations

from typing import NamedTuple

CANCELLED_REASONS: tuple[str, ...] = ("cancelled",)
ERRORED_REASONS: tuple[str, ...] = ("error", "timeout")
FINISH_REASONS: tuple[str, ...] = ("stop", "length", *CANCELLED_REASONS, *ERRORED_REASONS)


class Billed(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def billed_tokens(
    *, status: int, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> Billed:
    """The billed counts of one request (inputs already validated as non-negative)."""
    return Billed(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens if status < 400 else 0,
    )
