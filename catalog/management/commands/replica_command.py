"""Print the command that serves one replica of a catalog model version.

manage.py replica_command llama-70b-2026-05                 # vllm serve ... (shell)
manage.py replica_command llama-8b-2026-05 --engine emulator --format json
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.models import ModelVersion
from catalog.replica import ENGINES, REPLICA_PORT, NotServable, ServingSpec, replica_argv, shell


class Command(BaseCommand):
    help = "Print the command line of one replica of a model version (from the catalog)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("version", help="a pinned model version, e.g. llama-70b-2026-05")
        parser.add_argument("--engine", choices=ENGINES, default="vllm")
        parser.add_argument("--host", default="0.0.0.0")
        parser.add_argument("--port", type=int, default=REPLICA_PORT)
        parser.add_argument("--format", choices=("shell", "json"), default="shell")

    def handle(self, *args: Any, **options: Any) -> None:
        version = ModelVersion.objects.filter(name=options["version"]).first()
        if version is None:
            known = ", ".join(ModelVersion.objects.values_list("name", flat=True)) or "none"
            raise CommandError(f"no model version {options['version']!r} (known: {known})")
        if not version.is_active:
            raise CommandError(f"{version.name} is inactive: it is not served")
        try:
            argv = replica_argv(
                ServingSpec.of(version),
                engine=options["engine"],
                host=options["host"],
                port=options["port"],
            )
        except NotServable as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps(argv) if options["format"] == "json" else shell(argv))
