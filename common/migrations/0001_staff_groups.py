"""The two staff groups of docs/roles.md: "llmgw viewers" read everything of llmgw, "llmgw operators" do everything.

Permissions are made after `migrate` (post_migrate), so on a fresh database they are made
here first, for the apps the groups cover. A model added later gives its permissions to
the groups in a migration of its own; tests/test_staff_roles.py fails until it does.
"""

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions
from django.db import migrations

VIEWERS = "llmgw viewers"
OPERATORS = "llmgw operators"
LLMGW_APPS = ("mirror", "catalog", "fleet", "gateway")


def make_groups(apps, schema_editor=None) -> None:
    for label in LLMGW_APPS:
        create_permissions(global_apps.get_app_config(label), apps=apps, verbosity=0)
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    ours = Permission.objects.filter(content_type__app_label__in=LLMGW_APPS)
    viewers, _ = Group.objects.get_or_create(name=VIEWERS)
    viewers.permissions.add(*ours.filter(codename__startswith="view_"))
    operators, _ = Group.objects.get_or_create(name=OPERATORS)
    operators.permissions.add(*ours)


def remove_groups(apps, schema_editor=None) -> None:
    apps.get_model("auth", "Group").objects.filter(name__in=[VIEWERS, OPERATORS]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("mirror", "0006_permissions_to_scan_and_pull"),
        ("catalog", "0006_routing_profile"),
        ("fleet", "0009_permission_to_issue_node_tokens"),
        ("gateway", "0005_permission_to_rotate_api_keys"),
    ]

    operations = [migrations.RunPython(make_groups, remove_groups)]
