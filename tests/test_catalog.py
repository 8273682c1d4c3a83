"""The catalog: declared models from the configuration file, the rules every entry obeys, and the nudge to placement."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError

from catalog import config
from catalog.models import Model, Profile

from .services import free_port
from .support.processes import BASE_DIR, process_env

VALID = """
models:
  - name: small
    aliases: [tiny]
    source: http://127.0.0.1:8001/small/q4/small.gguf
    context_length: 4096
    scaling: {min: 1, max: 3}
    profiles:
      - name: cpu
        engine: llamacpp
        args: ["--ctx-size", 8192]
        min_memory_gb: 3
        node_selector: {size: large}
  - name: big
    source: http://127.0.0.1:8001/big/bf16/
    context_length: 16384
    profiles:
      - engine: vllm
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    return path


def entry(**changes) -> dict:
    base = {"name": "m", "source": "http://127.0.0.1:8001/m/v1/", "context_length": 4096}
    return {**base, **changes}


@pytest.mark.django_db
def test_a_valid_file_declares_its_models_with_their_profiles(tmp_path):
    report = config.load(write(tmp_path, VALID))
    assert sorted(report.added) == ["big", "small"]
    small = Model.objects.get(name="small")
    assert small.declared and small.added_by == "configuration"
    assert (small.aliases, small.scaling_min, small.scaling_max, small.routing_profile) == (["tiny"], 1, 3, "chat")
    cpu = small.profiles.get()
    assert (cpu.name, cpu.engine, cpu.args, cpu.min_memory_gb) == ("cpu", "llamacpp", ["--ctx-size", "8192"], 3)
    assert cpu.node_selector == {"size": "large"}
    gpu = Model.objects.get(name="big").profiles.get()
    assert (gpu.name, gpu.engine, gpu.gpus) == ("vllm", "vllm", 1)


@pytest.mark.django_db
def test_loading_again_makes_the_catalog_match_the_file(tmp_path):
    config.load(write(tmp_path, VALID))
    Model.objects.create(name="mine", source="http://127.0.0.1:8001/mine/v1/", context_length=1, added_by="ann")
    changed = VALID.replace("context_length: 4096", "context_length: 2048").split("  - name: big")[0]
    report = config.load(write(tmp_path, changed))
    assert (report.updated, report.removed) == (["small"], ["big"])
    assert Model.objects.get(name="small").context_length == 2048
    assert Profile.objects.filter(model__name="small").count() == 1
    # A model added here is not the file's to remove.
    assert sorted(Model.objects.values_list("name", flat=True)) == ["mine", "small"]


@pytest.mark.parametrize(
    "models, sentence",
    [
        ([entry(name="")], "models[0]: name: a model's name cannot be empty"),
        ([entry(name="has space")], "models[0]: name: a model's name 'has space' may hold only"),
        ([entry(context_length="lots")], "model m: context_length must be a whole number of at least 1"),
        ([entry(source="ftp://x/m/")], "model m: source: the source must be an http:// or https:// address"),
        ([entry(scaling={"min": 3, "max": 1})], "model m: scaling: the most replicas (1) cannot be fewer"),
        ([entry(profiles=[])], "model m: profiles must list at least one profile"),
        ([entry(profiles=[{"engine": "ollama"}])], "model m: profiles[0]: engine must be llamacpp or vllm"),
        ([entry(profiles=[{"engine": "vllm", "args": "--x"}])], "model m: profiles[0]: args: engine arguments"),
        ([entry(profiles=[{"engine": "vllm", "gpus": -1}])], "model m: profiles[0]: gpus must be a whole number"),
        ([entry(profiles=[{"engine": "vllm", "node_selector": ["a"]}])], "profiles[0]: node_selector: a node selector"),
        ([entry(contxt_length=1, profiles=[{"engine": "vllm"}])], "model m: contxt_length is not a field of a model"),
        (
            [entry(profiles=[{"engine": "vllm"}]), entry(name="n", aliases=["m"], profiles=[{"engine": "vllm"}])],
            "model n: m is already a name or alias of m in this file",
        ),
    ],
)
@pytest.mark.django_db
def test_an_invalid_file_says_which_entry_and_field_and_writes_nothing(tmp_path, models, sentence):
    import yaml

    for item in models:
        item.setdefault("profiles", [{"engine": "llamacpp"}])
    path = write(tmp_path, yaml.safe_dump({"models": models}))
    with pytest.raises(config.CatalogFileError) as caught:
        config.load(path)
    assert sentence in str(caught.value)
    assert Model.objects.count() == 0


@pytest.mark.django_db
def test_yaml_that_does_not_parse_names_the_line(tmp_path):
    with pytest.raises(config.CatalogFileError, match=r"is not valid YAML at line 3"):
        config.load(write(tmp_path, "models:\n  - name: a\n    source: [unclosed\n"))


@pytest.mark.django_db
def test_a_file_cannot_take_an_alias_from_a_model_added_here(tmp_path):
    Model.objects.create(name="mine", aliases=["tiny"], source="http://127.0.0.1:8001/m/v/", context_length=1)
    with pytest.raises(
        config.CatalogFileError, match="model small: aliases: the alias tiny is already a name or alias of mine"
    ):
        config.load(write(tmp_path, VALID))
    assert not Model.objects.filter(declared=True).exists()


@pytest.mark.django_db
def test_catalog_load_reports_what_it_did(tmp_path, capsys):
    call_command("catalog_load", str(write(tmp_path, VALID)))
    assert "2 added, 0 updated, 0 removed" in capsys.readouterr().out
    with pytest.raises(CommandError, match="models\\[0\\]: name"):
        call_command("catalog_load", str(write(tmp_path, "models:\n  - source: http://x/\n")))


def test_an_invalid_catalog_file_fails_the_command_with_a_sentence_not_a_traceback(tmp_path):
    path = write(
        tmp_path,
        "models:\n  - name: m\n    source: http://x/m/\n    context_length: -4\n    profiles: [{engine: vllm}]\n",
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "catalog_load", str(path)],
        cwd=BASE_DIR,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "model m: context_length must be a whole number of at least 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_system_check_reports_an_invalid_catalog_file(tmp_path, settings):
    settings.CATALOG_FILE = write(tmp_path, "models: {}\n")
    errors = [e for e in run_checks() if e.id == "catalog.E001"]
    assert len(errors) == 1
    assert "must be a mapping with a list under models:" in errors[0].msg


@pytest.mark.django_db
def test_the_example_catalog_in_the_repository_loads():
    report = config.load(BASE_DIR / "catalog.example.yaml")
    assert report.added == ["qwen2.5-0.5b-instruct", "llama-3.1-8b-instruct"]


@pytest.mark.django_db
def test_migrating_loads_the_declared_models(tmp_path, settings):
    settings.CATALOG_FILE = write(tmp_path, VALID)
    call_command("migrate", verbosity=0)
    assert set(Model.objects.filter(declared=True).values_list("name", flat=True)) == {"small", "big"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "fields, field, sentence",
    [
        ({"name": "a"}, "name", "a model called a is already in the catalog"),
        ({"name": "x", "aliases": ["b-alias"]}, "aliases", "the alias b-alias is already a name or alias of b"),
        ({"name": "b-alias"}, "name", "b-alias is already an alias of b"),
        ({"name": "x", "aliases": ["x"]}, "aliases", "x is the model's own name, not an alias"),
        (
            {"name": "x", "source": "http://elsewhere/x/"},
            "source",
            "the source must be an address on the byte listener",
        ),
    ],
)
def test_a_name_or_alias_means_one_model_and_the_source_is_on_the_byte_listener(fields, field, sentence):
    Model.objects.create(name="a", source=settings.BYTES_URL + "a/v/", context_length=1)
    Model.objects.create(name="b", aliases=["b-alias"], source=settings.BYTES_URL + "b/v/", context_length=1)
    candidate = Model(**{"source": settings.BYTES_URL + "x/v/", "context_length": 1, **fields})
    with pytest.raises(ValidationError) as caught:
        candidate.full_clean()
    assert sentence in caught.value.message_dict[field][0]


@pytest.fixture
def control_queue():
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete("control")
    yield lambda: [json.loads(m)["headers"]["task"] for m in client.lrange("control", 0, -1)]
    client.delete("control")


@pytest.mark.django_db(transaction=True)
def test_a_catalog_write_queues_one_reconcile_after_it_commits(control_queue, tmp_path):
    model = Model.objects.create(name="a", source=settings.BYTES_URL + "a/v/", context_length=1)
    assert control_queue() == ["fleet.reconcile"]
    config.load(write(tmp_path, VALID))  # four rows in one transaction: one nudge
    assert control_queue() == ["fleet.reconcile"] * 2
    model.delete()
    assert control_queue() == ["fleet.reconcile"] * 3


@pytest.mark.django_db(transaction=True)
def test_a_write_that_rolls_back_queues_nothing(control_queue, tmp_path):
    with pytest.raises(config.CatalogFileError):
        config.load(write(tmp_path, VALID + "  - name: small\n    source: http://x/\n    context_length: 1\n"))
    assert control_queue() == []


@pytest.mark.django_db(transaction=True)
def test_a_broker_that_is_down_does_not_break_a_save(tmp_path):
    code = (
        "from catalog.models import Model; "
        "Model.objects.create(name='saved', source='http://127.0.0.1:8001/s/v/', context_length=1); "
        "print('saved')"
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=BASE_DIR,
        env=process_env(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "saved" in done.stdout
    assert "fleet.reconcile could not be queued" in done.stderr
    assert Model.objects.filter(name="saved").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("alias", ["meta-llama/Llama-3.1-8B-Instruct", "gpt-4o", "qwen2.5:7b"])
def test_an_alias_may_be_written_the_way_other_servers_clients_ask(alias):
    Model(name="m", aliases=[alias], source=settings.BYTES_URL + "m/v/", context_length=1).full_clean()


@pytest.mark.django_db
@pytest.mark.parametrize("alias", ["a b", "a,b", "/root", "a//b", "a/../b", "a/", ""])
def test_an_alias_nobody_could_ask_for_is_refused(alias):
    with pytest.raises(ValidationError) as caught:
        Model(name="m", aliases=[alias], source=settings.BYTES_URL + "m/v/", context_length=1).full_clean()
    assert "may hold only letters, digits" in caught.value.message_dict["aliases"][0]


@pytest.mark.django_db
def test_a_name_may_not_hold_a_slash():
    with pytest.raises(ValidationError) as caught:
        Model(name="meta-llama/x", source=settings.BYTES_URL + "m/v/", context_length=1).full_clean()
    assert "may hold only letters, digits" in caught.value.message_dict["name"][0]


@pytest.mark.django_db
def test_a_declared_model_has_the_kind_its_file_says_and_chat_when_it_says_none(tmp_path):
    config.load(write(tmp_path, VALID.replace("  - name: big\n", "  - name: big\n    kind: embedding\n")))
    assert Model.objects.get(name="big").kind == "embedding"
    assert Model.objects.get(name="small").kind == "chat"
    with pytest.raises(config.CatalogFileError, match="model small: kind must be one of chat, embedding, rerank"):
        config.load(write(tmp_path, VALID.replace("    aliases: [tiny]\n", "    aliases: [tiny]\n    kind: vision\n")))
