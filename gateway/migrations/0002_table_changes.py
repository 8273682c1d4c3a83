"""The gateway's change log, and the triggers that write it.

Triggers rather than Django signals: a queryset's update() (how keys are turned
off), bulk_create (how profiles are written) and raw SQL send no signals, and a
revoked key that the gateway never hears of keeps working. An update marks a row
only when a column the gateway routes by changed, so a replica's `since` or a
key's `last_used` being written costs the gateways nothing.
"""

from django.db import migrations, models

# name in the log -> (table, the columns the gateway reads from it)
WATCHED = {
    "key": ("gateway_apikey", ["name", "key_hash", "model_names", "active"]),
    "model": ("catalog_model", ["name", "aliases", "context_length", "max_output", "added_at"]),
    "profile": ("catalog_profile", ["model_id", "name", "weight"]),
    "replica": ("fleet_replica", ["model_name", "profile_name", "state", "endpoint"]),
}

SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"


def sqlite_statements():
    for name, (table, columns) in WATCHED.items():
        mark = "INSERT INTO gateway_tablechange (\"table\", row_id, at) VALUES ('{name}', {row}.id, {now});"
        changed = " OR ".join(f'OLD."{c}" IS NOT NEW."{c}"' for c in columns)
        yield (
            f"CREATE TRIGGER gateway_mark_{name}_insert AFTER INSERT ON {table} "
            f"BEGIN {mark.format(name=name, row='NEW', now=SQLITE_NOW)} END"
        )
        yield (
            f"CREATE TRIGGER gateway_mark_{name}_update AFTER UPDATE ON {table} WHEN {changed} "
            f"BEGIN {mark.format(name=name, row='NEW', now=SQLITE_NOW)} END"
        )
        yield (
            f"CREATE TRIGGER gateway_mark_{name}_delete AFTER DELETE ON {table} "
            f"BEGIN {mark.format(name=name, row='OLD', now=SQLITE_NOW)} END"
        )


def postgresql_statements():
    # clock_timestamp(), not now(): now() is when the transaction began, and a
    # reader looking back a few seconds must find rows by when they were written.
    yield """
        CREATE OR REPLACE FUNCTION gateway_mark_change() RETURNS trigger AS $$
        BEGIN
            IF TG_OP = 'DELETE' THEN
                INSERT INTO gateway_tablechange ("table", row_id, at) VALUES (TG_ARGV[0], OLD.id, clock_timestamp());
                RETURN OLD;
            END IF;
            INSERT INTO gateway_tablechange ("table", row_id, at) VALUES (TG_ARGV[0], NEW.id, clock_timestamp());
            RETURN NEW;
        END
        $$ LANGUAGE plpgsql
    """
    for name, (table, columns) in WATCHED.items():
        changed = " OR ".join(f'OLD."{c}" IS DISTINCT FROM NEW."{c}"' for c in columns)
        yield (
            f"CREATE TRIGGER gateway_mark_{name} AFTER INSERT OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION gateway_mark_change('{name}')"
        )
        yield (
            f"CREATE TRIGGER gateway_mark_{name}_update AFTER UPDATE ON {table} FOR EACH ROW WHEN ({changed}) "
            f"EXECUTE FUNCTION gateway_mark_change('{name}')"
        )


def create_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        statements = sqlite_statements()
    elif vendor == "postgresql":
        statements = postgresql_statements()
    else:
        raise RuntimeError(f"llmgw's gateway needs SQLite or PostgreSQL, not {vendor}")
    for statement in statements:
        schema_editor.execute(statement)


def drop_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    for name, (table, _) in WATCHED.items():
        if vendor == "sqlite":
            for when in ("insert", "update", "delete"):
                schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name}_{when}")
        else:
            schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name} ON {table}")
            schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name}_update ON {table}")
    if vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS gateway_mark_change()")


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0001_initial"),
        ("catalog", "0001_initial"),
        ("fleet", "0002_replica"),
    ]

    operations = [
        migrations.CreateModel(
            name="TableChange",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("table", models.CharField(max_length=10)),
                ("row_id", models.BigIntegerField()),
                ("at", models.DateTimeField(db_index=True, help_text="The database's clock when the row changed.")),
            ],
            options={
                "ordering": ["id"],
            },
        ),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
