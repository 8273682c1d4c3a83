"""The routing profile: which models the gateway's table routes by prefix, and the migration that gave it two values."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from catalog.models import Model
from gateway import routes

from .support.factories import add_model, add_replica


@pytest.mark.django_db
def test_the_table_puts_a_chat_models_replicas_on_a_ring_and_leaves_load_and_embedding_models_to_load():
    add_model("by-prefix")
    add_model("by-load", routing="load")
    embedding = add_model("vectors")
    Model.objects.filter(pk=embedding.pk).update(kind="embedding")
    for name in ("by-prefix", "by-load", "vectors"):
        add_replica(name, "http://127.0.0.1:9/v1")
        add_replica(name, "http://127.0.0.1:10/v1")
    table = routes.load()
    ring = table.routes["by-prefix"].ring
    assert ring is not None and {u.replica_id for u in ring.members} == {
        u.replica_id for u in table.routes["by-prefix"].upstreams
    }
    assert table.routes["by-load"].ring is None and table.routes["vectors"].ring is None


@pytest.mark.django_db
def test_a_ring_is_built_again_only_for_the_model_whose_replicas_changed():
    add_model("a"), add_model("b")
    add_replica("a", "http://127.0.0.1:9/v1")
    add_replica("b", "http://127.0.0.1:10/v1")
    reader = routes.TableReader()
    first = reader.read()
    add_replica("b", "http://127.0.0.1:11/v1")
    second = reader.read()
    assert second.routes["a"].ring is first.routes["a"].ring
    assert second.routes["b"].ring is not first.routes["b"].ring and len(second.routes["b"].ring.members) == 2


@pytest.mark.django_db(transaction=True)
def test_the_migration_makes_a_routing_profile_of_another_value_load_which_is_what_it_meant():
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("catalog", "0005_profile_parallel_slots")])
        old = executor.loader.project_state([("catalog", "0005_profile_parallel_slots")]).apps
        OldModel = old.get_model("catalog", "Model")
        for name, routing in (("kept", "chat"), ("odd", "round-robin"), ("blank", "")):
            OldModel.objects.create(
                name=name, source="http://127.0.0.1:1/m/", context_length=64, routing_profile=routing
            )
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    finally:
        MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    assert dict(Model.objects.values_list("name", "routing_profile")) == {
        "kept": "chat",
        "odd": "load",
        "blank": "load",
    }
