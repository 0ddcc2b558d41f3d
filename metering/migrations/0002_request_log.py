"""``request_log``: a PostgreSQL table partitioned by UTC day (no partitions yet; the
pipeline creates each day's before it writes to it)."""

from django.db import migrations, models

CREATE = """
CREATE TABLE request_log (
    request_id varchar(64) NOT NULL,
    started_at timestamptz NOT NULL,
    tenant_id uuid NOT NULL,
    api_key_id uuid NOT NULL,
    model varchar(100) NOT NULL,
    model_version_id bigint NOT NULL,
    replica_id varchar(100) NOT NULL,
    prompt_tokens bigint NOT NULL,
    cached_tokens bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    ttft_ms double precision NULL,
    tpot_ms double precision NULL,
    finish_reason varchar(16) NOT NULL,
    status smallint NOT NULL,
    is_retry boolean NOT NULL,
    ingested_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (request_id, started_at),
    CONSTRAINT request_log_counts_non_negative
        CHECK (prompt_tokens >= 0 AND cached_tokens >= 0 AND completion_tokens >= 0),
    CONSTRAINT request_log_cached_within_prompt CHECK (cached_tokens <= prompt_tokens)
) PARTITION BY RANGE (started_at);
CREATE INDEX request_log_tenant_started ON request_log (tenant_id, started_at);
"""


def create(apps, schema_editor):  # noqa: ANN001, ARG001 - migration signature
    if schema_editor.connection.vendor != "postgresql":
        raise RuntimeError("metering needs PostgreSQL (partitioned request_log)")
    schema_editor.execute(CREATE)


def drop(apps, schema_editor):  # noqa: ANN001, ARG001
    schema_editor.execute("DROP TABLE IF EXISTS request_log")


class Migration(migrations.Migration):
    dependencies = [("metering", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create, drop)],
            state_operations=[
                migrations.CreateModel(
                    name="RequestLog",
                    fields=[
                        (
                            "pk",
                            models.CompositePrimaryKey(
                                "request_id",
                                "started_at",
                                blank=True,
                                editable=False,
                                primary_key=True,
                                serialize=False,
                            ),
                        ),
                        ("request_id", models.CharField(max_length=64)),
                        ("started_at", models.DateTimeField()),
                        ("tenant_id", models.UUIDField()),
                        ("api_key_id", models.UUIDField()),
                        ("model", models.CharField(max_length=100)),
                        ("model_version_id", models.BigIntegerField()),
                        ("replica_id", models.CharField(max_length=100)),
                        ("prompt_tokens", models.BigIntegerField()),
                        ("cached_tokens", models.BigIntegerField()),
                        ("completion_tokens", models.BigIntegerField()),
                        ("ttft_ms", models.FloatField(null=True)),
                        ("tpot_ms", models.FloatField(null=True)),
                        ("finish_reason", models.CharField(max_length=16)),
                        ("status", models.SmallIntegerField()),
                        ("is_retry", models.BooleanField()),
                        ("ingested_at", models.DateTimeField()),
                    ],
                    options={
                        "db_table": "request_log",
                        "managed": False,
                        "ordering": ["started_at"],
                    },
                ),
            ],
        ),
    ]
