"""Management-API tokens of our own, stored as digests: DRF's ``authtoken`` kept them in
plaintext. Each DRF token still in the database becomes an ``ApiToken`` holding the HMAC of
its key (with its creation time, so it expires when it would have), so issued tokens keep
working; then DRF's table is dropped, its migration records forgotten (re-installing the app
would create the table afresh) and its content types and permissions deleted, as
``remove_stale_contenttypes`` would. Backwards drops the new table: the tokens are lost
(their plaintext is gone), and users obtain new ones.
"""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

from contracts.schema import hash_api_key

DRF_TABLE = "authtoken_token"
DRF_APP = "authtoken"
PREFIX_CHARS = 8  # DRF keys are 40 hex digits; the first 8 stay visible, as a prefix


def drf_token_rows(apps, key_pepper: bytes, rows):
    """``ApiToken`` s for DRF's ``(key, user_id, created)`` rows: the digest, never the key."""
    ApiToken = apps.get_model("tenants", "ApiToken")
    return [
        ApiToken(
            user_id=user_id,
            prefix=key[:PREFIX_CHARS],
            token_hash=hash_api_key(key, key_pepper),
            created_at=created,
        )
        for key, user_id, created in rows
    ]


def replace_drf_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if DRF_TABLE in connection.introspection.table_names():
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT key, user_id, created FROM {DRF_TABLE}")  # noqa: S608
            rows = cursor.fetchall()
        pepper = str(settings.FAIRWAY_KEY_PEPPER).encode("utf-8")
        ApiToken = apps.get_model("tenants", "ApiToken")
        ApiToken.objects.bulk_create(drf_token_rows(apps, pepper, rows))
        schema_editor.execute(f"DROP TABLE {schema_editor.quote_name(DRF_TABLE)}")
    schema_editor.execute("DELETE FROM django_migrations WHERE app = %s", [DRF_APP])
    ContentType = apps.get_model("contenttypes", "ContentType")
    ContentType.objects.filter(app_label=DRF_APP).delete()  # with their permissions


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0004_operate_permission'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        # Deleting DRF's content types cascades to permissions and admin log entries.
        ("contenttypes", "0002_remove_content_type_name"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("admin", "0003_logentry_add_action_flag_choices"),
    ]

    operations = [
        migrations.CreateModel(
            name='ApiToken',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('prefix', models.CharField(help_text='Visible start of the token.', max_length=16)),
                ('token_hash', models.CharField(editable=False, max_length=64, unique=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ('last_used_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'verbose_name': 'management-API token',
                'ordering': ['-created_at'],
                'indexes': [models.Index(fields=['user', 'created_at'], name='tenants_api_user_id_86707a_idx')],
            },
        ),
        migrations.RunPython(replace_drf_tokens, migrations.RunPython.noop),
    ]
