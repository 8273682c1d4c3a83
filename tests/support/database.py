"""The test database held open for a whole module, for tests whose state carries from one test to the next."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def db_access(django_db_setup, django_db_blocker):
    """The test database, open for the whole module: the fleet's state carries from one test to the next.

    Not pytest-django's `transactional_db`, which empties the tables after each test;
    and pytest-django makes the test database only when a test it sees asks for one.
    """
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        made = None
        if "fleet_node" not in connection.introspection.table_names():
            made = setup_databases(verbosity=0, interactive=False)
        yield
        call_command("flush", interactive=False, verbosity=0)
        if made is not None:
            teardown_databases(made, verbosity=0)
