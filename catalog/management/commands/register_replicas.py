"""Register (or refresh) the replicas of existing model versions in the catalog.

    manage.py register_replicas --replicas llama-70b-2026-05=http://a:8000,http://b:8000

The Kubernetes Job ``register-replicas`` runs it with the URLs that ``deploy_files`` put in
the ``fairway-replicas`` ConfigMap (one stable DNS name per vLLM pod). A version's replicas
become exactly the URLs given; the catalog push tells the gateways.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from catalog import services
from catalog.models import ModelVersion, Replica
from catalog.replica import replica_name
from tenants.management.commands.seed_demo import parse_replicas


class Command(BaseCommand):
    help = "Make each named version's replicas exactly the URLs given."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--replicas", action="append", default=[], required=True)
        parser.add_argument("--pool", choices=("shared", "reserved"), default="shared")

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        wanted = parse_replicas(options["replicas"], pool=options["pool"])
        versions = {v.name: v for v in ModelVersion.objects.filter(name__in=wanted)}
        unknown = sorted(set(wanted) - set(versions))
        if unknown:
            raise CommandError(f"unknown model version(s): {unknown}")
        for name, entries in wanted.items():
            version = versions[name]
            keep = []
            for url, pool in entries:
                rname = replica_name(name, url)
                services.replica_upsert(version=version, name=rname, base_url=url, pool=pool)
                keep.append(rname)
            for stale in Replica.objects.filter(version=version).exclude(name__in=keep):
                stale.delete()  # one by one, so the catalog push sees each delete
            self.stdout.write(f"{name}: {len(keep)} replica(s)")
