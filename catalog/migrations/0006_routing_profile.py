"""The routing profile has two values: chat (by prefix, bounded by load) and load.

It was free text that only ever said "chat"; any other value already meant "by load
alone" in the issue that gave it a meaning, so an existing row with another value is
written as "load" and routes as it was meant to.
"""

from django.db import migrations, models


def other_values_route_by_load(apps, schema_editor):
    Model = apps.get_model("catalog", "Model")
    Model.objects.exclude(routing_profile__in=["chat", "load"]).update(routing_profile="load")


class Migration(migrations.Migration):
    dependencies = [("catalog", "0005_profile_parallel_slots")]

    operations = [
        migrations.RunPython(other_values_route_by_load, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="model",
            name="routing_profile",
            field=models.CharField(
                choices=[
                    ("chat", "chat: by the conversation's prefix, bounded by load"),
                    ("load", "load: the fewest requests in flight"),
                ],
                default="chat",
                help_text="chat sends a conversation's every turn to the replica that has its start cached, unless that replica is busier than its share; load sends each request to the replica with the fewest in flight. Embedding and rerank models are routed by load either way.",
                max_length=50,
                verbose_name="routing",
            ),
        ),
    ]
