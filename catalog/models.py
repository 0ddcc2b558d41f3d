"""Model registry: families (aliases), weights versions, and the replicas that serve them.

A customer asking for ``llama-70b`` gets the family's current version; asking for
``llama-70b-2026-05`` pins that weights version (docs/design.md §1). Family and version names
share one namespace in the gateway's catalog, so neither may shadow the other.
"""

from __future__ import annotations

import contextlib
import ipaddress
from datetime import UTC, datetime
from decimal import Decimal
from typing import get_args
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Func, Q

from contracts.schema import Pool

MODEL_NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,99}$"
model_name_validator = RegexValidator(
    MODEL_NAME_RE, "Use lower-case letters, digits, '.', '_' and '-' (max 100 characters)."
)
replica_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,99}$",
    "Use letters, digits and . _ : @ - (max 100 characters).",
)
POOLS: tuple[str, ...] = get_args(Pool)
# vLLM's default --max-logprobs, and OpenAI's bound on top_logprobs.
MAX_TOP_LOGPROBS = 20
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
    # The replica profile's prefill rate (tokens/s of one replica at the long-context
    # threshold) and the TTFT target: the gateway derives which prompts are long contexts
    # from them. 0 = not measured: the gateway then treats no prompt as a long context.
    prefill_tokens_per_s = models.PositiveIntegerField(
        default=0, help_text="Prefill rate of one replica (prompt tokens/s); 0 = unknown."
    )
    ttft_target_ms = models.PositiveIntegerField(
        default=1000, validators=[MinValueValidator(1)], help_text="TTFT target."
    )
    # The share of the threshold prompt's prefill time that is attention (the part that
    # grows with the context), from the replica profile: with the prefill rate the gateway
    # estimates a long prompt's first token from it. 0 = not measured: the gateway's default.
    prefill_attention_share = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text=(
            "Share of the long-context threshold prompt's prefill time that is attention, "
            "0 to 1; 0 = unknown (the gateway's default)."
        ),
    )
    # The currency the version's prices are quoted in; the prices themselves are
    # effective-dated rows of ModelPrice (catalog.services.price_change writes them).
    currency = models.CharField(max_length=3, default="usd")
    # How a replica serves this version (catalog.replica builds its command from these).
    weights = models.CharField(
        max_length=200,
        blank=True,
        help_text="vLLM's model argument: a Hugging Face repository id or a local path.",
    )
    tensor_parallel_size = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1)], help_text="GPUs per replica."
    )
    tool_call_parser = models.CharField(
        max_length=40,
        blank=True,
        help_text="vLLM's --tool-call-parser for a model with tool calling; blank: none.",
    )
    emulator_profile = models.CharField(
        max_length=60, blank=True, help_text="The emulator's profile standing in for it."
    )
    # What the replicas serving this version can do beyond plain chat; the gateway refuses a
    # request that asks for more (so a capability is off until an operator says otherwise).
    supports_tools = models.BooleanField(
        default=False, help_text="Replicas run with --enable-auto-tool-choice."
    )
    supports_structured_output = models.BooleanField(
        default=False, help_text="response_format json_object / json_schema."
    )
    max_n = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1)], help_text="Most choices per request."
    )
    supports_logprobs = models.BooleanField(default=False)
    max_top_logprobs = models.PositiveSmallIntegerField(
        default=0,
        validators=[MaxValueValidator(MAX_TOP_LOGPROBS)],
        help_text="Most alternatives per token (vLLM's --max-logprobs bounds it).",
    )
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
                condition=Q(prefill_attention_share__gte=0) & Q(prefill_attention_share__lte=1),
                name="catalog_version_attention_share_range",
                violation_error_message="The prefill attention share is between 0 and 1.",
            ),
            models.CheckConstraint(
                condition=Q(is_active=True) | Q(is_current=False),
                name="catalog_current_version_is_active",
            ),
            models.CheckConstraint(
                condition=Q(supports_tools=False) | ~Q(tool_call_parser=""),
                name="catalog_version_tools_need_a_parser",
            ),
            models.CheckConstraint(
                condition=Q(max_n__gte=1)
                & Q(max_top_logprobs__gte=0)
                & Q(max_top_logprobs__lte=MAX_TOP_LOGPROBS)
                & (Q(supports_logprobs=True) | Q(max_top_logprobs=0)),
                name="catalog_version_sampling_bounds",
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
        if self.is_current and not self.is_active:
            errors["is_current"] = "An inactive version cannot be current."
        if self.supports_tools and not self.tool_call_parser:
            errors["tool_call_parser"] = (
                "Tool calling needs the replicas' tool-call parser (e.g. llama3_json)."
            )
        if not self.supports_logprobs and self.max_top_logprobs:
            errors["max_top_logprobs"] = "top_logprobs needs supports_logprobs."
        share = self.prefill_attention_share
        if share is not None and not (isinstance(share, int | float) and 0 <= share <= 1):
            # NaN passes the min/max validators (every comparison is false)
            errors["prefill_attention_share"] = "A share between 0 and 1 (0 = unknown)."
        if errors:
            raise ValidationError(errors)


# The first price of a version is in force from the epoch: it is the price the version has
# always had (no usage of a version can predate it; migration 0005 backfilled the same).
PRICE_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class UtcHourStart(Func):
    """The start of the UTC hour holding a timestamp (PostgreSQL), for the check that a
    price takes effect on an hour boundary whatever the session's time zone."""

    template = "(date_trunc('hour', %(expressions)s AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')"
    output_field = models.DateTimeField()


class ModelPrice(models.Model):
    """One price of a model version, in force from ``effective_from`` (a UTC hour) until the
    version's next row takes over. Append-only: a trigger refuses UPDATE and DELETE, so the
    rows are the price history and its audit trail (who, when, why; ``replaces`` is the
    row that was in force at ``effective_from`` when this one was recorded — the before).

    The one exception is the withdrawal of a scheduled change (``price_change_withdraw``):
    the trigger lets the ``withdrawn_*`` columns be set once, on a row whose hour is still
    in the future, every other column unchanged. A withdrawn row stays in the history with
    who withdrew it, when and why, and is never in force (prices are read through
    ``ModelPrice.live``). Stamping the row, rather than adding a marker row elsewhere,
    keeps "one live price per version and hour" a plain partial unique constraint, so the
    withdrawn hour can be scheduled again.

    Prices are per 1,000,000 tokens, exact decimals (billing multiplies, never floats).
    Usage of an hour is billed at the row in force at that hour (docs/design.md §4,
    billing/README.md).
    """

    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="prices")
    effective_from = models.DateTimeField(help_text="Start of the UTC hour it applies from.")
    price_prompt_per_mtok = models.DecimalField(**PRICE)
    price_cached_prompt_per_mtok = models.DecimalField(**PRICE)
    price_completion_per_mtok = models.DecimalField(**PRICE)
    currency = models.CharField(max_length=3)
    replaces = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="The price in force at effective_from when this change was recorded.",
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    actor_label = models.CharField(
        max_length=100, help_text="The user's name, or 'system:<what>' for seeds and migrations."
    )
    reason = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)
    withdrawn_at = models.DateTimeField(
        null=True, blank=True, help_text="When the change was withdrawn before taking effect."
    )
    withdrawn_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    withdrawn_by_label = models.CharField(max_length=100, blank=True, default="")
    withdrawal_reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["version_id", "effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["version", "effective_from"],
                condition=Q(withdrawn_at__isnull=True),
                name="catalog_price_one_live_per_version_and_hour",
                violation_error_message="The version already has a price from that hour.",
            ),
            models.CheckConstraint(
                condition=Q(
                    withdrawn_at__isnull=True,
                    withdrawn_by__isnull=True,
                    withdrawn_by_label="",
                    withdrawal_reason="",
                )
                | (
                    Q(withdrawn_at__isnull=False, withdrawn_at__lt=F("effective_from"))
                    & ~Q(withdrawn_by_label="")
                    & ~Q(withdrawal_reason="")
                ),
                name="catalog_price_withdrawal_says_who_and_why",
            ),
            models.CheckConstraint(
                condition=Q(price_prompt_per_mtok__gte=0)
                & Q(price_cached_prompt_per_mtok__gte=0)
                & Q(price_completion_per_mtok__gte=0),
                name="catalog_price_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(price_cached_prompt_per_mtok__lte=F("price_prompt_per_mtok")),
                name="catalog_price_cached_within_prompt",
                violation_error_message=(
                    "Cached prompt tokens cannot cost more than prompt tokens."
                ),
            ),
            models.CheckConstraint(
                condition=Q(effective_from=UtcHourStart("effective_from")),
                name="catalog_price_from_an_hour",
                violation_error_message="A price takes effect at the start of a UTC hour.",
            ),
            models.CheckConstraint(
                condition=~Q(reason="") & ~Q(actor_label="") & ~Q(currency=""),
                name="catalog_price_says_who_and_why",
            ),
        ]

    def __str__(self) -> str:
        withdrawn = " (withdrawn)" if self.withdrawn_at is not None else ""
        return f"{self.version_id} from {self.effective_from:%Y-%m-%dT%H:%MZ}{withdrawn}"

    @classmethod
    def live(cls) -> models.QuerySet[ModelPrice]:
        """The rows that are or will be in force: every price lookup reads these."""
        return cls.objects.filter(withdrawn_at__isnull=True)


def replica_host_allowed(host: str, patterns: list[str]) -> bool:
    """Whether a replica URL's host is on the allow-list.

    Patterns: a CIDR or address (an IP literal must fall in one), ``name`` (exact),
    ``*.suffix`` (any name under it), ``.`` (any single-label name: one resolved only
    through the private network's own DNS, as container and cluster service names are).
    Names are not resolved here: the list names what operators control.
    """
    host = host.strip("[]").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for raw in patterns:
        pattern = raw.strip().lower()
        if not pattern:
            continue
        if address is not None:
            with contextlib.suppress(ValueError):
                if address in ipaddress.ip_network(pattern, strict=False):
                    return True
            continue
        if pattern == ".":
            if "." not in host:
                return True
        elif pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


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

    def clean(self) -> None:
        # Replicas receive every tenant's prompts: an account that can edit one must not be
        # able to point it at a server of its own. Only hosts on the allow-list qualify.
        host = urlsplit(self.base_url or "").hostname
        allowed = list(getattr(settings, "FAIRWAY_REPLICA_ALLOWED_HOSTS", []))
        if host and not replica_host_allowed(host, allowed):
            raise ValidationError(
                {
                    "base_url": (
                        f"{host} is not an allowed replica host "
                        "(FAIRWAY_REPLICA_ALLOWED_HOSTS lists the permitted networks and names)."
                    )
                }
            )
