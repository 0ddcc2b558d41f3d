"""``POST /v1/chat/completions``: what the chat endpoint adds to the shared request pipeline
(endpoints/pipeline.py): its body's parsing and validation, its prompt estimate, and the
prompt's block hashes for cache-aware routing."""

from __future__ import annotations

from contracts.blockhash import get_hasher
from contracts.schema import Scope
from gateway.admission.chat_template import TemplateCounter, TemplateRenderError
from gateway.admission.prefix import (
    PLACEMENT_BLOCK,
    PrefixQuery,
    assistant_turns,
    make_query,
    query_from_tokens,
)
from gateway.admission.tokens import Rule
from gateway.config import GatewayConfig
from gateway.endpoints.pipeline import PipelineEndpoint, RequestPipeline
from gateway.endpoints.validation import ChatRequest, GenerationRequest, parse_chat
from gateway.errors import BadRequest
from gateway.upstream.client import UpstreamClient


class ChatCompletions(PipelineEndpoint):
    scope: Scope = "chat"

    def __init__(
        self, pipeline: RequestPipeline, config: GatewayConfig, upstream: UpstreamClient
    ) -> None:
        super().__init__(pipeline)
        self.config = config
        self.upstream = upstream

    def parse(self, body: bytes) -> ChatRequest:
        return parse_chat(body)

    def prompt_estimate(self, req: GenerationRequest, counter: Rule) -> tuple[int, int]:
        assert isinstance(req, ChatRequest)
        if isinstance(counter, TemplateCounter):
            return self._exact_estimate(req, counter)
        estimate = counter.prompt_tokens(req.message_texts)
        if req.extra_texts:
            # Tool definitions are one more template block; a json schema is counted as if
            # it were prompt (guided decoding's cost; the replica does not bill it).
            if "tools" in req.sampling:
                estimate += counter.message_overhead
            estimate += sum(counter.text_tokens(text) for text in req.extra_texts)
        return estimate, estimate

    def _exact_estimate(self, req: ChatRequest, counter: TemplateCounter) -> tuple[int, int]:
        """The prompt's own token count (its ids, kept for the prefix query), plus a json
        schema's tokens (tool definitions are in the template's rendering)."""
        tools = req.sampling.get("tools")
        try:
            # the conversation key needs the first user message's end only within its
            # PLACEMENT_BLOCK blocks (``conversation_block``)
            within = (PLACEMENT_BLOCK + 1) * self.config.prefix_block_size
            req.prompt_ids, req.first_user = counter.renderer.prompt(req.messages, tools, within)
        except TemplateRenderError as exc:  # the replica's template would refuse it too
            raise BadRequest(
                f"The model's chat template cannot render these messages: {exc}",
                param="messages",
                code="invalid_value",
            ) from exc
        schemas = req.extra_texts[1:] if tools else req.extra_texts  # tools' text is first
        estimate = len(req.prompt_ids) + sum(counter.text_tokens(text) for text in schemas)
        return estimate, estimate

    def prefix_query(self, req: GenerationRequest, tenant_id: str) -> PrefixQuery | None:
        """The prompt's block hashes for cache-aware routing (tokenized as the replicas do,
        salted as the upstream body is), or None when routing ignores the cache."""
        if self.config.admission.strategy != "cache_aware":
            return None
        assert isinstance(req, ChatRequest)
        hasher = get_hasher(self.config.prefix_hash, self.config.prefix_hash_seed)
        if req.prompt_ids is not None:  # the model's own ids (``_exact_estimate``)
            cap = self.config.prefix_max_blocks * self.config.prefix_block_size + 1
            return query_from_tokens(
                tenant_id,
                req.prompt_ids[:cap],
                self.upstream.cache_salt(tenant_id),
                self.config.prefix_block_size,
                req.cache_hint,
                hasher,
                req.first_user,
                assistant_turns(req.messages),
            )
        return make_query(
            tenant_id,
            req.messages,
            self.upstream.cache_salt(tenant_id),
            self.config.prefix_block_size,
            req.cache_hint,
            self.config.prefix_max_blocks,
            hasher,
        )
