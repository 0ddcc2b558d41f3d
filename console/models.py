"""The console has no models. Its pages are gated by permissions of the apps that own the
data: operators hold ``tenants.operate`` (``tenants.permissions``; it replaced the console's
own ``console.operate``, console/migrations/0002), finance billing's
``billing.view_reconciliation`` and ``billing.manage_invoices``."""
