from django.db import migrations, models

from contracts import credentials


def fill_replica_keys(apps, schema_editor):
    # Enrolled nodes keep their tokens: their replica keys are made from the hashes already stored.
    Node = apps.get_model("fleet", "Node")
    for node in Node.objects.exclude(token_hash="").only("pk", "token_hash"):
        Node.objects.filter(pk=node.pk).update(replica_key=credentials.replica_key(node.token_hash))


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0007_node_address"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="replica_key",
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
        migrations.RunPython(fill_replica_keys, migrations.RunPython.noop),
    ]
