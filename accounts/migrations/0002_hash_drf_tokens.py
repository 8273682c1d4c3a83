"""DRF's plaintext tokens (rest_framework.authtoken, no longer installed) become hashed ones, and their table goes.

Automation that holds one keeps working until LLMGW_API_TOKEN_DAYS after this migration.
"""

import hashlib
from datetime import timedelta

from django.conf import settings
from django.db import migrations
from django.utils import timezone

DRF_TABLE = "authtoken_token"


def hash_drf_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if DRF_TABLE not in connection.introspection.table_names():
        return  # a database made after rest_framework.authtoken left: nothing in plain to move
    ApiToken = apps.get_model("accounts", "ApiToken")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT key, user_id, created FROM {DRF_TABLE}")
        rows = cursor.fetchall()
    expires = timezone.now() + timedelta(days=settings.API_TOKEN_DAYS)
    ApiToken.objects.bulk_create(
        ApiToken(
            user_id=user_id,
            key_hash=hashlib.sha256(key.encode()).hexdigest(),
            prefix=key[:8],
            created=created,
            expires=expires,
        )
        for key, user_id, created in rows
    )
    schema_editor.execute(f"DROP TABLE {DRF_TABLE}")
    # So that installing rest_framework.authtoken again would make its table again.
    schema_editor.execute("DELETE FROM django_migrations WHERE app = 'authtoken'")


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_api_token"),
    ]

    operations = [
        migrations.RunPython(hash_drf_tokens, migrations.RunPython.noop),
    ]
