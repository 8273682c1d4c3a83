"""Teams and their members are llmgw's (common.permissions.LLMGW_MODELS): viewers read them, operators change them.

The rest of accounts (API tokens, provider accounts) stays a superuser's: only these two models' permissions are given.
"""

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions
from django.db import migrations

VIEWERS = "llmgw viewers"
OPERATORS = "llmgw operators"
MODELS = ("team", "teammember")


def give_team_permissions(apps, schema_editor=None) -> None:
    create_permissions(global_apps.get_app_config("accounts"), apps=apps, verbosity=0)
    Group = apps.get_model("auth", "Group")
    ours = apps.get_model("auth", "Permission").objects.filter(
        content_type__app_label="accounts", content_type__model__in=MODELS
    )
    for group in Group.objects.filter(name=VIEWERS):
        group.permissions.add(*ours.filter(codename__startswith="view_"))
    for group in Group.objects.filter(name=OPERATORS):
        group.permissions.add(*ours)


def take_them_back(apps, schema_editor=None) -> None:
    ours = apps.get_model("auth", "Permission").objects.filter(
        content_type__app_label="accounts", content_type__model__in=MODELS
    )
    for group in apps.get_model("auth", "Group").objects.filter(name__in=[VIEWERS, OPERATORS]):
        group.permissions.remove(*ours)


class Migration(migrations.Migration):
    dependencies = [
        ("common", "0002_audit_log_readers"),
        ("accounts", "0003_teams"),
    ]

    operations = [migrations.RunPython(give_team_permissions, take_them_back)]
