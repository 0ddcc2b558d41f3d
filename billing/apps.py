from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import fairway.celery  # noqa: F401 - tasks bind to the project's Celery app
        from billing import stripe_sync

        stripe_sync.log_sync_mode()
