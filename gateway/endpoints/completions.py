"""``POST /v1/completions`` (OpenAI's legacy text completions): what it adds to the shared
request pipeline (endpoints/pipeline.py). Auth, admission, routing, idempotency, the
upstream exchange and the usage event are the chat endpoint's, unchanged.

A list of prompts is one request of several sequences (vLLM runs each prompt ``n``
times): admission charges the prompts' sum and ``n × prompts`` outputs; the context limit
applies to each prompt on its own. Cache-aware routing does not look at raw prompts (no
chat template to hash through): they are placed like any request without a prefix.
"""

from __future__ import annotations

from contracts.schema import Scope
from gateway.admission.prefix import PrefixQuery
from gateway.admission.tokens import Rule
from gateway.endpoints.pipeline import PipelineEndpoint
from gateway.endpoints.validation import CompletionRequest, GenerationRequest, parse_completion


class Completions(PipelineEndpoint):
    scope: Scope = "chat"  # the same permission as chat: generation

    def parse(self, body: bytes) -> CompletionRequest:
        return parse_completion(body)

    def prompt_estimate(self, req: GenerationRequest, counter: Rule) -> tuple[int, int]:
        assert isinstance(req, CompletionRequest)
        counts = [counter.bos + counter.text_tokens(p) for p in req.prompts]
        return sum(counts), max(counts)

    def prefix_query(self, req: GenerationRequest, tenant_id: str) -> PrefixQuery | None:
        return None
