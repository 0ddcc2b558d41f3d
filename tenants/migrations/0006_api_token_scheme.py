"""Management-API token digests get a domain label (``contracts.schema.hash_api_token``), so
a token's digest is never an API key's. Every row already stored holds the unlabelled digest
(the API keys' HMAC), which cannot be recomputed without the token: the new ``scheme``
column marks those rows ``UNLABELLED`` (its database default, which also covers rows that
processes of the release before write during a rolling deploy), and they keep verifying until
they expire (``tenants.selectors.api_token_for_secret``). Tokens issued from now on are
``LABELLED``. Backwards deletes the labelled tokens, which the release before could not
verify (their users obtain new ones), then the column.
"""

from django.db import migrations, models

UNLABELLED, LABELLED = 1, 2


def delete_labelled_tokens(apps, schema_editor):
    ApiToken = apps.get_model("tenants", "ApiToken")
    ApiToken.objects.filter(scheme=LABELLED).delete()


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0005_api_token'),
    ]

    operations = [
        migrations.AddField(
            model_name='apitoken',
            name='scheme',
            field=models.PositiveSmallIntegerField(choices=[(1, "unlabelled (API keys' HMAC)"), (2, 'labelled')], db_default=1, default=2, editable=False, help_text='How token_hash was computed.'),
        ),
        migrations.RunPython(migrations.RunPython.noop, delete_labelled_tokens),
    ]
