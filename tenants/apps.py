from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The project's Celery app becomes current, so tasks bind to its broker; and every
        # write to a pushed entity schedules a read-model push after commit; a password
        # change revokes its user's management-API tokens.
        import fairway.celery  # noqa: F401
        from tenants import credential_hooks, readmodel_hooks  # noqa: F401
