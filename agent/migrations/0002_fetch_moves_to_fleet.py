# Fetch records are the control plane's: the model moves to the fleet app, and its
# table is renamed rather than copied, so every record stays as it was.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("agent", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.AlterModelTable(name="fetch", table="fleet_fetch")],
            state_operations=[migrations.DeleteModel(name="Fetch")],
        ),
    ]
