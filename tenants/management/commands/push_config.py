"""Rebuild the gateway's whole read model in Redis from the database.

Idempotent: a second run finds nothing to change, writes nothing and keeps the version.
Stale records (keys revoked or deleted while a push was lost, tenants deleted) are removed.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from tenants.readmodel import read_model


class Command(BaseCommand):
    help = "Rebuild the gateway's read model in Redis (fw:cfg:*) from the database."

    def handle(self, *args: Any, **options: Any) -> None:
        model = read_model()
        result = model.rebuild()
        records = len(model.snapshot())
        if result.version is None:
            self.stdout.write(
                f"read model already up to date: {records} record(s), version {model.version()}"
            )
        else:
            self.stdout.write(
                self.style.SUCCESS(
                    f"read model rebuilt: {len(result.changed)} record(s) changed, {records} in "
                    f"total, version {result.version}"
                )
            )
