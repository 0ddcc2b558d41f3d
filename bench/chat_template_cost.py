"""The CPU a chat request's prompt costs the gateway with the model's chat template
configured (``GATEWAY_CHAT_TEMPLATES``: render, tokenize once, locate the first user
message, build the prefix query from the ids) against the same model without it
(``GATEWAY_TOKENIZER_FILES`` alone: ``ExactCounter``'s estimate, then ``make_query`` over the
emulator's template), per request, by prompt size.

The model is the test fixture's (tests/data/chat_template/: a Llama-3-style template over a
400-token byte-level BPE, which splits English into more, shorter tokens than Llama 3's
128k vocabulary: tokenizing costs per byte, hashing per token, so this overstates the
hashing part). Prompts: a system prompt and a user question, a 5-turn conversation, and
one user message of N words of English; both paths hash with sha256_cbor (vLLM's
default) and the same block size. In-process medians on a shared machine: compare the two
rows of one run, not absolute figures.

``python -m bench.chat_template_cost`` writes bench/results/chat_template_cost.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from contracts.blockhash import get_hasher
from gateway.admission.chat_template import TemplateCounter
from gateway.admission.prefix import PLACEMENT_BLOCK, make_query, query_from_tokens
from gateway.admission.tokens import ExactCounter

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "data" / "chat_template"
RESULTS = ROOT / "bench" / "results" / "chat_template_cost.md"
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. What is the weather like in Paris "
    "today? It is sunny, 21 degrees. You are a helpful assistant. Answer briefly. "
)
SYSTEM = "You are a helpful assistant. Answer briefly and in English."


def _prompts(words: list[int]) -> dict[str, list[dict[str, Any]]]:
    out = {
        "system + question": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the weather like in Paris today?"},
        ],
        "5-turn conversation": [{"role": "system", "content": SYSTEM}]
        + [
            {"role": role, "content": ENGLISH * 2}
            for _ in range(5)
            for role in ("user", "assistant")
        ][:-1],
    }
    unit = ENGLISH.split()
    for n in words:
        text = " ".join(unit[i % len(unit)] for i in range(n))
        out[f"{n} words"] = [{"role": "user", "content": text}]
    return out


def _median_us(fn: Any, repeat: int) -> float:
    fn()  # warm caches
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--words", type=int, nargs="*", default=[300, 3000])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    exact = ExactCounter(tokenizer)
    template = TemplateCounter.from_file(MODEL / "tokenizer_config.json", tokenizer)
    hasher = get_hasher("sha256_cbor")
    salt = "5a" * 32
    rows = []
    for name, messages in _prompts(args.words).items():
        texts = [m["content"] for m in messages]

        def old(
            messages: list[dict[str, Any]] = messages,
            texts: list[str] = texts,
            settle: bool = False,
        ) -> None:
            exact.prompt_tokens(texts)
            query = make_query("t", messages, salt, 16, hasher=hasher)
            if settle:
                query.settle()

        def new(messages: list[dict[str, Any]] = messages, settle: bool = False) -> None:
            ids, first_user = template.renderer.prompt(messages, within=(PLACEMENT_BLOCK + 1) * 16)
            query = query_from_tokens("t", ids, salt, 16, hasher=hasher, first_user=first_user)
            if settle:
                query.settle()

        def render(messages: list[dict[str, Any]] = messages) -> None:
            template.renderer.render(messages)

        ids = template.renderer.token_ids(messages)
        rows.append(
            (
                name,
                len(ids),
                _median_us(old, args.repeat),
                _median_us(new, args.repeat),
                _median_us(lambda old=old: old(settle=True), args.repeat),
                _median_us(lambda new=new: new(settle=True), args.repeat),
                _median_us(render, args.repeat),
            )
        )
    lines = [
        "# Chat template cost per request (bench/chat_template_cost.py)",
        "",
        f"Command: `python -m bench.chat_template_cost {' '.join(argv or sys.argv[1:])}`"
        " (median of the repeats; in-process, on the shared development machine).",
        "",
        "*without*: ExactCounter's estimate + make_query over the emulator's template",
        "(which tokenizes and hashes only up to the placement key); *with*: the model's",
        "template rendered and the whole prompt tokenized once (the exact count needs it),",
        "first user message located, query from those ids. *settled*: the query then",
        "hashes every block (the router does when an index follows the prompt to its end);",
        "the two settled columns hash different token counts (the emulator's tokenizer",
        "makes ~4 bytes a token, this small BPE fewer).",
        "",
        "| prompt | model tokens | without µs | with µs | without, settled µs"
        " | with, settled µs | render µs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n, *us in rows:
        lines.append(f"| {name} | {n} | " + " | ".join(f"{u:.0f}" for u in us) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
