"""console.operate becomes tenants.operate: every user and group holding the console's
permission is granted the tenants one, then the console's permission and its unmanaged
model go (the console has no models left). Reversible: backwards grants console.operate to
whoever holds tenants.operate, which stays."""

from django.db import migrations

OLD = ("console", "consoleaccess", "operate")
NEW = ("tenants", "tenant", "operate")
NAMES = {
    OLD: "Operate the fleet and tenants' plans, limits and suspension",
    NEW: "Operate tenants and the fleet: plans, limits, suspension, keys, replicas",
}


def _permission(apps, spec, *, create):
    # Permissions are made by post_migrate, after every migration: create the one we need.
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    app_label, model, codename = spec
    if create:
        content_type, _ = ContentType.objects.get_or_create(app_label=app_label, model=model)
        permission, _ = Permission.objects.get_or_create(
            content_type=content_type, codename=codename, defaults={"name": NAMES[spec]}
        )
        return permission
    return Permission.objects.filter(
        content_type__app_label=app_label, content_type__model=model, codename=codename
    ).first()


def _copy(apps, source, target):
    old = _permission(apps, source, create=False)
    if old is None:
        return None  # a fresh database: nobody holds it
    new = _permission(apps, target, create=True)
    new.user_set.add(*old.user_set.all())
    new.group_set.add(*old.group_set.all())
    return old


def forwards(apps, schema_editor):
    old = _copy(apps, OLD, NEW)
    if old is not None:
        # Its model goes in this migration: drop the permission (and with it every grant of
        # it) and its content type, as remove_stale_contenttypes would.
        content_type = old.content_type
        old.delete()
        content_type.delete()


def backwards(apps, schema_editor):
    # tenants.operate stays (tenants still declares it); the console's comes back with the
    # same holders.
    _copy(apps, NEW, OLD)


class Migration(migrations.Migration):
    dependencies = [
        ("console", "0001_initial"),
        ("tenants", "0004_operate_permission"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards),
        migrations.DeleteModel(name="ConsoleAccess"),
    ]
