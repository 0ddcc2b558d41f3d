"""Seed demo data: three plans, the 70B and 8B models, one tenant per plan with an owner and
a demo API key, and an operator account. Idempotent; see tenants/demo.py for the numbers.

API-key secrets cannot be recovered, so a key is minted only when the keys file lacks a
usable one for that tenant; the file (mode 0600) is the only place the secrets live.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from rest_framework.authtoken.models import Token

from catalog import services as catalog_services
from catalog.models import ModelFamily, ModelVersion, Replica
from gateway.schema import SCOPES, hash_api_key
from tenants import services
from tenants.demo import MODELS, PLANS, plan_limits
from tenants.models import ApiKey, Membership, Plan, Role, Tenant

DEFAULT_KEYS_OUT = Path(settings.BASE_DIR) / "var" / "demo-keys.json"
DEFAULT_PASSWORD = "fairway-demo"  # noqa: S105 - documented demo credential, dev only
OPERATOR = "operator"


def parse_replicas(specs: list[str], *, pool: str = "shared") -> dict[str, list[tuple[str, str]]]:
    """``VERSION=URL[,URL...]`` (repeatable) -> {version: [(url, pool), ...]}."""
    out: dict[str, list[tuple[str, str]]] = {}
    for spec in specs:
        version, sep, urls = spec.partition("=")
        parsed = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if not sep or not version.strip() or not parsed:
            raise CommandError(f"{spec!r}: expected VERSION=URL[,URL...]")
        for url in parsed:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise CommandError(f"{spec!r}: {url!r} is not an http(s) URL")
        out.setdefault(version.strip(), []).extend((url, pool) for url in parsed)
    return out


class Command(BaseCommand):
    help = "Create (or refresh) the demo plans, models, tenants, owners and API keys."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--replicas",
            action="append",
            default=[],
            metavar="VERSION=URL[,URL...]",
            help="Shared-pool replica base URLs of a model version "
            "(repeatable). With --reserved-replicas, a named version's "
            "replicas become exactly the URLs given.",
        )
        parser.add_argument(
            "--reserved-replicas",
            action="append",
            default=[],
            metavar="VERSION=URL[,URL...]",
            help="Replicas only reserved-class (enterprise) traffic may enter (design R2).",
        )
        parser.add_argument(
            "--keys-out",
            type=Path,
            default=DEFAULT_KEYS_OUT,
            help=f"JSON file for demo secrets (default {DEFAULT_KEYS_OUT}).",
        )
        parser.add_argument(
            "--password", default=DEFAULT_PASSWORD, help="Password for newly created demo users."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        replicas = parse_replicas(options["replicas"])
        for version, entries in parse_replicas(
            options["reserved_replicas"], pool="reserved"
        ).items():
            replicas.setdefault(version, []).extend(entries)
        known = {m.version for m in MODELS}
        unknown = sorted(set(replicas) - known)
        if unknown:
            raise CommandError(
                f"--replicas for unknown version(s) {unknown}; demo versions are {sorted(known)}"
            )
        keys_out: Path = options["keys_out"]
        secrets_file = json.loads(keys_out.read_text()) if keys_out.exists() else {}
        with transaction.atomic():
            self._models(replicas)
            plans = self._plans()
            for plan in plans:
                secrets_file[f"demo-{plan.name}"] = self._tenant(
                    plan, secrets_file.get(f"demo-{plan.name}", {}), options["password"]
                )
            secrets_file[OPERATOR] = self._operator(
                secrets_file.get(OPERATOR, {}), options["password"]
            )
        keys_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = keys_out.with_suffix(".tmp")
        tmp.write_text(json.dumps(secrets_file, indent=2) + "\n")
        os.chmod(tmp, 0o600)
        tmp.replace(keys_out)
        self.stdout.write(self.style.SUCCESS(f"demo data ready; secrets in {keys_out}"))
        for name, info in secrets_file.items():
            if "key" in info:
                self.stdout.write(
                    f"  {name} ({info['plan']}): owner {info['owner']} / "
                    f"{info['owner_password']}  key {info['key'][:11]}…"
                )
        self.stdout.write(
            f"  operator (Django admin, staff API): {OPERATOR} / "
            f"{secrets_file[OPERATOR]['password']}"
        )

    # -- pieces -------------------------------------------------------------------------
    def _models(self, replicas: dict[str, list[tuple[str, str]]]) -> None:
        for model in MODELS:
            family = catalog_services.family_upsert(
                name=model.family, display_name=model.display_name
            )
            version = catalog_services.version_upsert(
                family=family,
                name=model.version,
                context_length=model.context_length,
                kv_bytes_per_token=model.kv_bytes_per_token,
                tpot_target_ms=model.tpot_target_ms,
                kv_capacity_tokens=model.kv_capacity_tokens,
                price_prompt_per_mtok=model.price_prompt_per_mtok,
                price_cached_prompt_per_mtok=model.price_cached_prompt_per_mtok,
                price_completion_per_mtok=model.price_completion_per_mtok,
                is_active=True,
            )
            if not version.is_current:
                catalog_services.version_make_current(version=version)
            if model.version in replicas:
                self._replicas(version, replicas[model.version])

    def _replicas(self, version: ModelVersion, entries: list[tuple[str, str]]) -> None:
        names = []
        for url, pool in entries:
            name = f"{version.name}@{urlsplit(url).netloc}"
            for other in Replica.objects.filter(base_url=url).exclude(name=name):
                other.delete()
            catalog_services.replica_upsert(version=version, name=name, base_url=url, pool=pool)
            names.append(name)
        for stale in Replica.objects.filter(version=version).exclude(name__in=names):
            stale.delete()  # one by one, so the catalog push sees each delete

    def _plans(self) -> list[Plan]:
        plans = []
        for demo in PLANS:
            plan = Plan.objects.filter(name=demo.name).first() or services.plan_create(
                name=demo.name, admission_class=demo.admission_class, display_name=demo.display_name
            )
            for model in MODELS:
                family = ModelFamily.objects.get(name=model.family)
                services.plan_limit_set(plan=plan, family=family, **plan_limits(demo, model))
            plans.append(plan)
        return plans

    def _user(self, username: str, password: str, **extra: Any) -> tuple[Any, str | None]:
        user = get_user_model().objects.filter(username=username).first()
        if user is not None:
            return user, None
        user = get_user_model().objects.create_user(
            username=username, password=password, email=f"{username}@example.com", **extra
        )
        return user, password

    def _tenant(self, plan: Plan, previous: dict[str, Any], password: str) -> dict[str, Any]:
        name = f"demo-{plan.name}"
        owner, new_password = self._user(f"{plan.name}-owner", password)
        tenant = Tenant.objects.filter(name=name).first() or services.tenant_create(
            name=name, plan=plan, billing_email=f"billing@{plan.name}.example.com"
        )
        if not Membership.objects.filter(tenant=tenant, user=owner).exists():
            services.membership_add(tenant=tenant, user=owner, role=Role.OWNER)
        secret = previous.get("key")
        if not (secret and self._usable(secret, tenant)):
            _, secret = services.api_key_create(
                tenant=tenant, name="demo key", scopes=SCOPES, created_by=owner
            )
        token, _ = Token.objects.get_or_create(user=owner)
        return {
            "key": secret,
            "tenant_id": str(tenant.id),
            "plan": plan.name,
            "owner": owner.username,
            "owner_password": new_password or previous.get("owner_password", "(unchanged)"),
            "owner_token": token.key,
        }

    def _operator(self, previous: dict[str, Any], password: str) -> dict[str, Any]:
        user, new_password = self._user(OPERATOR, password, is_staff=True, is_superuser=True)
        token, _ = Token.objects.get_or_create(user=user)
        return {
            "username": user.username,
            "password": new_password or previous.get("password", "(unchanged)"),
            "token": token.key,
        }

    @staticmethod
    def _usable(secret: str, tenant: Tenant) -> bool:
        key_hash = hash_api_key(secret, services.key_pepper())
        key = ApiKey.objects.filter(key_hash=key_hash, tenant=tenant).first()
        return key is not None and key.is_active()
