"""Per-key limits, and the change log watching them and a model's kind.

The gateway routes by a key's limits and a model's kind, so a change to either
must mark the row as 0002's triggers do for the other columns: the update
triggers of those two tables are made again with the new columns.
"""

from django.db import migrations, models

# name in the log -> (table, the columns the gateway reads from it), as of this migration
WATCHED = {
    "key": (
        "gateway_apikey",
        ["name", "key_hash", "model_names", "active", "requests_per_minute", "tokens_per_minute", "tokens_per_day"]
        + ["tokens_per_month", "max_in_flight"],
    ),
    "model": ("catalog_model", ["name", "aliases", "context_length", "max_output", "added_at", "kind"]),
}
BEFORE = {
    "key": ("gateway_apikey", ["name", "key_hash", "model_names", "active"]),
    "model": ("catalog_model", ["name", "aliases", "context_length", "max_output", "added_at"]),
}
SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"


def update_triggers(watched):
    def run(apps, schema_editor):
        vendor = schema_editor.connection.vendor
        for name, (table, columns) in watched.items():
            if vendor == "sqlite":
                changed = " OR ".join(f'OLD."{c}" IS NOT NEW."{c}"' for c in columns)
                schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name}_update")
                schema_editor.execute(
                    f"CREATE TRIGGER gateway_mark_{name}_update AFTER UPDATE ON {table} WHEN {changed} "
                    f'BEGIN INSERT INTO gateway_tablechange ("table", row_id, at) '
                    f"VALUES ('{name}', NEW.id, {SQLITE_NOW}); END"
                )
            else:
                changed = " OR ".join(f'OLD."{c}" IS DISTINCT FROM NEW."{c}"' for c in columns)
                schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name}_update ON {table}")
                schema_editor.execute(
                    f"CREATE TRIGGER gateway_mark_{name}_update AFTER UPDATE ON {table} FOR EACH ROW "
                    f"WHEN ({changed}) EXECUTE FUNCTION gateway_mark_change('{name}')"
                )

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0002_table_changes"),
        ("catalog", "0003_model_kind"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="max_in_flight",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Requests answered at once; blank for no limit.",
                null=True,
                verbose_name="requests in flight",
            ),
        ),
        migrations.AddField(
            model_name="apikey",
            name="requests_per_minute",
            field=models.PositiveIntegerField(blank=True, help_text="Blank for no limit.", null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_day",
            field=models.PositiveBigIntegerField(blank=True, help_text="Blank for no limit.", null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_minute",
            field=models.PositiveBigIntegerField(blank=True, help_text="Blank for no limit.", null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_month",
            field=models.PositiveBigIntegerField(blank=True, help_text="Blank for no limit.", null=True),
        ),
        migrations.RunPython(update_triggers(WATCHED), update_triggers(BEFORE)),
    ]
