# Fetch records are the control plane's: the model arrives from the agent app, whose
# migration 0002 renamed the table to fleet_fetch; here the state alone is created.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0002_replica"),
        ("agent", "0002_fetch_moves_to_fleet"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="Fetch",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
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
            ],
        ),
    ]
