# Fetch records are the control plane's. They began in the agent app (its migrations
# 0001, which made the table agent_fetch, and 0002, which renamed it fleet_fetch and gave
# the model to this app); the agent app is no longer installed on the control plane, so
# this migration stands on its own and does in one step what those did:
# - a new database: the table fleet_fetch is created;
# - a database that had the agent app's 0001 alone: its agent_fetch is renamed, rows kept;
# - a database that had both and this migration: nothing runs again (it is recorded).

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class CreateOrAdoptFetch(migrations.CreateModel):
    """CreateModel, unless the agent app's 0001 made the table already: then it is renamed into place."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if "agent_fetch" in schema_editor.connection.introspection.table_names():
            model = to_state.apps.get_model(app_label, self.name)
            schema_editor.alter_db_table(model, "agent_fetch", model._meta.db_table)
        else:
            super().database_forwards(app_label, schema_editor, from_state, to_state)


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0002_replica"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        CreateOrAdoptFetch(
            name="Fetch",
            fields=[
                (
                    "id",
                    models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID"),
                ),
                (
                    "source",
                    models.CharField(
                        help_text="A mirror address: a version ends in /, a single file does not.",
                        max_length=1000,
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("requested", "requested"),
                            ("complete", "complete"),
                            ("failed", "failed"),
                            ("cancelled", "cancelled"),
                        ],
                        default="requested",
                        max_length=20,
                    ),
                ),
                ("requested_at", models.DateTimeField(blank=True, null=True)),
                ("task_id", models.CharField(blank=True, max_length=64)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("path", models.CharField(blank=True, help_text="Where the node keeps it.", max_length=1000)),
                ("bytes_total", models.BigIntegerField(default=0)),
                ("files_total", models.PositiveIntegerField(default=0)),
                ("seconds", models.FloatField(default=0)),
                ("error", models.TextField(blank=True)),
                (
                    "node",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="fetches", to="fleet.node"
                    ),
                ),
                (
                    "requested_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["node__name", "source"],
                "verbose_name_plural": "fetches",
                "constraints": [models.UniqueConstraint(fields=("node", "source"), name="agent_fetch_unique")],
            },
        ),
    ]
