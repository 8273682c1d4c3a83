"""Both staff groups read the audit log (docs/audit.md); neither writes it: no group gets add, change or delete."""

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions
from django.db import migrations

GROUPS = ("llmgw viewers", "llmgw operators")


def let_groups_read(apps, schema_editor=None) -> None:
    create_permissions(global_apps.get_app_config("auditlog"), apps=apps, verbosity=0)
    Permission = apps.get_model("auth", "Permission")
    view = Permission.objects.get(content_type__app_label="auditlog", codename="view_logentry")
    for group in apps.get_model("auth", "Group").objects.filter(name__in=GROUPS):
        group.permissions.add(view)


def unlet(apps, schema_editor=None) -> None:
    Permission = apps.get_model("auth", "Permission")
    for group in apps.get_model("auth", "Group").objects.filter(name__in=GROUPS):
        group.permissions.remove(*Permission.objects.filter(content_type__app_label="auditlog"))


class Migration(migrations.Migration):
    dependencies = [
        ("common", "0001_staff_groups"),
        ("auditlog", "0017_add_actor_email"),
    ]

    operations = [migrations.RunPython(let_groups_read, unlet)]
