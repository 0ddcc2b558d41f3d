"""Console forms. Writes go through the domain services; a service's ValidationError is put
back on the form next to the field it names (``apply_errors``)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.utils import timezone

from contracts.schema import SCOPES
from tenants.models import LIMIT_FIELDS, Plan, Role

SCOPE_HELP = {
    "chat": "chat — call /v1/chat/completions",
    "models:read": "models:read — list models (/v1/models)",
}


def apply_errors(form: forms.Form, exc: ValidationError) -> None:
    if hasattr(exc, "error_dict"):
        for field, errors in exc.message_dict.items():
            for message in errors:
                form.add_error(field if field in form.fields else None, message)
    else:
        for message in exc.messages:
            form.add_error(None, message)


class KeyCreateForm(forms.Form):
    # A fresh token per rendered form: a reload that re-posts the same form is recognised
    # and creates no second key (the secret cannot be shown again, so there is no redirect).
    form_id = forms.CharField(widget=forms.HiddenInput, max_length=64)
    name = forms.CharField(max_length=100, help_text="Something that says where it is used.")
    scopes = forms.MultipleChoiceField(
        choices=[(s, SCOPE_HELP.get(s, s)) for s in SCOPES],
        widget=forms.CheckboxSelectMultiple,
        initial=list(SCOPES),
    )
    expires_on = forms.DateField(
        required=False,
        widget=forms.DateInput(attrs={"type": "date"}),
        help_text="Optional. The key stops working at 00:00 UTC on this day.",
    )

    def clean_expires_on(self) -> date | None:
        value: date | None = self.cleaned_data.get("expires_on")
        if value is not None and value <= timezone.now().date():
            raise ValidationError("Pick a day after today.")
        return value

    def expires_at(self) -> datetime | None:
        day = self.cleaned_data.get("expires_on")
        return None if day is None else datetime(day.year, day.month, day.day, tzinfo=UTC)


class MemberAddForm(forms.Form):
    user = forms.CharField(
        max_length=150, label="User", help_text="Username or email of an existing account."
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


GRANULARITY = [("hour", "Hourly"), ("day", "Daily")]


class UsageFilterForm(forms.Form):
    start = forms.DateField(label="From (UTC day)", widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(label="To (UTC day)", widget=forms.DateInput(attrs={"type": "date"}))
    granularity = forms.ChoiceField(choices=GRANULARITY, initial="day")
    model = forms.ChoiceField(required=False, label="Model")
    key = forms.ChoiceField(required=False, label="API key")

    def __init__(self, *args: Any, models: list[str], keys: dict[str, str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = [("", "All models"), *[(m, m) for m in models]]
        self.fields["key"].choices = [("", "All keys"), *keys.items()]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        start, end = data.get("start"), data.get("end")
        if start and end:
            if end < start:
                self.add_error("end", "The end is before the start.")
            else:
                longest = 31 if data.get("granularity") == "hour" else 366
                if (end - start).days + 1 > longest:
                    self.add_error(
                        "end",
                        f"At most {longest} days {'hourly' if longest == 31 else 'daily'}.",
                    )
        return data


def default_range(today: date, days: int = 14) -> tuple[date, date]:
    return today - timedelta(days=days - 1), today


class TenantPlanForm(forms.Form):
    plan = forms.ModelChoiceField(queryset=Plan.objects.order_by("name"), empty_label=None)
    suspended = forms.BooleanField(
        required=False, help_text="A suspended tenant's keys are refused by every gateway."
    )


LIMIT_LABELS = {
    "rpm": "Requests per minute",
    "tpm": "Tokens per minute",
    "max_context": "Max context (tokens)",
    "max_output": "Max output (tokens)",
    "kv_seconds_cap": "KV·seconds cap (GiB·s)",
    "reserved_kv": "Reserved floor (GiB·s)",
}


class LimitForm(forms.Form):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for name in LIMIT_FIELDS:
            self.fields[name] = forms.IntegerField(min_value=0, label=LIMIT_LABELS[name])


# A key's own limits: the API's bounds (a PostgreSQL integer, bigint for tokens).
KEY_LIMIT_FIELDS = {
    "rpm": ("Requests per minute", 2**31 - 1),
    "tpm": ("Tokens per minute", 2**62),
    "max_concurrency": ("Requests in flight", 2**31 - 1),
}


def _tenant_value(value: int | None) -> str:
    if value is None:
        return "none: your tenant cannot use this model"
    return "unlimited" if value == 0 else f"{value:,}"


class KeyLimitForm(forms.Form):
    """One key's own limits for one model family. An empty field adds no key limit of that
    kind, so the tenant's applies (the tenant has no requests-in-flight limit per key)."""

    def __init__(
        self, *args: Any, tenant_rpm: int | None = None, tenant_tpm: int | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        empty = "Empty: the tenant's applies."
        helps = {
            "rpm": f"Your tenant's limit: {_tenant_value(tenant_rpm)}. {empty}",
            "tpm": f"Your tenant's limit: {_tenant_value(tenant_tpm)}. {empty}",
            "max_concurrency": "How many of this key's requests may run at once. Empty: no cap.",
        }
        for name, (label, largest) in KEY_LIMIT_FIELDS.items():
            self.fields[name] = forms.IntegerField(
                required=False,
                min_value=1,
                max_value=largest,
                label=label,
                help_text=helps[name],
                error_messages={
                    "invalid": "Enter a whole number, or leave it empty.",
                    "min_value": "Enter 1 or more, or leave it empty.",
                    "max_value": "Enter a number no larger than %(limit_value)s.",
                },
            )

    def values(self) -> dict[str, int | None]:
        return {name: self.cleaned_data.get(name) for name in KEY_LIMIT_FIELDS}

    def is_empty(self) -> bool:
        return all(value is None for value in self.values().values())
