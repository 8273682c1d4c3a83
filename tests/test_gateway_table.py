"""The gateway's table reads only what changed: the change log the triggers write, and the reader that follows it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from catalog.models import Model, Profile
from fleet.models import Replica
from gateway import routes
from gateway.keys import create_key, hash_key
from gateway.models import ApiKey, TableChange

from .support.factories import add_model, add_replica

pytestmark = pytest.mark.django_db


def same_as_a_whole_read(table: routes.Table) -> None:
    whole = routes.load()
    assert table.keys == whole.keys
    assert table.routes == whole.routes
    assert table.models == whole.models


def test_a_key_made_turned_off_or_deleted_is_seen_by_the_next_read():
    reader = routes.TableReader()
    reader.read()
    key, secret = create_key("fresh")
    assert hash_key(secret) in reader.read().keys
    # How the admin's action and `api_key revoke` turn a key off: no save(), no signal.
    ApiKey.objects.filter(pk=key.pk).update(active=False)
    assert hash_key(secret) not in reader.read().keys
    ApiKey.objects.filter(pk=key.pk).update(active=True)
    assert hash_key(secret) in reader.read().keys
    ApiKey.objects.filter(pk=key.pk).delete()
    assert reader.read().keys == {}
    assert reader.full_reads == 1


def test_a_read_with_nothing_changed_reads_no_key_model_or_replica_and_keeps_the_table():
    for n in range(50):
        create_key(f"k{n}")
    add_model()
    add_replica()
    reader = routes.TableReader()
    first = reader.read()
    TableChange.objects.all().delete()  # as if the marks of the setup were long past
    with CaptureQueriesContext(connection) as queries:
        again = reader.read()
    assert again is first
    read = " ".join(q["sql"] for q in queries)
    for table in ("gateway_apikey", "catalog_model", "catalog_profile", "fleet_replica"):
        assert table not in read, read
    assert len(queries) == 2, read  # the database's clock, and the change log


def test_a_replica_profile_or_model_change_is_routed_by_the_next_read():
    model = add_model(profiles=(("cpu", 1), ("gpu", 3)))
    reader = routes.TableReader()
    assert reader.read().routes["chat"].upstreams == ()
    replica = add_replica(state="starting", endpoint="")
    assert reader.read().routes["chat"].upstreams == ()
    Replica.objects.filter(pk=replica.pk).update(state="ready", endpoint="http://127.0.0.1:9/v1/")
    upstreams = reader.read().routes["chat"].upstreams
    assert [(u.replica_id, u.base, u.weight) for u in upstreams] == [(replica.pk, "http://127.0.0.1:9/v1", 1)]
    Profile.objects.filter(model=model, name="cpu").update(weight=5)
    assert reader.read().routes["chat"].upstreams[0].weight == 5
    Model.objects.filter(pk=model.pk).update(aliases=["assistant"])
    assert reader.read().routes["assistant"].name == "chat"
    same_as_a_whole_read(reader.table)
    replica.delete()
    assert reader.read().routes["chat"].upstreams == ()
    model.delete()
    assert reader.read().routes == {}
    same_as_a_whole_read(reader.table)
    assert reader.full_reads == 1


def test_writing_a_column_the_gateway_does_not_route_by_leaves_no_mark():
    replica = add_replica()
    key, _ = create_key("used")
    before = TableChange.objects.count()
    Replica.objects.filter(pk=replica.pk).update(reason="still fine", attempts=0)
    replica.save()  # every column written, none changed
    ApiKey.objects.filter(pk=key.pk).update(last_used=replica.since)
    assert TableChange.objects.count() == before
    Replica.objects.filter(pk=replica.pk).update(state="stopping")
    assert TableChange.objects.count() == before + 1


def test_a_reader_that_has_not_looked_for_minutes_reads_everything_again():
    reader = routes.TableReader()
    reader.read()
    reader.since -= routes.KEEP_CHANGES
    _, secret = create_key("while away")
    assert hash_key(secret) in reader.read().keys
    assert reader.full_reads == 2


def test_old_marks_are_deleted():
    create_key("old")
    TableChange.objects.update(at=routes.database_now() - routes.KEEP_CHANGES - timedelta(seconds=1))
    routes.TableReader().read()
    assert not TableChange.objects.exists()


def test_a_replica_routes_with_its_profiles_slots_and_a_change_of_slots_reaches_the_next_read():
    add_model()
    add_replica()
    reader = routes.TableReader()
    assert [u.slots for u in reader.read().routes["chat"].upstreams] == [1]
    Profile.objects.filter(name="cpu").update(parallel=4)
    assert [u.slots for u in reader.read().routes["chat"].upstreams] == [4]
    same_as_a_whole_read(reader.table)
