"""Seed demo data: three plans, the 70B and 8B models, one tenant per plan with an owner and
a demo API key, an operator and a finance account for the console, and a few weeks of hourly
usage per demo tenant (with its invoices) so the console's charts and invoices are not empty.
Idempotent; see tenants/demo.py for the numbers.

API-key secrets and management-API tokens cannot be recovered (only their digests are
stored), so a key or token is minted only when the keys file lacks a usable one for that
tenant or user (a token expires after FAIRWAY_API_TOKEN_MAX_AGE_H hours); the file (mode
0600) is the only place the secrets live.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from catalog import services as catalog_services
from catalog.models import ModelFamily, ModelVersion, Replica
from catalog.replica import replica_name
from contracts.schema import SCOPES, hash_api_key
from tenants import selectors, services
from tenants.demo import MODELS, PLANS, demo_usage_rows, plan_limits
from tenants.models import ApiKey, Membership, Plan, Role, Tenant

DEFAULT_KEYS_OUT = Path(settings.BASE_DIR) / "var" / "demo-keys.json"
DEFAULT_PASSWORD = "fairway-demo"  # noqa: S105 - documented demo credential, dev only
OPERATOR = "operator"
FINANCE = "finance"


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
            help="Replicas only reserved-class (enterprise) traffic may enter (docs/design.md R2).",
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
        parser.add_argument(
            "--usage-days",
            type=int,
            default=0,
            help="Days of made-up hourly usage to write for each demo tenant that has none, "
            "with its invoices (default 0: none, so real traffic's counts stay exact; "
            "`make up` asks for 40, which reaches into last month).",
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
            secrets_file[FINANCE] = self._finance(
                secrets_file.get(FINANCE, {}), options["password"]
            )
            written = self._usage(options["usage_days"]) if options["usage_days"] > 0 else 0
        if written:
            # Invoices for the demo history now rather than at the first periodic run: last
            # month finalized, this month's drafts (billing's own periodic job).
            from billing.services import invoice_cycle

            counts = invoice_cycle(grace_s=settings.BILLING_FINALIZE_GRACE_S)
            self.stdout.write(
                f"  wrote {written} hourly demo usage rows; invoices: {counts['drafted']} "
                f"drafted, {counts['finalized']} finalized"
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
            f"  operator (console fleet and tenants, Django admin, operator API): {OPERATOR} / "
            f"{secrets_file[OPERATOR]['password']}"
        )
        self.stdout.write(
            f"  finance (console invoices and reconciliation): {FINANCE} / "
            f"{secrets_file[FINANCE]['password']}"
        )
        self.stdout.write("  console: http://127.0.0.1:8000 (sign in as a demo owner above)")

    # -- pieces -------------------------------------------------------------------------
    def _models(self, replicas: dict[str, list[tuple[str, str]]]) -> None:
        for model in MODELS:
            version = model.upsert(make_current=True)
            if model.version in replicas:
                self._replicas(version, replicas[model.version])

    def _replicas(self, version: ModelVersion, entries: list[tuple[str, str]]) -> None:
        names = []
        for url, pool in entries:
            name = replica_name(version.name, url)
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
                name=demo.name,
                admission_class=demo.admission_class,
                display_name=demo.display_name,
                base_fee=demo.base_fee,
            )
            if plan.base_fee != demo.base_fee:
                services.plan_set_base_fee(plan=plan, base_fee=demo.base_fee)
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
        return {
            "key": secret,
            "tenant_id": str(tenant.id),
            "plan": plan.name,
            "owner": owner.username,
            "owner_password": new_password or previous.get("owner_password", "(unchanged)"),
            "owner_token": self._token(owner, previous.get("owner_token")),
        }

    def _operator(self, previous: dict[str, Any], password: str) -> dict[str, Any]:
        user, new_password = self._user(OPERATOR, password, is_staff=True, is_superuser=True)
        self._grant(user, "tenants", "operate")
        return {
            "username": user.username,
            "password": new_password or previous.get("password", "(unchanged)"),
            "token": self._token(user, previous.get("token")),
        }

    def _finance(self, previous: dict[str, Any], password: str) -> dict[str, Any]:
        user, new_password = self._user(FINANCE, password, is_staff=True)
        self._grant(user, "billing", "view_reconciliation")
        self._grant(user, "billing", "manage_invoices")
        return {
            "username": user.username,
            "password": new_password or previous.get("password", "(unchanged)"),
        }

    @staticmethod
    def _grant(user: Any, app_label: str, codename: str) -> None:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )

    def _usage(self, days: int) -> int:
        """Hourly rows for every demo tenant without any usage yet, attributed to its demo
        key; written once (the rollup only ever grows in real life, so re-seeding must not
        rewrite history)."""
        from metering.models import Usage

        written = 0
        versions = {
            v.name: v for v in ModelVersion.objects.filter(name__in=[m.version for m in MODELS])
        }
        for plan in PLANS:
            tenant = Tenant.objects.filter(name=f"demo-{plan.name}").first()
            if tenant is None or Usage.objects.filter(tenant=tenant).exists():
                continue
            key = ApiKey.objects.filter(tenant=tenant).order_by("created_at").first()
            if key is None:
                continue
            rows = [
                Usage(
                    tenant=tenant, api_key_id=key.id, model_version=versions[r.version], **r.counts
                )
                for r in demo_usage_rows(plan=plan.name, days=days, seed=plan.name)
            ]
            Usage.objects.bulk_create(rows)
            written += len(rows)
        return written

    @staticmethod
    def _token(user: Any, previous: str | None) -> str:
        """The file's management-API token of ``user`` while it works, else a new one."""
        token = selectors.api_token_for_secret(secret=previous) if previous else None
        if token is not None and token.user_id == user.pk and not token.is_expired():
            return str(previous)
        return services.api_token_create(user=user)[1]

    @staticmethod
    def _usable(secret: str, tenant: Tenant) -> bool:
        key_hash = hash_api_key(secret, services.key_pepper())
        key = ApiKey.objects.filter(key_hash=key_hash, tenant=tenant).first()
        return key is not None and key.is_active()
