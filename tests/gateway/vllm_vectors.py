"""Generate ``tests/data/vllm_vectors.json``: prefix-cache block hashes and KV-event batches
computed by vLLM's own code, taken from a vLLM wheel, for ``test_vllm_vectors.py``.

Nothing of vLLM is copied into the repository, and vLLM is not installed (it needs torch and
CUDA): the functions and classes named below are taken out of the wheel's sources with
``ast``, unchanged, and executed with the imports they really use (os, hashlib, pickle,
cbor2, msgspec, a logger, ``envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); the multi-modal and
tensor helpers they would call only for such inputs are stand-ins that fail loudly if called.
Two things are the generator's own: the data object ``Request``, of which only the fields
vLLM's hashing reads are given (token ids, cache salt; no LoRA, multi-modal or prompt
embeddings), and the call sites that fill a ``BlockStored`` — the arguments
``BlockPool._build_block_stored_event`` passes and the spec kind ``KVCacheManager.take_events``
sets, for one full-attention group (``Vllm.stored_event``). Run, from the repository
root, with the project's interpreter and vLLM's two light dependencies in a throwaway
directory (the project's venv is not changed)::

    pip download vllm==0.33.0 --no-deps -d /tmp/vllmwheel
    .venv/bin/python -m pip install --target /tmp/vllmvec-deps msgspec cbor2
    PYTHONPATH=$PWD:/tmp/vllmvec-deps .venv/bin/python -m tests.gateway.vllm_vectors \\
        /tmp/vllmwheel/vllm-0.33.0-*.whl

It lives next to the test that reads its output because that is all it is for: a test
fixture's recipe, not a benchmark or a tool of the running system.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import os
import pickle
import random
import sys
import types
import zipfile
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, NewType, TypeAlias

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "vllm_vectors.json"

HASHING = "vllm/utils/hashing.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
KV_EVENTS = "vllm/distributed/kv_events.py"

BLOCK_SIZE = 16
SEEDS: list[str | None] = [None, "0", "4242"]  # PYTHONHASHSEED (None: unset)
SALTS: list[str | None] = [None, "", "tenant-a", "5a" * 32, "sälz ✓"]
TS = 1_700_000_000.25


def _missing(name: str) -> Callable[..., Any]:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(f"vLLM's code called {name}, which the generator does not provide")

    return fail


def extract(source: str, filename: str, names: Iterable[str], namespace: dict[str, Any]) -> None:
    """Execute the top-level definitions of ``names`` from ``source`` (vLLM's own text, in
    the file's order) in ``namespace``; every name must be found."""
    wanted = set(names)
    tree = ast.parse(source, filename)
    keep: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            keep.append(node)  # ``annotations``: the file's own semantics for its annotations
            continue
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined = {node.name}
        elif isinstance(node, ast.Assign):
            defined = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined = {node.target.id}
        else:
            continue
        if defined & wanted:
            keep.append(node)
            found |= defined
    if wanted - found:
        raise SystemExit(f"{filename}: not found in this vLLM: {sorted(wanted - found)}")
    module = ast.Module(body=keep, type_ignores=[])
    # vLLM's own code, from the wheel named on the command line: running it is the point
    exec(compile(module, filename, "exec", dont_inherit=True), namespace)  # noqa: S102


class Request:
    """The fields of vLLM's ``Request`` that its block hashing reads, for a text prompt."""

    def __init__(self, token_ids: Sequence[int], cache_salt: str | None) -> None:
        self.all_token_ids = list(token_ids)
        self.num_tokens = len(token_ids)
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.prompt_embeds = None
        self.session_id = None


class Vllm:
    """vLLM's hashing and event code, loaded from a wheel."""

    def __init__(self, wheel: Path) -> None:
        import cbor2
        import msgspec

        with zipfile.ZipFile(wheel) as zf:
            sources = {p: zf.read(p).decode("utf-8") for p in (HASHING, KV_CACHE_UTILS, KV_EVENTS)}
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            vllm_version = next(
                line.split(":", 1)[1].strip()
                for line in zf.read(meta).decode("utf-8").splitlines()
                if line.startswith("Version:")
            )
        self.version = vllm_version
        self.wheel_sha256 = hashlib.sha256(wheel.read_bytes()).hexdigest()
        self.wheel_name = wheel.name

        self.hashing: dict[str, Any] = {
            "__name__": "vllm.utils.hashing",
            "hashlib": hashlib,
            "pickle": pickle,
            "cbor2": cbor2,
            "_xxhash": None,  # optional in vLLM; its xxhash schemes are not vectored here
        }
        extract(
            sources[HASHING],
            HASHING,
            ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "_xxhash_digest"],
            self.hashing,
        )
        self.envs = types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
        self.utils: dict[str, Any] = {
            "__name__": "vllm.v1.core.kv_cache_utils",
            "os": os,
            "hashlib": hashlib,
            "NewType": NewType,
            "TypeAlias": TypeAlias,
            "Any": Any,
            "Callable": Callable,
            "Iterable": Iterable,
            "Sequence": Sequence,
            "Request": Request,  # in annotations (evaluated: no future import there)
            "envs": self.envs,
            "logger": logging.getLogger("vllm_vectors"),
            "xxhash": self.hashing["xxhash"],
            "xxhash_cbor": self.hashing["xxhash_cbor"],
            "get_mm_features_in_window": _missing("get_mm_features_in_window"),
            "tensor_data": _missing("tensor_data"),
        }
        extract(
            sources[KV_CACHE_UTILS],
            KV_CACHE_UTILS,
            [
                "BlockHash",
                "ExternalBlockHash",
                "maybe_convert_block_hash",
                "DEFAULT_NONE_HASH_SEED",
                "_NON_CRYPTO_HASH_FUNCTIONS",
                "_NONE_HASH_SEED",
                "resolve_none_hash_seed",
                "init_none_hash",
                "_gen_mm_extra_hash_keys",
                "_gen_lora_extra_hash_keys",
                "_gen_prompt_embeds_extra_hash_keys",
                "generate_block_hash_extra_keys",
                "to_event_extra_keys",
                "hash_block_tokens",
                "get_request_block_hasher",
                "generate_lookahead_block_hash_extra_keys",
            ],
            self.utils,
        )
        # kv_events.py has no ``from __future__ import annotations``: its annotations are
        # evaluated, as msgspec needs them, against these names
        self.events: dict[str, Any] = {
            "__name__": "vllm.distributed.kv_events",
            "msgspec": msgspec,
            "Any": Any,
            "ExternalBlockHash": self.utils["ExternalBlockHash"],
        }
        extract(
            sources[KV_EVENTS],
            KV_EVENTS,
            [
                "EventBatch",
                "KVCacheEvent",
                "MEDIUM_GPU",
                "BlockStored",
                "BlockRemoved",
                "AllBlocksCleared",
                "KVEventBatch",
            ],
            self.events,
        )
        self.msgspec = msgspec

    def hash_fn(self, scheme: str) -> Callable[[Any], bytes]:
        fn: Callable[[Any], bytes] = self.hashing[scheme]
        return fn

    def init_none_hash(self, scheme: str, seed: str | None) -> bytes:
        """vLLM's ``init_none_hash`` as the engine calls it, under ``PYTHONHASHSEED=seed``."""
        saved = os.environ.pop("PYTHONHASHSEED", None)
        try:
            if seed is not None:
                os.environ["PYTHONHASHSEED"] = seed
            self.utils["init_none_hash"](self.hash_fn(scheme))
        finally:
            os.environ.pop("PYTHONHASHSEED", None)
            if saved is not None:
                os.environ["PYTHONHASHSEED"] = saved
        none_hash: bytes = self.utils["NONE_HASH"]
        return none_hash

    def request_block_hashes(
        self, scheme: str, tokens: Sequence[int], salt: str | None, block_size: int
    ) -> list[bytes]:
        hasher = self.utils["get_request_block_hasher"](block_size, self.hash_fn(scheme))
        hashes: list[bytes] = hasher(Request(tokens, salt))
        return hashes

    def external(self, h: bytes, ints: bool) -> int | bytes:
        self.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = ints
        out: int | bytes = self.utils["maybe_convert_block_hash"](h)
        return out

    def stored_event(
        self,
        tokens: Sequence[int],
        salt: str | None,
        hashes: list[bytes],
        first: int,
        end: int,
        block_size: int,
        ints: bool,
    ) -> Any:
        """A ``BlockStored`` for blocks ``first..end`` as ``BlockPool.cache_full_blocks``
        builds it, annotated as ``KVCacheManager.take_events`` does (one full-attention
        group)."""
        request = Request(tokens, salt)
        gen = self.utils["generate_block_hash_extra_keys"]
        extra = [
            gen(request, i * block_size, (i + 1) * block_size, 0)[0] for i in range(first, end)
        ]
        event = self.events["BlockStored"](
            block_hashes=[self.external(h, ints) for h in hashes[first:end]],
            parent_block_hash=self.external(hashes[first - 1], ints) if first else None,
            token_ids=list(tokens[first * block_size : end * block_size]),
            block_size=block_size,
            lora_id=None,
            medium=self.events["MEDIUM_GPU"],
            lora_name=None,
            extra_keys=self.utils["to_event_extra_keys"](extra),
            group_idx=0,
            session_id=None,
            lookahead_token_ids=None,
        )
        event.kv_cache_spec_kind = "full_attention"
        event.kv_cache_spec_sliding_window = None
        return event

    def encode(self, events: list[Any]) -> bytes:
        """A ``KVEventBatch`` as ``ZmqEventPublisher`` sends it (rank filled in: 0)."""
        batch = self.events["KVEventBatch"](ts=TS, events=events)
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0
        payload: bytes = self.msgspec.msgpack.Encoder().encode(batch)
        return payload

    def decode(self, payload: bytes) -> Any:
        """A payload as vLLM's own types decode it (strictly: a wrong field type fails)."""
        batch = self.msgspec.msgpack.Decoder(self.events["KVEventBatch"]).decode(payload)
        return self.msgspec.to_builtins(batch, builtin_types=(bytes,))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return {"hex": obj.hex()}
    if isinstance(obj, list | tuple):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    return obj


def token_lists() -> list[list[int]]:
    rng = random.Random(20261201)
    edges = [0, 23, 24, 255, 256, 65535, 65536, 128_255]  # CBOR's integer width steps

    def draw(n: int) -> list[int]:
        return [
            rng.choice(edges) if rng.random() < 0.25 else rng.randrange(128_256) for _ in range(n)
        ]

    # under one block, exactly one, one and a bit, partial last block, exact blocks, longer
    return [draw(n) for n in (15, 16, 17, 40, 64, 100)]


def generate(vllm: Vllm) -> dict[str, Any]:
    tokens = token_lists()
    vectors: list[dict[str, Any]] = []
    none_hashes: list[dict[str, Any]] = []
    for scheme in ("sha256", "sha256_cbor"):
        for seed in SEEDS:
            none_hash = vllm.init_none_hash(scheme, seed)
            none_hashes.append({"scheme": scheme, "seed": seed, "none_hash": none_hash.hex()})
            for salt in SALTS:
                for index, toks in enumerate(tokens):
                    hashes = vllm.request_block_hashes(scheme, toks, salt, BLOCK_SIZE)
                    vectors.append(
                        {
                            "scheme": scheme,
                            "seed": seed,
                            "salt": salt,
                            "tokens": index,
                            "block_size": BLOCK_SIZE,
                            "hashes": [h.hex() for h in hashes],
                        }
                    )

    # KV events as vLLM publishes them: sha256, PYTHONHASHSEED unset, a salted 40-token
    # prompt (two full blocks), its continuation to 64 tokens, an eviction, a reset
    scheme, salt = "sha256", "tenant-a"
    vllm.init_none_hash(scheme, None)
    toks = tokens[4]  # 64 tokens: 4 blocks
    hashes = vllm.request_block_hashes(scheme, toks, salt, BLOCK_SIZE)
    batches: list[dict[str, Any]] = []
    for ints in (True, False):  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (default) and =0
        events = [
            vllm.stored_event(toks, salt, hashes, 0, 2, BLOCK_SIZE, ints),
            vllm.stored_event(toks, salt, hashes, 2, 4, BLOCK_SIZE, ints),
            vllm.events["BlockRemoved"](
                block_hashes=[vllm.external(hashes[3], ints)],
                medium=vllm.events["MEDIUM_GPU"],
                group_idx=0,
            ),
            vllm.events["AllBlocksCleared"](),
        ]
        payload = vllm.encode(events)
        batches.append(
            {
                "int_block_hashes": ints,
                "scheme": scheme,
                "seed": None,
                "salt": salt,
                "tokens": 4,
                "payload": payload.hex(),
                "decoded": _jsonable(vllm.decode(payload)),
            }
        )

    # the emulator's encoder, decoded by vLLM's types
    from emulator.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
    from emulator.kv_events import encode_batch

    ours = [int.from_bytes(h, "big") for h in hashes]
    emulated = []
    for hash_bytes in (False, True):
        events_in: list[KVEvent] = [
            BlockStored(ours[0:2], None, toks[0:32], BLOCK_SIZE, cache_salt=salt),
            BlockStored(ours[2:4], ours[1], toks[32:64], BLOCK_SIZE),
            BlockRemoved([ours[3]]),
            AllBlocksCleared(),
        ]
        payload = encode_batch(TS, events_in, hash_bytes=hash_bytes)
        vllm_payload = batches[1 if hash_bytes else 0]["payload"]
        emulated.append(
            {
                "hash_bytes": hash_bytes,
                "payload": payload.hex(),
                "decoded_by_vllm": _jsonable(vllm.decode(payload)),
                "same_bytes_as_vllm": payload.hex() == vllm_payload,
            }
        )

    return {
        "vllm_version": vllm.version,
        "wheel": vllm.wheel_name,
        "wheel_sha256": vllm.wheel_sha256,
        "python": sys.version.split()[0],
        "msgspec": version("msgspec"),
        "cbor2": version("cbor2"),
        "generator": "tests/gateway/vllm_vectors.py",
        "functions": {
            HASHING: ["sha256", "sha256_cbor"],
            KV_CACHE_UTILS: [
                "init_none_hash",
                "get_request_block_hasher",
                "generate_block_hash_extra_keys",
                "hash_block_tokens",
                "to_event_extra_keys",
                "maybe_convert_block_hash",
            ],
            KV_EVENTS: ["KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared"],
        },
        "block_size": BLOCK_SIZE,
        "token_lists": tokens,
        "none_hashes": none_hashes,
        "vectors": vectors,
        "event_batches": batches,
        "emulator_batches": emulated,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help="a vllm-*.whl (pip download vllm --no-deps)")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args(argv)
    data = generate(Vllm(args.wheel))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(
        f"{args.out}: vLLM {data['vllm_version']}, {len(data['vectors'])} hash vectors, "
        f"{len(data['event_batches'])} vLLM batches, {len(data['emulator_batches'])} emulator "
        "batches"
    )


if __name__ == "__main__":
    main()
