"""``manage.py billing_reconcile --period 2026-11 [--tenant ID|NAME] [--csv out.csv]``

Prints every difference between request_log, usage, invoices and Stripe for the month,
with its amount and likely cause; exits 1 when there is any (so a cron job can alert).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing.periods import parse_period
from billing.reconciliation import reconcile
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Reconcile request_log, usage, invoices and Stripe for one month."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--period", required=True, help="YYYY-MM (UTC calendar month)")
        parser.add_argument("--tenant", help="tenant id or name (default: all tenants)")
        parser.add_argument("--csv", type=Path, help="also write the differences here as CSV")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            period = parse_period(options["period"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        tenant = None
        if options["tenant"]:
            tenant = self._tenant(options["tenant"])
        report = reconcile(period_start=period, tenant=tenant)
        for note in report.notes:
            self.stdout.write(f"note: {note}")
        for name, totals in report.totals.items():
            self.stdout.write(
                f"{name}: " + ", ".join(f"{k}={v}" for k, v in sorted(totals.items()))
            )
        for d in report.differences:
            self.stdout.write(
                f"DIFF {d.tenant} {d.period} [{d.check}] {d.subject}: expected {d.expected}, "
                f"actual {d.actual}, amount {d.amount} {d.currency} — {d.cause}"
            )
        if options["csv"]:
            options["csv"].write_text(report.to_csv())
            self.stdout.write(f"wrote {options['csv']}")
        summary = (
            f"{report.period}: {report.tenants} tenant(s), {len(report.differences)} difference(s)"
        )
        if report.differences:
            self.stdout.write(self.style.WARNING(summary))
            raise SystemExit(1)
        self.stdout.write(self.style.SUCCESS(summary))

    @staticmethod
    def _tenant(value: str) -> Tenant:
        query = Tenant.objects.select_related("plan")
        try:
            found = query.filter(pk=UUID(value)).first()
        except ValueError:
            found = query.filter(name=value).first()
        if found is None:
            raise CommandError(f"no tenant {value!r}")
        return found
