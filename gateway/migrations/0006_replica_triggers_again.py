"""The replica table's change triggers (0002), made again after every fleet migration.

On SQLite, Django changes a table by making it anew (`_remake_table`), and a table
made anew has none of the triggers of the old one. Once migrations of other apps
(accounts, common) changed the order in which the graph runs, fleet's migrations that
remake `fleet_replica` ran after 0002 had put its triggers there: `make run` then never
told its gateway of a replica that became ready (tests/test_up.py). Dropped if present
and made again here, after the latest fleet migration, on both databases.
"""

from importlib import import_module

from django.db import migrations

TABLE_CHANGES = import_module("gateway.migrations.0002_table_changes")


def replica_triggers_again(apps, schema_editor):
    table, columns = TABLE_CHANGES.WATCHED["replica"]
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        for when in ("insert", "update", "delete"):
            schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_replica_{when}")
        statements = TABLE_CHANGES.sqlite_statements()
    else:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_replica ON {table}")
        schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_replica_update ON {table}")
        statements = TABLE_CHANGES.postgresql_statements()
    for statement in statements:
        if f" ON {table} " in statement:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0005_permission_to_rotate_api_keys"),
        ("fleet", "0009_permission_to_issue_node_tokens"),
        ("catalog", "0006_routing_profile"),
    ]

    operations = [migrations.RunPython(replica_triggers_again, migrations.RunPython.noop)]
