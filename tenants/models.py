"""Plans, tenants, members, API keys, management-API tokens and per-tenant per-model-family
limits.

Database constraints come first (non-negative limits, max_output <= max_context, one row per
tenant and family, one membership per user and tenant); ``clean()`` repeats the cross-field
rules so that services report them against the right field.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from contracts.schema import ADMISSION_CLASSES, SCOPES


class Role(models.TextChoices):
    OWNER = "owner"
    ADMIN = "admin"
    BILLING = "billing"
    MEMBER = "member"


NON_NEGATIVE = [MinValueValidator(0)]
LIMIT_FIELDS = ("rpm", "tpm", "max_context", "max_output", "kv_seconds_cap", "reserved_kv")


class LimitFields(models.Model):
    """The limits the gateway enforces per tenant per model family (docs/design.md §4, §6)."""

    rpm = models.IntegerField("requests/min", validators=NON_NEGATIVE)
    tpm = models.BigIntegerField("tokens/min", validators=NON_NEGATIVE)
    max_context = models.IntegerField("max context tokens", validators=NON_NEGATIVE)
    max_output = models.IntegerField("max output tokens", validators=NON_NEGATIVE)
    kv_seconds_cap = models.BigIntegerField(
        "KV·seconds cap (GiB·s)",
        validators=NON_NEGATIVE,
        help_text="Cap on the summed KV·seconds estimate of in-flight requests.",
    )
    reserved_kv = models.BigIntegerField(
        "reserved KV floor (GiB·s)",
        default=0,
        validators=NON_NEGATIVE,
        help_text="Enterprise floor admitted regardless of fleet occupancy; 0 elsewhere.",
    )

    class Meta:
        abstract = True
        constraints = [
            models.CheckConstraint(
                condition=Q(rpm__gte=0)
                & Q(tpm__gte=0)
                & Q(max_context__gte=0)
                & Q(max_output__gte=0)
                & Q(kv_seconds_cap__gte=0)
                & Q(reserved_kv__gte=0),
                name="%(app_label)s_%(class)s_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(max_output__lte=F("max_context")),
                name="%(app_label)s_%(class)s_output_within_context",
            ),
            models.CheckConstraint(
                condition=Q(reserved_kv__lte=F("kv_seconds_cap")),
                name="%(app_label)s_%(class)s_floor_within_cap",
            ),
        ]

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if (
            self.max_output is not None
            and self.max_context is not None
            and self.max_output > self.max_context
        ):
            errors["max_output"] = "max_output cannot exceed max_context."
        if (
            self.reserved_kv is not None
            and self.kv_seconds_cap is not None
            and self.reserved_kv > self.kv_seconds_cap
        ):
            errors["reserved_kv"] = "reserved_kv cannot exceed kv_seconds_cap."
        family = getattr(self, "family", None) if getattr(self, "family_id", None) else None
        if family is not None and self.max_context is not None:
            longest = family.versions.filter(is_active=True).aggregate(
                m=models.Max("context_length")
            )["m"]
            if longest is not None and self.max_context > longest:
                errors.setdefault(
                    "max_context",
                    f"max_context cannot exceed the model's context length ({longest}).",
                )
        plan = self.limit_plan()
        if plan is not None and self.reserved_kv and not plan.is_reserved:
            errors.setdefault(
                "reserved_kv", "A reserved KV floor needs a plan with the reserved admission class."
            )
        if errors:
            raise ValidationError(errors)

    def limit_plan(self) -> Plan | None:
        """The plan whose admission class governs this row (None while unset)."""
        return None


class Plan(models.Model):
    name = models.SlugField(max_length=50, unique=True)
    display_name = models.CharField(max_length=100, blank=True)
    admission_class = models.CharField(max_length=16, choices=[(c, c) for c in ADMISSION_CLASSES])
    # A flat monthly fee invoiced on top of usage (no proration: the plan the tenant holds
    # when the month's invoice is built or finalized is the one charged).
    base_fee = models.DecimalField(
        max_digits=12, decimal_places=2, default=Decimal(0), validators=NON_NEGATIVE
    )
    currency = models.CharField(
        max_length=3, default="usd", help_text="ISO 4217, lower case; the invoices' currency."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(admission_class__in=ADMISSION_CLASSES),
                name="tenants_plan_admission_class_valid",
            ),
            models.CheckConstraint(
                condition=Q(base_fee__gte=0), name="tenants_plan_base_fee_non_negative"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_reserved(self) -> bool:
        return self.admission_class == "reserved"


class PlanModelLimit(LimitFields):
    """A plan's default limits for one model family. A plan grants access to exactly the
    families it has a row for (plus any family a tenant has an override for)."""

    plan = models.ForeignKey(Plan, on_delete=models.CASCADE, related_name="model_limits")
    family = models.ForeignKey(
        "catalog.ModelFamily", on_delete=models.CASCADE, related_name="plan_limits"
    )

    class Meta(LimitFields.Meta):
        ordering = ["plan__name", "family__name"]
        constraints = [
            *LimitFields.Meta.constraints,
            models.UniqueConstraint(
                fields=["plan", "family"], name="tenants_planmodellimit_one_per_family"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.plan.name} / {self.family.name}"

    def limit_plan(self) -> Plan | None:
        return self.plan if self.plan_id else None


class Tenant(models.Model):
    # The public, stable id the gateway's read model keys on.
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="tenants")
    billing_email = models.EmailField(blank=True)
    stripe_customer_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    suspended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        # The operator's permission, tenants.operate (tenants.permissions says what it opens).
        permissions = [
            ("operate", "Operate tenants and the fleet: plans, limits, suspension, keys, replicas"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["stripe_customer_id"],
                condition=~Q(stripe_customer_id=""),
                name="tenants_tenant_stripe_customer_unique",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_suspended(self) -> bool:
        return self.suspended_at is not None


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__name", "user__username"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "tenant"],
                name="tenants_membership_one_per_user",
                violation_error_message="The user is already a member of this tenant.",
            ),
            models.CheckConstraint(
                condition=Q(role__in=Role.values), name="tenants_membership_role_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class ApiKey(models.Model):
    """The secret is shown once at creation; only its peppered HMAC is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="Visible start of the secret.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "created_at"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__isnull=True) | Q(expires_at__gt=F("created_at")),
                name="tenants_apikey_expires_after_creation",
            ),
            models.CheckConstraint(
                condition=Q(revoked_at__isnull=True) | Q(revoked_at__gte=F("created_at")),
                name="tenants_apikey_revoked_after_creation",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    def clean(self) -> None:
        scopes = self.scopes
        if not isinstance(scopes, list) or not scopes:
            raise ValidationError({"scopes": "Give at least one scope."})
        unknown = sorted({str(s) for s in scopes} - set(SCOPES))
        if unknown:
            raise ValidationError(
                {"scopes": f"Unknown scope(s): {', '.join(unknown)}. Known: {', '.join(SCOPES)}."}
            )
        if len(set(scopes)) != len(scopes):
            raise ValidationError({"scopes": "Scopes must not repeat."})

    def is_active(self, now: datetime | None = None) -> bool:
        at = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > at)


class ApiTokenScheme(models.IntegerChoices):
    """How an ``ApiToken``'s ``token_hash`` was computed (``tenants.selectors``)."""

    # HMAC(pepper, token), the API keys' digest: every token issued before the label existed,
    # the DRF tokens carried over by migration 0005 included. Accepted until they expire.
    UNLABELLED = 1, "unlabelled (API keys' HMAC)"
    # HMAC(pepper, label + token) (contracts.schema.hash_api_token): every token issued now.
    LABELLED = 2, "labelled"


class ApiToken(models.Model):
    """A management-API token (``/api/v1/``, sent as ``Authorization: Token …`` or
    ``Bearer …``). Like an API key's secret, the token is returned once, by the token
    endpoint, and only its peppered HMAC is stored. It expires
    ``FAIRWAY_API_TOKEN_MAX_AGE_H`` hours after ``created_at`` (``tenants.authentication``);
    revoking it deletes the row, and so does a change of its user's password
    (``tenants.credential_hooks``)."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    prefix = models.CharField(max_length=16, help_text="Visible start of the token.")
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    # A row written without it (by a process of the release before, during a rolling
    # deploy) holds that release's unlabelled digest: hence the database default.
    scheme = models.PositiveSmallIntegerField(
        choices=ApiTokenScheme.choices,
        default=ApiTokenScheme.LABELLED,
        db_default=ApiTokenScheme.UNLABELLED,
        editable=False,
        help_text="How token_hash was computed.",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "created_at"])]
        verbose_name = "management-API token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.created_at <= api_token_cutoff(now)


def api_token_cutoff(now: datetime | None = None) -> datetime:
    """Management-API tokens created at or before this time have expired."""
    max_age = timedelta(hours=float(settings.FAIRWAY_API_TOKEN_MAX_AGE_H))
    return (now or timezone.now()) - max_age


class TenantModelLimit(LimitFields):
    """A tenant's override of its plan's defaults for one model family: a full row."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="model_limits")
    family = models.ForeignKey(
        "catalog.ModelFamily", on_delete=models.CASCADE, related_name="tenant_limits"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta(LimitFields.Meta):
        ordering = ["tenant__name", "family__name"]
        constraints = [
            *LimitFields.Meta.constraints,
            models.UniqueConstraint(
                fields=["tenant", "family"],
                name="tenants_tenantmodellimit_one_per_family",
                violation_error_message="This tenant already has limits for this model.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.name} / {self.family.name}"

    def limit_plan(self) -> Plan | None:
        return self.tenant.plan if self.tenant_id else None


class ApiKeyModelLimit(models.Model):
    """An API key's own limits for one model family, inside its tenant's.

    Each value is optional (null: the key adds no limit of that kind). A key limit may not be
    set above the tenant's effective limit at the time it is set. The gateway enforces the
    key's limits *and* the tenant's, so if the tenant's limit is lowered later the key's
    effective limit is the smaller of the two; the stored key value is left as it was and
    binds again if the tenant's limit is raised. The concurrency cap (requests in flight at
    once) has no tenant counterpart.
    """

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="model_limits")
    family = models.ForeignKey(
        "catalog.ModelFamily", on_delete=models.CASCADE, related_name="key_limits"
    )
    rpm = models.PositiveIntegerField(
        "requests/min", null=True, blank=True, validators=[MinValueValidator(1)]
    )
    tpm = models.PositiveBigIntegerField(
        "tokens/min", null=True, blank=True, validators=[MinValueValidator(1)]
    )
    max_concurrency = models.PositiveIntegerField(
        "requests in flight", null=True, blank=True, validators=[MinValueValidator(1)]
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["family__name"]
        constraints = [
            models.UniqueConstraint(
                fields=["api_key", "family"],
                name="tenants_apikeymodellimit_one_per_family",
                violation_error_message="This key already has limits for this model.",
            ),
            models.CheckConstraint(
                condition=(Q(rpm__isnull=True) | Q(rpm__gte=1))
                & (Q(tpm__isnull=True) | Q(tpm__gte=1))
                & (Q(max_concurrency__isnull=True) | Q(max_concurrency__gte=1)),
                name="tenants_apikeymodellimit_positive",
            ),
            models.CheckConstraint(
                condition=Q(rpm__isnull=False)
                | Q(tpm__isnull=False)
                | Q(max_concurrency__isnull=False),
                name="tenants_apikeymodellimit_not_empty",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.api_key} / {self.family}"

    def clean(self) -> None:
        if self.rpm is None and self.tpm is None and self.max_concurrency is None:
            raise ValidationError("Give at least one of rpm, tpm and max_concurrency.")
        if not self.api_key_id or not getattr(self, "family_id", None):
            return
        from tenants.limits import effective_limits  # tenants.limits imports this module

        tenant_limit = effective_limits(self.api_key.tenant).get(self.family.name)
        if tenant_limit is None:
            raise ValidationError(
                {"family": f"The tenant cannot use {self.family.name}, so its keys cannot either."}
            )
        errors: dict[str, str] = {}
        for name, label in (("rpm", "requests/min"), ("tpm", "tokens/min")):
            value, ceiling = getattr(self, name), getattr(tenant_limit, name)
            if value is not None and ceiling > 0 and value > ceiling:  # tenant 0 = unlimited
                errors[name] = (
                    f"A key's {label} cannot exceed its tenant's limit for "
                    f"{self.family.name} ({ceiling})."
                )
        if errors:
            raise ValidationError(errors)
