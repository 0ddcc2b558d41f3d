"""Writes for plans, tenants, members, API keys, management-API tokens and limits.

``<entity>_<action>``, keyword-only, typed, atomic, ``full_clean()`` before ``save()``.
Read-model pushes are not called here: the signal hooks schedule them after commit for every
write path (see ``readmodel_hooks``).
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from catalog.models import ModelFamily
from contracts import keyformat
from contracts.schema import API_KEY_PREFIX, SCOPES, hash_api_key, hash_api_token
from tenants.floors import check_floors_after
from tenants.limits import effective_limits
from tenants.models import (
    LIMIT_FIELDS,
    ApiKey,
    ApiKeyModelLimit,
    ApiToken,
    ApiTokenScheme,
    LimitFields,
    Membership,
    Plan,
    PlanModelLimit,
    Role,
    Tenant,
    TenantModelLimit,
    api_token_cutoff,
)

VISIBLE_PREFIX_CHARS = 8

log = logging.getLogger("tenants.services")


def key_pepper() -> bytes:
    return str(settings.FAIRWAY_KEY_PEPPER).encode("utf-8")


# -- plans --------------------------------------------------------------------------------


@transaction.atomic
def plan_create(
    *,
    name: str,
    admission_class: str,
    display_name: str = "",
    base_fee: Decimal = Decimal(0),
    currency: str = "usd",
) -> Plan:
    plan = Plan(
        name=name,
        admission_class=admission_class,
        display_name=display_name,
        base_fee=base_fee,
        currency=currency,
    )
    plan.full_clean()
    plan.save()
    return plan


@transaction.atomic
def plan_set_base_fee(*, plan: Plan, base_fee: Decimal, currency: str | None = None) -> Plan:
    """Takes effect on invoices built or finalized from now on; finalized ones keep theirs."""
    plan.base_fee = base_fee
    if currency is not None:
        plan.currency = currency
    plan.full_clean()
    plan.save(update_fields=["base_fee", "currency"])
    return plan


@transaction.atomic
def plan_limit_set(*, plan: Plan, family: ModelFamily, **values: int) -> PlanModelLimit:
    """Create or replace a plan's default limits for one family (all fields required).
    Refused when it sells more reserved floor than the family's reserved pool carries."""
    row = PlanModelLimit.objects.filter(plan=plan, family=family).first() or PlanModelLimit(
        plan=plan, family=family
    )
    _assign_limits(row, values, required=row.pk is None)
    row.full_clean()
    check_floors_after(row.save, families=[family])
    return row


# -- limits -------------------------------------------------------------------------------


def _assign_limits(row: LimitFields, values: dict[str, Any], *, required: bool) -> None:
    unknown = sorted(set(values) - set(LIMIT_FIELDS))
    if unknown:
        raise ValidationError({name: "Unknown limit field." for name in unknown})
    missing = [n for n in LIMIT_FIELDS if n not in values and n != "reserved_kv"]
    if required and missing:
        raise ValidationError({name: "This field is required." for name in missing})
    for name, value in values.items():
        setattr(row, name, value)


@transaction.atomic
def tenant_limit_set(*, tenant: Tenant, family: ModelFamily, **values: int) -> TenantModelLimit:
    """Set a tenant's override for one family. Fields not given keep their current value:
    the existing override's, else the plan default's."""
    row = TenantModelLimit.objects.select_for_update().filter(tenant=tenant, family=family).first()
    if row is None:
        row = TenantModelLimit(tenant=tenant, family=family)
        base = effective_limits(tenant).get(family.name)
        if base is not None:
            for name in LIMIT_FIELDS:
                setattr(row, name, getattr(base, name))
        _assign_limits(row, values, required=base is None)
    else:
        _assign_limits(row, values, required=False)
    if not tenant.plan.is_reserved and "reserved_kv" not in values:
        row.reserved_kv = 0  # a floor left over from a former reserved plan does not apply
    row.full_clean()
    check_floors_after(row.save, families=[family])
    return row


@transaction.atomic
def tenant_limit_clear(*, tenant: Tenant, family: ModelFamily) -> bool:
    """Drop a tenant's override so the plan default applies again."""
    deleted = 0
    for row in TenantModelLimit.objects.filter(tenant=tenant, family=family):
        row.delete()  # per row, so the delete signal pushes the read model
        deleted += 1
    return deleted > 0


# -- tenants and members ------------------------------------------------------------------


@transaction.atomic
def tenant_create(
    *, name: str, plan: Plan, owner: AbstractBaseUser | None = None, billing_email: str = ""
) -> Tenant:
    tenant = Tenant(name=name, plan=plan, billing_email=billing_email)
    tenant.full_clean()
    tenant.save()
    if owner is not None:
        membership_add(tenant=tenant, user=owner, role=Role.OWNER)
    return tenant


@transaction.atomic
def tenant_update(
    *, tenant: Tenant, name: str | None = None, billing_email: str | None = None
) -> Tenant:
    if name is not None:
        tenant.name = name
    if billing_email is not None:
        tenant.billing_email = billing_email
    tenant.full_clean()
    tenant.save()
    return tenant


@transaction.atomic
def tenant_change_plan(*, tenant: Tenant, plan: Plan) -> Tenant:
    """Refused when the new plan's floors over-sell a family's reserved pool."""
    tenant.plan = plan
    tenant.full_clean()
    check_floors_after(tenant.save)
    return tenant


@transaction.atomic
def tenant_set_suspended(*, tenant: Tenant, suspended: bool) -> Tenant:
    """Suspension removes the tenant's keys from the read model: every gateway refuses them."""
    if suspended and tenant.suspended_at is None:
        tenant.suspended_at = timezone.now()
    elif not suspended:
        tenant.suspended_at = None
    tenant.save()
    return tenant


@transaction.atomic
def membership_add(*, tenant: Tenant, user: AbstractBaseUser, role: str) -> Membership:
    membership = Membership(tenant=tenant, user=user, role=role)
    membership.full_clean()
    membership.save()
    return membership


def _lock_owners(tenant: Tenant) -> int:
    """Count owners under row locks (ordered by pk) so two concurrent demotions cannot
    both pass the last-owner check."""
    return len(
        list(
            Membership.objects.select_for_update()
            .filter(tenant=tenant, role=Role.OWNER)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
    )


@transaction.atomic
def membership_change_role(*, membership: Membership, role: str) -> Membership:
    if (
        membership.role == Role.OWNER
        and role != Role.OWNER
        and _lock_owners(membership.tenant) <= 1
    ):
        raise ValidationError({"role": "A tenant must keep at least one owner."})
    membership.role = role
    membership.full_clean()
    membership.save()
    return membership


@transaction.atomic
def membership_remove(*, membership: Membership) -> None:
    if membership.role == Role.OWNER and _lock_owners(membership.tenant) <= 1:
        raise ValidationError({"role": "A tenant must keep at least one owner."})
    membership.delete()


# -- API keys -----------------------------------------------------------------------------


def api_key_generate_secret() -> str:
    # Checksummed (contracts/keyformat.py): the gateway refuses a mistyped key offline.
    return keyformat.mint()


@transaction.atomic
def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    scopes: Iterable[str] = SCOPES,
    created_by: AbstractBaseUser | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Returns the key and its secret. The secret is not stored and cannot be shown again."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "The expiry must be in the future."})
    # Bounded per tenant (each key is a read-model record in every gateway's cache). The
    # tenant row lock serialises concurrent creations, so the cap cannot be raced past.
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
    cap = int(settings.FAIRWAY_MAX_KEYS_PER_TENANT)
    live = (
        ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True)
        .exclude(expires_at__lte=timezone.now())
        .count()
    )
    if live >= cap:
        raise ValidationError(
            f"This organization already has {live} API keys, the most allowed ({cap}); "
            "revoke one first.",
            code="too_many_keys",
        )
    secret = api_key_generate_secret()
    scope_list = [scopes] if isinstance(scopes, str) else list(scopes)
    api_key = ApiKey(
        tenant=tenant,
        name=name,
        scopes=scope_list,
        prefix=secret[: len(API_KEY_PREFIX) + VISIBLE_PREFIX_CHARS],
        key_hash=hash_api_key(secret, key_pepper()),
        created_by=created_by,
        expires_at=expires_at,
    )
    api_key.full_clean()
    api_key.scopes = sorted(scope_list)
    api_key.save()
    return api_key, secret


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, revoked_by: AbstractBaseUser | None = None) -> ApiKey:
    """Idempotent: revoking a revoked key keeps the first revocation's time."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.revoked_by = revoked_by
        api_key.save(update_fields=["revoked_at", "revoked_by"])
    return api_key


@transaction.atomic
def api_key_last_used_record(*, seen: dict[str, datetime]) -> int:
    """Move last-used stamps forward (never back). Off the hot path: the gateway batches
    them into Redis and a Celery task calls this. Returns the number of keys updated."""
    updated = 0
    for key_id, at in sorted(seen.items()):
        try:
            uuid.UUID(key_id)
        except ValueError:
            continue  # not one of ours; the hash is written by gateways, not users
        updated += (
            ApiKey.objects.filter(pk=key_id).exclude(last_used_at__gte=at).update(last_used_at=at)
        )
    return updated


# -- management-API tokens ----------------------------------------------------------------

API_TOKEN_PREFIX = "fwt-"  # noqa: S105 - the public start of every token, not a secret
# A token's last_used_at moves at most this often: one small write a minute per token in
# use, not one per request.
API_TOKEN_LAST_USED_RESOLUTION = timedelta(seconds=60)


def api_token_hash(secret: str) -> str:
    """What is stored of a management-API token issued now (``ApiTokenScheme.LABELLED``):
    the labelled HMAC, with the API keys' pepper, so that it is never an API key's digest."""
    return hash_api_token(secret, key_pepper())


def api_token_hash_unlabelled(secret: str) -> str:
    """The digest of tokens issued before the label (``ApiTokenScheme.UNLABELLED``): the API
    keys' HMAC. Only looked up, never written (``selectors.api_token_for_secret``)."""
    return hash_api_key(secret, key_pepper())


def api_token_generate_secret() -> str:
    return API_TOKEN_PREFIX + secrets.token_urlsafe(32)


@transaction.atomic
def api_token_create(*, user: AbstractBaseUser) -> tuple[ApiToken, str]:
    """A new management-API token for ``user``: returns it and its plaintext, which is not
    stored and cannot be shown again. Each caller gets its own token (a stored digest cannot
    be handed out twice), so the user's expired tokens are deleted here, and so are the
    oldest live ones beyond ``FAIRWAY_API_TOKENS_PER_USER``."""
    # The user's row lock serialises concurrent creations, so the cap cannot be raced past.
    get_user_model().objects.select_for_update().filter(pk=user.pk).first()
    mine = ApiToken.objects.filter(user=user)
    mine.filter(created_at__lte=api_token_cutoff()).delete()
    keep = max(int(settings.FAIRWAY_API_TOKENS_PER_USER), 1) - 1  # room for the new one
    surplus = list(mine.order_by("-created_at", "-pk").values_list("pk", flat=True)[keep:])
    if surplus:
        ApiToken.objects.filter(pk__in=surplus).delete()
    secret = api_token_generate_secret()
    token = ApiToken(
        user=user,
        prefix=secret[: len(API_TOKEN_PREFIX) + VISIBLE_PREFIX_CHARS],
        token_hash=api_token_hash(secret),
        scheme=ApiTokenScheme.LABELLED,
    )
    token.full_clean()
    token.save()
    return token, secret


@transaction.atomic
def api_token_revoke(*, token: ApiToken) -> bool:
    """Revoking deletes the row (nothing of the token is kept). Idempotent."""
    deleted, _ = ApiToken.objects.filter(pk=token.pk).delete()
    return deleted > 0


@transaction.atomic
def api_token_revoke_all(*, user: AbstractBaseUser) -> int:
    """Every management-API token of ``user``; returns how many there were."""
    deleted, _ = ApiToken.objects.filter(user=user).delete()
    return deleted


@transaction.atomic
def user_password_changed(*, user: AbstractBaseUser) -> int:
    """The user's password was just set, or made unusable: revoke every management-API token
    of theirs, so that a token obtained with the old password (or copied from a script)
    stops working with it. Returns how many were revoked; the log line follows the commit.

    Called for every write path by ``tenants.credential_hooks``. Console sessions need
    nothing here: Django signs out every session whose stored password hash no longer
    matches on its next request, and the password-change views keep the current one
    (``update_session_auth_hash``)."""
    revoked = api_token_revoke_all(user=user)
    user_id = user.pk
    transaction.on_commit(
        lambda: log.info(
            "password of user %s changed: %d management-API token(s) revoked", user_id, revoked
        )
    )
    return revoked


@transaction.atomic
def api_token_expired_delete() -> int:
    """Delete every expired management-API token (they are refused anyway); returns how
    many."""
    deleted, _ = ApiToken.objects.filter(created_at__lte=api_token_cutoff()).delete()
    return deleted


@transaction.atomic
def api_token_last_used_record(*, token: ApiToken, at: datetime) -> bool:
    """Move the token's last-used stamp forward to ``at`` unless it was stamped within the
    resolution before it (never back). Returns whether the row changed."""
    return bool(
        ApiToken.objects.filter(pk=token.pk)
        .exclude(last_used_at__gt=at - API_TOKEN_LAST_USED_RESOLUTION)
        .update(last_used_at=at)
    )


# -- per-key limits -----------------------------------------------------------------------


@transaction.atomic
def api_key_limit_set(
    *,
    api_key: ApiKey,
    family: ModelFamily,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrency: int | None = None,
) -> ApiKeyModelLimit:
    """Set a key's own limits for one family, replacing any it had (None: no key limit of
    that kind). Refused above the tenant's effective limit, for a family the tenant cannot
    use, and on a revoked key."""
    key = ApiKey.objects.select_for_update().get(pk=api_key.pk)
    if key.revoked_at is not None:
        raise ValidationError("The key is revoked; its limits cannot change.")
    row = ApiKeyModelLimit.objects.filter(api_key=key, family=family).first() or ApiKeyModelLimit(
        api_key=key, family=family
    )
    row.rpm, row.tpm, row.max_concurrency = rpm, tpm, max_concurrency
    try:
        row.full_clean()
    except ValidationError as exc:
        # The API names the family "model"; the model field is "family".
        if hasattr(exc, "error_dict") and "family" in exc.error_dict:
            exc.error_dict["model"] = exc.error_dict.pop("family")
        raise
    row.save()
    return row


@transaction.atomic
def api_key_limit_clear(*, api_key: ApiKey, family: ModelFamily) -> bool:
    """Drop a key's own limits for one family: only the tenant's apply again."""
    deleted = 0
    for row in ApiKeyModelLimit.objects.filter(api_key=api_key, family=family):
        row.delete()  # per row, so the delete signal pushes the read model
        deleted += 1
    return deleted > 0
