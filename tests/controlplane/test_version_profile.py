"""A version's prefill attention share: the replica profile's figure the gateway estimates a
long prompt's first token with. Bounded 0..1 in the database and at the API (400 with a
field error, never a 500), pushed with the version to the gateway's catalog, and in the
demo catalog the emulator profile's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import IntegrityError, transaction

from catalog.models import ModelVersion
from contracts import schema
from emulator.profiles import get_profile, prefill_attention_share, threshold_prefill_rate
from tenants.demo import MODELS

from .helpers import error_of

pytestmark = pytest.mark.django_db


def test_the_demo_catalogs_profile_is_its_emulator_profiles() -> None:
    """The control plane does not import the emulator: the demo figures are written down,
    and must be the profiles' (share 0.10 for the 70B profile, 0.28 for the 8B one; the
    prefill rate at the long-context threshold, without which the dev stack's gateway
    would not run the long-context budget at all)."""
    for demo in MODELS:
        profile = get_profile(demo.emulator_profile)
        assert demo.prefill_attention_share == round(prefill_attention_share(profile), 4)
        assert demo.prefill_tokens_per_s == round(threshold_prefill_rate(profile)), demo.version
    assert [round(m.prefill_attention_share, 2) for m in MODELS] == [0.10, 0.28]
    assert all(m.prefill_tokens_per_s > 0 for m in MODELS)


def test_the_seeded_demo_versions_push_their_prefill_rate(
    rm: Any, django_capture_on_commit_callbacks: Any
) -> None:
    """Seeded through the catalog's services, the demo versions reach the gateway's read
    model with their profile: the long-context budget is on in the dev stack."""
    with django_capture_on_commit_callbacks(execute=True):
        for demo in MODELS:
            demo.upsert(make_current=True)
    catalog = schema.load_catalog(rm.redis.get(schema.CATALOG_KEY))
    for demo in MODELS:
        record = catalog.versions[demo.version]
        assert record.prefill_tokens_per_s == demo.prefill_tokens_per_s
        assert record.prefill_attention_share == demo.prefill_attention_share
        assert record.ttft_target_ms == 1000


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_database_rejects_a_share_outside_0_to_1(version_70b: ModelVersion, bad: float) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        ModelVersion.objects.filter(pk=version_70b.pk).update(prefill_attention_share=bad)


def _profile_editor(make_user: Callable[..., Any]) -> Any:
    user = make_user("profile-editor", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label="catalog", codename="change_modelversion")
    )
    return user


@pytest.mark.parametrize("bad", [-0.1, 1.5, "NaN", "a lot"])
def test_api_rejects_a_share_outside_0_to_1_with_a_field_error(
    version_70b: ModelVersion,
    make_user: Callable[..., Any],
    client_for: Callable[..., Any],
    bad: Any,
) -> None:
    url = f"/api/v1/models/{version_70b.name}/profile/"
    api = client_for(_profile_editor(make_user))
    refused = api.patch(url, {"prefill_attention_share": bad}, format="json")
    assert refused.status_code == 400, refused.content
    error = error_of(refused)
    assert error["param"] == "prefill_attention_share"
    assert error["type"] == "invalid_request_error"
    assert "prefill_attention_share" in error["fields"]
    version_70b.refresh_from_db()
    assert version_70b.prefill_attention_share == MODELS[0].prefill_attention_share


def test_api_sets_the_profile_with_the_permission_and_shows_it(
    version_70b: ModelVersion,
    make_user: Callable[..., Any],
    client_for: Callable[..., Any],
    rm: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    url = f"/api/v1/models/{version_70b.name}/profile/"
    plain_staff = make_user("staff-no-perm", is_staff=True)
    body = {"prefill_attention_share": 0.25, "prefill_tokens_per_s": 12_500}
    assert client_for(plain_staff).patch(url, body, format="json").status_code == 403
    api = client_for(_profile_editor(make_user))
    with django_capture_on_commit_callbacks(execute=True):
        done = api.patch(url, body, format="json")
    assert done.status_code == 200, done.content
    assert done.json() == {
        "name": version_70b.name,
        "prefill_tokens_per_s": 12_500,
        "ttft_target_ms": 1000,
        "prefill_attention_share": 0.25,
    }
    # pushed to the gateway's catalog
    pushed = schema.load_catalog(rm.redis.get(schema.CATALOG_KEY)).versions[version_70b.name]
    assert (pushed.prefill_attention_share, pushed.prefill_tokens_per_s) == (0.25, 12_500.0)
    # shown with the other profile figures in the model list
    listed = api.get("/api/v1/models/").json()
    shown = {v["name"]: v for f in listed for v in f["versions"]}
    assert shown[version_70b.name]["prefill_attention_share"] == 0.25
    assert api.patch("/api/v1/models/no-such/profile/", body, format="json").status_code == 404
