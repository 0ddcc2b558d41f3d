"""The read model's records across control-plane versions: a record written by an older
control plane (without a field added since) still loads, with the field's documented
default, and a new record survives the round trip."""

from __future__ import annotations

import orjson

from contracts import schema
from gateway.admission.config import AdmissionConfig
from gateway.admission.estimates import attention_share

VERSION = schema.ModelVersionRecord(
    version="llama-8b-2026-05",
    family="llama-8b",
    context_length=131_072,
    kv_bytes_per_token=128 * 1024,
    tpot_target_ms=50,
    kv_capacity_tokens=442_368,
    replicas=(schema.ReplicaRecord("r8-a", "http://127.0.0.1:9201", "shared"),),
    prefill_tokens_per_s=24_262.0,
    ttft_target_ms=1000,
    prefill_attention_share=0.2837,
)
CATALOG = schema.Catalog(
    families={"llama-8b": VERSION.version}, versions={VERSION.version: VERSION}
)


def test_a_catalog_with_the_attention_share_round_trips() -> None:
    loaded = schema.load_catalog(schema.dumps(CATALOG))
    assert loaded == CATALOG
    assert loaded.versions[VERSION.version].prefill_attention_share == 0.2837


def test_an_older_control_planes_record_reads_as_unknown_and_takes_the_default() -> None:
    payload = orjson.loads(schema.dumps(CATALOG))
    del payload["versions"][VERSION.version]["prefill_attention_share"]
    loaded = schema.load_catalog(orjson.dumps(payload)).versions[VERSION.version]
    assert loaded.prefill_attention_share == 0.0
    assert loaded.prefill_tokens_per_s == VERSION.prefill_tokens_per_s  # the rest as written
    default = AdmissionConfig().long_prefill_attention_share
    assert attention_share(loaded, default) == default
    assert attention_share(VERSION, default) == 0.2837
