"""Writes for the model registry. Read-model pushes follow via the tenants app's hooks.

Prices are effective-dated rows of ``ModelPrice`` and only ``price_change`` (and a new
version's first price in ``version_upsert``) writes them; the table is append-only, but
for ``price_change_withdraw``, which stamps a change not yet in force as withdrawn.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models.functions import Now
from django.utils import timezone

from catalog.models import PRICE_EPOCH, ModelFamily, ModelPrice, ModelVersion, Replica
from catalog.selectors import price_in_force

PRICE_FIELDS = (
    "price_prompt_per_mtok",
    "price_cached_prompt_per_mtok",
    "price_completion_per_mtok",
)
# The replica profile's facts the gateway reads with a version (ModelVersionRecord): set
# with the version, and an operator may correct them on a version in service
# (``version_profile_update``).
PROFILE_FIELDS = ("prefill_tokens_per_s", "ttft_target_ms", "prefill_attention_share")
VERSION_FIELDS = (
    "context_length",
    "kv_bytes_per_token",
    "tpot_target_ms",
    "kv_capacity_tokens",
    *PROFILE_FIELDS,
    *PRICE_FIELDS,
    "currency",
    "is_active",
    "weights",
    "tensor_parallel_size",
    "tool_call_parser",
    "emulator_profile",
    "supports_tools",
    "supports_structured_output",
    "max_n",
    "supports_logprobs",
    "max_top_logprobs",
)


@transaction.atomic
def family_upsert(*, name: str, display_name: str = "", description: str = "") -> ModelFamily:
    family = ModelFamily.objects.filter(name=name).first() or ModelFamily(name=name)
    family.display_name = display_name or family.display_name
    family.description = description or family.description
    family.full_clean()
    family.save()
    return family


def current_hour() -> datetime:
    """The start of the current UTC hour: the earliest a price change may take effect."""
    return timezone.now().astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _price(value: Any, field: str) -> Decimal:
    try:
        price = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise ValidationError({field: "A price is a decimal number."}) from None
    if not price.is_finite():
        raise ValidationError({field: "A price is a decimal number."})
    return price


def _record_price(
    *,
    version: ModelVersion,
    effective_from: datetime,
    prices: tuple[Decimal, Decimal, Decimal],
    replaces: ModelPrice | None,
    actor: AbstractBaseUser | None,
    actor_label: str,
    reason: str,
) -> ModelPrice:
    row = ModelPrice(
        version=version,
        effective_from=effective_from,
        price_prompt_per_mtok=prices[0],
        price_cached_prompt_per_mtok=prices[1],
        price_completion_per_mtok=prices[2],
        currency=version.currency,
        replaces=replaces,
        actor=actor,
        actor_label=actor_label,
        reason=reason,
    )
    row.full_clean()  # field limits, cached <= prompt, the hour boundary, who and why
    try:
        with transaction.atomic():
            row.save()
    except IntegrityError:  # a concurrent change for the same hour won the race
        raise ValidationError(
            {"effective_from": "The version already has a price from that hour."}
        ) from None
    return row


def price_effective_hour(effective_from: datetime | None) -> datetime:
    """The UTC hour a price change takes effect from: ``effective_from`` checked (aware, on
    an hour boundary, not before the current hour), or the current hour for None."""
    now_hour = current_hour()
    if effective_from is None:
        return now_hour
    if timezone.is_naive(effective_from):
        raise ValidationError({"effective_from": "Give a time zone (prices change in UTC)."})
    effective_from = effective_from.astimezone(UTC)
    if effective_from != effective_from.replace(minute=0, second=0, microsecond=0):
        raise ValidationError(
            {"effective_from": "A price takes effect at the start of a UTC hour."}
        )
    if effective_from < now_hour:
        raise ValidationError(
            {
                "effective_from": (
                    f"{effective_from:%Y-%m-%d %H:%M} UTC is in the past: a price takes effect "
                    f"from the current hour ({now_hour:%Y-%m-%d %H:%M} UTC) or later, since "
                    "past hours may already be invoiced."
                )
            }
        )
    return effective_from


@transaction.atomic
def version_first_price(
    *,
    version: ModelVersion,
    prompt: Decimal | str,
    cached_prompt: Decimal | str,
    completion: Decimal | str,
    actor: AbstractBaseUser | None = None,
    actor_label: str,
    reason: str = "First price of the version.",
) -> ModelPrice:
    """A new version's first price, in force from the epoch (no usage can predate it).
    Refused once the version has a price: later prices are ``price_change``s."""
    ModelVersion.objects.select_for_update().filter(pk=version.pk).first()
    if ModelPrice.objects.filter(version=version).exists():
        raise ValidationError("The version has a price already: record a price change.")
    return _record_price(
        version=version,
        effective_from=PRICE_EPOCH,
        prices=(
            _price(prompt, "price_prompt_per_mtok"),
            _price(cached_prompt, "price_cached_prompt_per_mtok"),
            _price(completion, "price_completion_per_mtok"),
        ),
        replaces=None,
        actor=actor,
        actor_label=actor_label,
        reason=reason,
    )


@transaction.atomic
def price_change(
    *,
    version: ModelVersion,
    prompt: Decimal | str,
    cached_prompt: Decimal | str,
    completion: Decimal | str,
    effective_from: datetime | None = None,
    actor: AbstractBaseUser | None = None,
    actor_label: str,
    reason: str,
) -> ModelPrice:
    """Record a new price for ``version``, in force from ``effective_from`` (the start of a
    UTC hour; None: the current hour) until the version's next price.

    Never in the past: hours before the current one may already be invoiced, so a price
    from before the current hour is refused (ValidationError, nothing written). The row
    records who (``actor``, ``actor_label``), why (``reason``), when (``created_at``) and
    the price it replaces at that hour (the before); the table is append-only.
    """
    effective_from = price_effective_hour(effective_from)
    if not reason.strip():
        raise ValidationError({"reason": "Say why the price changes."})
    if not actor_label.strip():
        raise ValidationError({"actor_label": "Say who changes the price."})
    # One change at a time per version: the row in force (the before) cannot move under us.
    ModelVersion.objects.select_for_update().filter(pk=version.pk).first()
    prices = (
        _price(prompt, "price_prompt_per_mtok"),
        _price(cached_prompt, "price_cached_prompt_per_mtok"),
        _price(completion, "price_completion_per_mtok"),
    )
    before = price_in_force(version=version, at=effective_from)
    if before is None:
        raise ValidationError("The version has no price yet: give it its first price.")
    return _record_price(
        version=version,
        effective_from=effective_from,
        prices=prices,
        replaces=before,
        actor=actor,
        actor_label=actor_label.strip(),
        reason=reason.strip(),
    )


@transaction.atomic
def price_change_withdraw(
    *,
    price: ModelPrice,
    actor: AbstractBaseUser | None = None,
    actor_label: str,
    reason: str,
) -> ModelPrice:
    """Withdraw a scheduled price change before it takes effect: the version keeps the
    price in force before it (and any later change) as if it had never been recorded.

    Only while its hour is in the future: a price in force, or once in force, may have
    billed usage, so it can only be superseded by a new ``price_change`` (ValidationError,
    nothing written). The row stays in the history with who withdrew it, when and why
    (``withdrawn_*``); the database's trigger allows that stamp once, on a future row only.
    """
    if not reason.strip():
        raise ValidationError({"reason": "Say why the price change is withdrawn."})
    if not actor_label.strip():
        raise ValidationError({"actor_label": "Say who withdraws the price change."})
    # Serialised with price_change on the version: no change is recorded against this row
    # as "the before" while it is being withdrawn.
    ModelVersion.objects.select_for_update().filter(pk=price.version_id).first()
    row = ModelPrice.objects.select_for_update().get(pk=price.pk)
    if row.withdrawn_at is not None:
        raise ValidationError(
            f"This price change was already withdrawn ({row.withdrawn_at:%Y-%m-%d %H:%M} UTC, "
            f"by {row.withdrawn_by_label})."
        )
    if row.effective_from <= timezone.now():
        raise ValidationError(
            {
                "effective_from": (
                    f"The price from {row.effective_from:%Y-%m-%d %H:%M} UTC has taken effect: "
                    "only a change still in the future can be withdrawn. Record a new price "
                    "change instead (hours at this price may already be billed)."
                )
            }
        )
    try:
        with transaction.atomic():
            ModelPrice.objects.filter(pk=row.pk).update(
                withdrawn_at=Now(),
                withdrawn_by=actor,
                withdrawn_by_label=actor_label.strip(),
                withdrawal_reason=reason.strip(),
            )
    except IntegrityError:  # its hour began between the check above and the update
        raise ValidationError(
            {"effective_from": "The price has taken effect: it can no longer be withdrawn."}
        ) from None
    row.refresh_from_db()
    return row


@transaction.atomic
def version_upsert(
    *,
    family: ModelFamily,
    name: str,
    actor: AbstractBaseUser | None = None,
    actor_label: str = "system:catalog",
    price_reason: str = "",
    **values: Any,
) -> ModelVersion:
    """Create or update one weights version; ``values`` are ModelVersion fields and the
    three ``price_*_per_mtok`` prices.

    A new version needs the three prices: its first price, in force from the epoch. For
    an existing version, prices that differ from the ones in force now are a
    ``price_change`` from the current hour, which needs ``price_reason``; to schedule a
    change for a later hour call ``price_change`` itself.
    """
    unknown = sorted(set(values) - set(VERSION_FIELDS))
    if unknown:
        raise TypeError(f"unknown version fields: {unknown}")
    existing = ModelVersion.objects.filter(name=name).first()
    version = existing or ModelVersion(family=family, name=name)
    given = {f: _price(values.pop(f), f) for f in PRICE_FIELDS if f in values}
    if existing is not None and "currency" in values and values["currency"] != version.currency:
        raise ValidationError(
            {"currency": "A version's prices stay in one currency; add a new version instead."}
        )
    for field, value in values.items():
        setattr(version, field, value)
    version.full_clean()
    version.save()
    current = price_in_force(version=version, at=timezone.now()) if existing else None
    if current is None:
        missing = [f for f in PRICE_FIELDS if f not in given]
        if missing:
            raise ValidationError({f: "A new version needs its prices." for f in missing})
        version_first_price(
            version=version,
            prompt=given[PRICE_FIELDS[0]],
            cached_prompt=given[PRICE_FIELDS[1]],
            completion=given[PRICE_FIELDS[2]],
            actor=actor,
            actor_label=actor_label,
            reason=price_reason or "First price of the version.",
        )
        return version
    wanted = tuple(given.get(f, getattr(current, f)) for f in PRICE_FIELDS)
    if wanted != tuple(getattr(current, f) for f in PRICE_FIELDS):
        price_change(
            version=version,
            prompt=wanted[0],
            cached_prompt=wanted[1],
            completion=wanted[2],
            actor=actor,
            actor_label=actor_label,
            reason=price_reason,
        )
    return version


@transaction.atomic
def version_profile_update(*, version: ModelVersion, **values: Any) -> ModelVersion:
    """Set ``values`` (``PROFILE_FIELDS`` only) on the version, checked as the model checks
    them (ValidationError, nothing written); the read model's hooks push the catalog."""
    unknown = sorted(set(values) - set(PROFILE_FIELDS))
    if unknown:
        raise TypeError(f"unknown profile fields: {unknown}")
    version = ModelVersion.objects.select_for_update().get(pk=version.pk)
    for field, value in values.items():
        setattr(version, field, value)
    version.full_clean()
    version.save(update_fields=list(values) or None)
    return version


@transaction.atomic
def version_make_current(*, version: ModelVersion) -> ModelVersion:
    """Point the family alias at this version (the previous current one stays pinnable)."""
    # Lock the family's versions in pk order, then clear before setting: the partial unique
    # constraint allows one current version per family at every moment.
    list(
        ModelVersion.objects.select_for_update()
        .filter(family=version.family_id)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    for other in ModelVersion.objects.filter(family=version.family_id, is_current=True).exclude(
        pk=version.pk
    ):
        other.is_current = False
        other.save(update_fields=["is_current"])
    version.is_current = True
    version.full_clean()
    version.save(update_fields=["is_current"])
    return version


@transaction.atomic
def replica_upsert(
    *,
    version: ModelVersion,
    name: str,
    base_url: str,
    pool: str = "shared",
    is_enabled: bool = True,
) -> Replica:
    replica = Replica.objects.filter(name=name).first() or Replica(name=name)
    replica.version = version
    replica.base_url = base_url
    replica.pool = pool
    replica.is_enabled = is_enabled
    replica.full_clean()
    replica.save()
    return replica
