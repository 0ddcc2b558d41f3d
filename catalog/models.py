"""Model registry: families (aliases), weights versions, and the replicas that serve them.

A customer asking for ``llama-70b`` gets the family's current version; asking for
``llama-70b-2026-05`` pins that weights version (design §1 item 5). Family and version names
share one namespace in the gateway's catalog, so neither may shadow the other.
"""

from __future__ import annotations

from decimal import Decimal
from typing import get_args

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q

from gateway.schema import Pool

MODEL_NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,99}$"
model_name_validator = RegexValidator(
    MODEL_NAME_RE, "Use lower-case letters, digits, '.', '_' and '-' (max 100 characters)."
)
replica_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,99}$",
    "Use letters, digits and . _ : @ - (max 100 characters).",
)
POOLS: tuple[str, ...] = get_args(Pool)
PRICE = {"max_digits": 12, "decimal_places": 6, "validators": [MinValueValidator(Decimal(0))]}


class ModelFamily(models.Model):
    name = models.CharField(
        max_length=100,
        unique=True,
        validators=[model_name_validator],
        help_text="Alias customers send as `model`, e.g. llama-70b.",
    )
    display_name = models.CharField(max_length=200, blank=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "model families"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.name and ModelVersion.objects.filter(name=self.name).exists():
            raise ValidationError({"name": "A model version already has this name."})


class ModelVersion(models.Model):
    family = models.ForeignKey(ModelFamily, on_delete=models.PROTECT, related_name="versions")
    name = models.CharField(
        max_length=100,
        unique=True,
        validators=[model_name_validator],
        help_text="Weights version, e.g. llama-70b-2026-05; the name replicas serve.",
    )
    is_current = models.BooleanField(
        default=False, help_text="The version the family alias resolves to."
    )
    is_active = models.BooleanField(default=True, help_text="Inactive versions are not served.")
    context_length = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_bytes_per_token = models.PositiveBigIntegerField(validators=[MinValueValidator(1)])
    tpot_target_ms = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_capacity_tokens = models.PositiveBigIntegerField(
        validators=[MinValueValidator(1)], help_text="KV budget of one replica, in tokens."
    )
    # Prices per 1,000,000 tokens, exact decimals (billing multiplies, never floats).
    price_prompt_per_mtok = models.DecimalField(**PRICE)
    price_cached_prompt_per_mtok = models.DecimalField(**PRICE)
    price_completion_per_mtok = models.DecimalField(**PRICE)
    currency = models.CharField(max_length=3, default="usd")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["family__name", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["family"],
                condition=Q(is_current=True),
                name="catalog_one_current_version_per_family",
                violation_error_message="The family already has a current version.",
            ),
            models.CheckConstraint(
                condition=Q(context_length__gt=0)
                & Q(kv_bytes_per_token__gt=0)
                & Q(tpot_target_ms__gt=0)
                & Q(kv_capacity_tokens__gt=0),
                name="catalog_version_sizes_positive",
            ),
            models.CheckConstraint(
                condition=Q(price_prompt_per_mtok__gte=0)
                & Q(price_cached_prompt_per_mtok__gte=0)
                & Q(price_completion_per_mtok__gte=0),
                name="catalog_version_prices_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(price_cached_prompt_per_mtok__lte=F("price_prompt_per_mtok")),
                name="catalog_version_cached_price_within_prompt_price",
            ),
            models.CheckConstraint(
                condition=Q(is_active=True) | Q(is_current=False),
                name="catalog_current_version_is_active",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.family_id and self.name and not self.name.startswith(f"{self.family.name}-"):
            errors["name"] = f"A version name starts with its family name: '{self.family.name}-'."
        elif self.name and ModelFamily.objects.filter(name=self.name).exists():
            errors["name"] = "A model family already has this name."
        if (
            self.price_cached_prompt_per_mtok is not None
            and self.price_prompt_per_mtok is not None
            and self.price_cached_prompt_per_mtok > self.price_prompt_per_mtok
        ):
            errors["price_cached_prompt_per_mtok"] = (
                "Cached prompt tokens cannot cost more than prompt tokens."
            )
        if self.is_current and not self.is_active:
            errors["is_current"] = "An inactive version cannot be current."
        if errors:
            raise ValidationError(errors)


class Replica(models.Model):
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="replicas")
    name = models.CharField(
        max_length=100,
        unique=True,
        validators=[replica_name_validator],
        help_text="Stable replica id used in routing, metrics and usage.",
    )
    base_url = models.URLField(
        unique=True, help_text="vLLM-compatible server, e.g. http://10.0.0.5:8000"
    )
    pool = models.CharField(max_length=16, choices=[(p, p) for p in POOLS], default="shared")
    is_enabled = models.BooleanField(
        default=True, help_text="Disabled replicas receive no new traffic."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["version__name", "name"]
        constraints = [
            models.CheckConstraint(condition=Q(pool__in=POOLS), name="catalog_replica_pool_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.base_url})"
