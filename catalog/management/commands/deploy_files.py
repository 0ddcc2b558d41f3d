"""Write the replica parts of docker/compose.yaml, docker/compose.gpu.yaml and deploy/k8s
from the catalog.

manage.py deploy_files --demo           # from tenants.demo (what is committed)
manage.py deploy_files                  # from this database's active versions
manage.py deploy_files --demo --check   # exit 1 if the committed files differ
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.deployfiles import REPLICAS_PER_VERSION, demo_fleet, fleet_from, write_all
from catalog.models import ModelVersion
from catalog.replica import ServingSpec


class Command(BaseCommand):
    help = "Generate the replica parts of docker/compose*.yaml and deploy/k8s."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--demo", action="store_true", help="the demo catalog, no DB")
        parser.add_argument("--check", action="store_true", help="compare, write nothing")
        parser.add_argument("--replicas", type=int, default=REPLICAS_PER_VERSION)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["demo"]:
            fleet = demo_fleet()
        else:
            versions = ModelVersion.objects.filter(is_active=True).order_by("name")
            fleet = fleet_from([ServingSpec.of(v) for v in versions], options["replicas"])
        stale = write_all(fleet, check=options["check"])
        for path in stale:
            self.stdout.write(f"{'differs' if options['check'] else 'wrote'}: {path}")
        if options["check"] and stale:
            raise CommandError("deployment files are out of date: run manage.py deploy_files")
