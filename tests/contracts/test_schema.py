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


def test_a_newer_control_planes_fields_are_ignored_by_an_older_reader() -> None:
    """A field added by a newer control plane (it has a default, as added fields do) does
    not stop this gateway from reading the record: upgrades may go in either order."""
    payload = orjson.loads(schema.dumps(CATALOG))
    payload["versions"][VERSION.version]["added_later"] = 7
    payload["versions"][VERSION.version]["replicas"][0]["zone"] = "eu-1"
    assert schema.load_catalog(orjson.dumps(payload)) == CATALOG

    limit = schema.LimitRecord(
        rpm=10, tpm=1_000, max_context=8_192, max_output=1_024, kv_seconds_cap=100,
        reserved_kv=0,
    )  # fmt: skip
    tenant = schema.TenantRecord(
        tenant_id="t1", name="Acme", plan="standard", admission_class="standard",
        suspended=False, limits={"llama-8b": limit},
    )  # fmt: skip
    raw = orjson.loads(schema.dumps(tenant))
    raw["billing_tier"] = "x"
    raw["limits"]["llama-8b"]["burst"] = 3
    assert schema.load_tenant(orjson.dumps(raw)) == tenant

    change = orjson.loads(schema.dumps(schema.Change(kind="catalog", ident="", version=3)))
    change["origin"] = "cp-2"
    assert schema.load_change(orjson.dumps(change)) == schema.Change("catalog", "", 3)


def test_a_record_missing_a_required_field_still_fails() -> None:
    payload = orjson.loads(schema.dumps(CATALOG))
    del payload["versions"][VERSION.version]["kv_capacity_tokens"]
    try:
        schema.load_catalog(orjson.dumps(payload))
    except TypeError:
        return
    raise AssertionError("a record without kv_capacity_tokens loaded")
