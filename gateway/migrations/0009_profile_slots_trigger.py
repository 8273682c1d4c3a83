"""The profile's change triggers watch its slots too: prefix routing's bound counts them (issue 39).

A profile's `parallel` (its engine's slots) is now part of each upstream in the gateway's table
(gateway/prefix.py bounds a replica by its slots), so a change of it must reach every gateway as a
change of its weight does. Made again after the latest catalog migration: on SQLite a table Django
remakes loses its triggers (see 0006).
"""

from importlib import import_module

from django.db import migrations

BUDGETS = import_module("gateway.migrations.0008_team_budget_triggers")
TABLE = "catalog_profile"
BEFORE = ["model_id", "name", "weight"]
COLUMNS = [*BEFORE, "parallel"]


def statements(vendor: str, columns: list[str]):
    if vendor == "sqlite":
        changed = " OR ".join(f'OLD."{c}" IS NOT NEW."{c}"' for c in columns)
        for when, which, condition in (
            ("insert", "NEW", ""),
            ("update", "NEW", f" WHEN {changed}"),
            ("delete", "OLD", ""),
        ):
            yield f"DROP TRIGGER IF EXISTS gateway_mark_profile_{when}"
            yield (
                f"CREATE TRIGGER gateway_mark_profile_{when} AFTER {when.upper()} ON {TABLE}{condition} BEGIN "
                f"INSERT INTO gateway_tablechange (\"table\", row_id, at) VALUES ('profile', {which}.id, "
                f"{BUDGETS.SQLITE_NOW}); END"
            )
        return
    changed = " OR ".join(f'OLD."{c}" IS DISTINCT FROM NEW."{c}"' for c in columns)
    yield f"DROP TRIGGER IF EXISTS gateway_mark_profile ON {TABLE}"
    yield f"DROP TRIGGER IF EXISTS gateway_mark_profile_update ON {TABLE}"
    yield (
        f"CREATE TRIGGER gateway_mark_profile AFTER INSERT OR DELETE ON {TABLE} "
        "FOR EACH ROW EXECUTE FUNCTION gateway_mark_change('profile')"
    )
    yield (
        f"CREATE TRIGGER gateway_mark_profile_update AFTER UPDATE ON {TABLE} FOR EACH ROW WHEN ({changed}) "
        "EXECUTE FUNCTION gateway_mark_change('profile')"
    )


def watch(columns: list[str]):
    def run(apps, schema_editor):
        for statement in statements(schema_editor.connection.vendor, columns):
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0008_team_budget_triggers"),
        ("catalog", "0008_profile_nodes"),
    ]

    operations = [migrations.RunPython(watch(COLUMNS), watch(BEFORE))]
