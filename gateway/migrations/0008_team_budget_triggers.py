"""The change log watching what a team's key depends on: its team's budgets and models, the team's members,
its owner's state, and the key's own team, owner and expiry; and a model's prices (and its routing profile).

A person removed from a team, or whose account is turned off, loses the keys they own at once: the
gateway must hear of it as it hears of a key turned off. A team's row and its members' rows mark the
team ("team", by the team's id), a user's row marks its keys ("owner", by the user's id), and the key's
triggers are made again with its new columns. Made on SQLite after the latest migrations of the tables
watched: a table Django remakes (`_remake_table`) loses its triggers (see 0006).
"""

from importlib import import_module

from django.db import migrations

TABLE_CHANGES = import_module("gateway.migrations.0002_table_changes")
SQLITE_NOW = TABLE_CHANGES.SQLITE_NOW

# name in the log -> (table, the column that names the row marked, the columns the gateway reads)
WATCHED = {
    "key": (
        "gateway_apikey",
        "id",
        ["name", "key_hash", "model_names", "active", "requests_per_minute", "tokens_per_minute", "tokens_per_day"]
        + ["tokens_per_month", "max_in_flight", "team_id", "owner_id", "expires"],
    ),
    "team": (
        "accounts_team",
        "id",
        ["name", "model_names", "requests_per_minute", "tokens_per_minute", "tokens_per_day", "tokens_per_month"]
        + ["spend_per_month"],
    ),
    # Its prices: a request's cost counts against its team's spend.
    "model": (
        "catalog_model",
        "id",
        ["name", "aliases", "context_length", "max_output", "added_at", "kind", "routing_profile"]
        + ["price_input", "price_cached_input", "price_output"],
    ),
    "member": ("accounts_teammember", "team_id", ["team_id", "user_id"]),
    "owner": ("auth_user", "id", ["is_active"]),
}
# What each trigger marks its row as: a member's row marks its team.
LOGGED_AS = {"key": "key", "team": "team", "model": "model", "member": "team", "owner": "owner"}


def sqlite_statements():
    for name, (table, row, columns) in WATCHED.items():
        logged = LOGGED_AS[name]
        changed = " OR ".join(f'OLD."{c}" IS NOT NEW."{c}"' for c in columns)
        for when, which, condition in (
            ("insert", "NEW", ""),
            ("update", "NEW", f" WHEN {changed}"),
            ("delete", "OLD", ""),
        ):
            marks = [which] if not (name == "member" and when == "update") else ["OLD", "NEW"]
            inserts = " ".join(
                f"INSERT INTO gateway_tablechange (\"table\", row_id, at) VALUES ('{logged}', {m}.{row}, {SQLITE_NOW});"
                for m in marks
            )
            yield (
                f"CREATE TRIGGER gateway_mark_{name}_{when} AFTER {when.upper()} ON {table}{condition} "
                f"BEGIN {inserts} END"
            )


def postgresql_statements():
    # Marks the row named by the column TG_ARGV[1] as TG_ARGV[0]; on an update, the old row too when they differ
    # (a member moved to another team leaves the first one).
    yield """
        CREATE OR REPLACE FUNCTION gateway_mark_by() RETURNS trigger AS $$
        DECLARE
            old_id bigint;
            new_id bigint;
        BEGIN
            IF TG_OP <> 'INSERT' THEN
                EXECUTE format('SELECT ($1).%%I', TG_ARGV[1]) INTO old_id USING OLD;
                INSERT INTO gateway_tablechange ("table", row_id, at) VALUES (TG_ARGV[0], old_id, clock_timestamp());
            END IF;
            IF TG_OP <> 'DELETE' THEN
                EXECUTE format('SELECT ($1).%%I', TG_ARGV[1]) INTO new_id USING NEW;
                IF old_id IS DISTINCT FROM new_id THEN
                    INSERT INTO gateway_tablechange ("table", row_id, at)
                        VALUES (TG_ARGV[0], new_id, clock_timestamp());
                END IF;
                RETURN NEW;
            END IF;
            RETURN OLD;
        END
        $$ LANGUAGE plpgsql
    """
    for name, (table, row, columns) in WATCHED.items():
        logged = LOGGED_AS[name]
        changed = " OR ".join(f'OLD."{c}" IS DISTINCT FROM NEW."{c}"' for c in columns)
        yield (
            f"CREATE TRIGGER gateway_mark_{name} AFTER INSERT OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION gateway_mark_by('{logged}', '{row}')"
        )
        yield (
            f"CREATE TRIGGER gateway_mark_{name}_update AFTER UPDATE ON {table} FOR EACH ROW WHEN ({changed}) "
            f"EXECUTE FUNCTION gateway_mark_by('{logged}', '{row}')"
        )


def drop(vendor, schema_editor, names):
    for name in names:
        table = WATCHED[name][0]
        if vendor == "sqlite":
            for when in ("insert", "update", "delete"):
                schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name}_{when}")
        else:
            schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name} ON {table}")
            schema_editor.execute(f"DROP TRIGGER IF EXISTS gateway_mark_{name}_update ON {table}")


def create_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    drop(vendor, schema_editor, WATCHED)
    statements = sqlite_statements() if vendor == "sqlite" else postgresql_statements()
    for statement in statements:
        schema_editor.execute(statement)


def drop_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    drop(vendor, schema_editor, ["team", "member", "owner", "key", "model"])
    # The key's and the model's triggers as 0002 and 0003 left them.
    tables = {TABLE_CHANGES.WATCHED[name][0] for name in ("key", "model")}
    for statement in TABLE_CHANGES.sqlite_statements() if vendor == "sqlite" else TABLE_CHANGES.postgresql_statements():
        if any(f" ON {table} " in statement for table in tables) or "CREATE OR REPLACE FUNCTION" in statement:
            schema_editor.execute(statement)
    import_module("gateway.migrations.0003_key_limits").update_triggers(
        import_module("gateway.migrations.0003_key_limits").WATCHED
    )(apps, schema_editor)
    if vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS gateway_mark_by()")


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0007_keys_of_teams_and_people"),
        ("accounts", "0003_teams"),
        ("catalog", "0007_prices"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(create_triggers, drop_triggers)]
