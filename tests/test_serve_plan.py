"""plan_serve and build_model: the seed's rules and sentences, as pure functions.

No django_db mark here: pytest-django refuses any database access in these tests,
so they also show that neither function touches the database.
"""

import pytest

from serving.planning import (
    CatalogFacts,
    FileFacts,
    NodeFacts,
    ServeError,
    build_model,
    memory_for,
    plan_serve,
    slot_warning,
)

BASE = "http://mirror:8001/"
GB = 10**9
GIB = 1 << 30


def plan(files, fleet=None, catalog=None, model="m", version="v1"):
    return plan_serve(model, version, [FileFacts(n, b) for n, b in files], BASE, fleet, catalog)


@pytest.mark.parametrize(
    "name, engine",
    [
        ("model.gguf", "llamacpp"),
        ("MODEL.GGUF", "llamacpp"),
        ("model.Q4_K_M.gguf", "llamacpp"),
        ("model.safetensors", "vllm"),
        ("model.SafeTensors", "vllm"),
        ("pytorch_model.bin", "vllm"),
    ],
)
def test_the_engine_is_chosen_by_extension_whatever_its_case(name, engine):
    assert plan([(name, 100)]).engine == engine


def test_a_single_file_is_served_as_that_file():
    p = plan([("model.gguf", 100)])
    assert p.source == "http://mirror:8001/m/v1/model.gguf"
    assert p.files == 0
    assert p.refusal == ""


def test_a_kind_of_file_nothing_reads_is_refused_with_its_extension():
    p = plan([("notes.txt", 100)])
    assert p.refusal == "nothing here reads .txt files"
    assert p.engine == ""


def test_a_set_of_files_nothing_reads_is_refused():
    p = plan([("a.txt", 1), ("b.txt", 2), ("c.txt", 3)])
    assert p.refusal == "nothing here reads .txt files"


def test_an_empty_version_is_refused():
    assert "no files" in plan([]).refusal


def test_a_version_of_several_files_is_served_as_the_version():
    p = plan([("m-00001-of-00003.gguf", GB), ("m-00002-of-00003.gguf", GB), ("m-00003-of-00003.gguf", GB)])
    assert p.source == "http://mirror:8001/m/v1/"
    assert p.files == 3
    assert p.bytes_total == 3 * GB
    assert p.engine == "llamacpp"


def test_a_set_takes_its_engine_from_whichever_file_says():
    p = plan([("config.json", 10), ("model-1.safetensors", GB), ("tokenizer.json", 10)])
    assert p.engine == "vllm"
    assert p.profile == "gpu"
    assert p.refusal == ""


def test_a_set_sums_the_bytes_of_every_file_for_the_memory_estimate():
    p = plan([("a.gguf", 2 * GIB), ("b.gguf", 2 * GIB)])
    assert p.bytes_total == 4 * GIB
    assert p.min_memory_gb == 8  # 4 GiB × 1.5 + 2


def test_llamacpp_runs_on_the_cpu_profile_and_vllm_on_the_gpu_profile():
    assert plan([("x.gguf", 1)]).profile == "cpu"
    assert plan([("x.safetensors", 1)]).profile == "gpu"


@pytest.mark.parametrize(
    "size, expected",
    [(0, 0), (1, 2), (GIB, 3), (2 * GIB, 5), (int(4.7 * GB), 8), (10 * GIB, 17)],
)
def test_min_memory_is_gib_times_one_and_a_half_plus_two(size, expected):
    assert memory_for(size) == expected


def test_the_seeds_case_a_4_7_gb_gguf_asks_for_8_gb_and_a_7_gb_fleet_is_warned():
    fleet = [NodeFacts(("llamacpp",), 0, 7), NodeFacts(("llamacpp",), 0, 4)]
    p = plan([("model.gguf", int(4.7 * GB))], fleet)
    assert p.min_memory_gb == 8
    # Two nodes together hold it (issue 37): the offer says so, with the estimate per node.
    assert p.warning == (
        "the largest node has 7 GB and this needs about 8; one replica across 2 nodes needs about 4 GB on each "
        "(the profile's nodes, split by each node's free memory)"
    )
    assert (p.nodes, p.per_node_gb) == (2, 4)
    assert p.refusal == ""


def test_a_fleet_with_room_is_not_warned():
    p = plan([("model.gguf", int(4.7 * GB))], [NodeFacts(("llamacpp",), 0, 16)])
    assert p.warning == ""


def test_a_fleet_whose_nodes_report_no_memory_is_not_warned_about_size():
    p = plan([("model.gguf", 100 * GB)], [NodeFacts(("llamacpp",), 0, 0)])
    assert p.warning == ""


def test_no_node_with_the_engine_is_a_warning_not_a_refusal():
    p = plan([("model.gguf", 1)], [NodeFacts(("vllm",), 1, 64)])
    assert p.warning == "no node reports having llamacpp installed, and .gguf weights need it"
    assert p.refusal == ""


def test_no_vllm_and_no_gpu_points_to_a_gguf_build():
    p = plan([("model.safetensors", 1)], [NodeFacts(("llamacpp",), 0, 64)])
    assert p.warning == (
        "no node reports having vllm installed, and .safetensors weights need it. "
        "This fleet has no GPU either; a GGUF build of the same model runs on the CPU nodes"
    )


def test_no_vllm_but_a_gpu_does_not_give_the_gguf_hint():
    p = plan([("model.safetensors", 1)], [NodeFacts(("llamacpp",), 2, 64)])
    assert p.warning == "no node reports having vllm installed, and .safetensors weights need it"


def test_a_fleet_that_reports_no_engines_at_all_is_not_warned():
    p = plan([("model.safetensors", 1)], [NodeFacts((), 0, 64), NodeFacts((), 0, 32)])
    assert p.warning == ""


def test_one_node_reporting_the_engine_is_enough():
    p = plan([("model.gguf", 1)], [NodeFacts((), 0, 64), NodeFacts(("vllm",), 0, 8), NodeFacts(("llamacpp",), 0, 8)])
    assert p.warning == ""


def test_the_size_warning_is_joined_to_the_engine_warning_with_and():
    p = plan([("model.safetensors", 20 * GIB)], [NodeFacts(("llamacpp",), 0, 16)])
    assert p.warning == (
        "no node reports having vllm installed, and .safetensors weights need it. "
        "This fleet has no GPU either; a GGUF build of the same model runs on the CPU nodes, "
        "and the largest node has 16 GB and this needs about 32"
    )


def test_a_model_declared_in_configuration_is_refused_with_the_seeds_sentence():
    p = plan([("model.gguf", 1)], catalog=CatalogFacts(declared={"m"}, taken={"m"}))
    assert p.refusal == "a model called m is declared in configuration; edit it there rather than adding a second"
    assert p.already


def test_a_model_added_here_already_is_noted_but_not_refused():
    p = plan([("model.gguf", 1)], catalog=CatalogFacts(declared=set(), taken={"m"}))
    assert p.already
    assert p.refusal == ""


def test_names_with_spaces_are_quoted_in_the_source():
    p = plan([("my model.gguf", 1)], model="a b")
    assert p.source == "http://mirror:8001/a%20b/v1/my%20model.gguf"


FORM = {
    "name": "m",
    "source": "http://mirror:8001/m/v1/",
    "context_length": "4096",
    "replicas": "2",
    "engine": "llamacpp",
}


def built(**changes):
    return build_model({**FORM, **changes}, BASE)


def refused(**changes) -> ServeError:
    with pytest.raises(ServeError) as caught:
        built(**changes)
    return caught.value


def test_a_complete_form_builds_the_entry_and_its_profile():
    model, profile = built(
        description=" A model ",
        aliases="a, b ,,c",
        max_output="512",
        profile="cpu",
        ctx_size="16384",
        min_memory_gb="8",
        selector_key="size",
        selector_value="large",
    )
    assert (model.name, model.description, model.source) == ("m", "A model", "http://mirror:8001/m/v1/")
    assert model.aliases == ["a", "b", "c"]
    assert (model.context_length, model.max_output, model.routing_profile) == (4096, 512, "chat")
    assert (model.scaling_min, model.scaling_max) == (2, 2)
    assert (profile.name, profile.engine, profile.weight, profile.priority) == ("cpu", "llamacpp", 1, 100)
    assert profile.args == ["--ctx-size", "16384"]
    assert profile.min_memory_gb == 8
    assert profile.node_selector == {"size": "large"}


def test_the_profile_is_named_for_the_engine_when_left_blank():
    _, profile = built(profile=" ")
    assert profile.name == "llamacpp"


@pytest.mark.parametrize("field", ["name", "source"])
def test_a_model_needs_a_name_and_a_source(field):
    error = refused(**{field: "  "})
    assert error.sentence == "a model needs a name and a source"
    assert error.field == field


@pytest.mark.parametrize(
    "field, value, sentence",
    [
        ("context_length", "", "the context length must be a whole number"),
        ("context_length", "4k", "the context length must be a whole number"),
        ("max_output", "-1", "the output limit must be a whole number"),
        ("replicas", "two", "the replica count must be a whole number"),
        ("replicas", "1.5", "the replica count must be a whole number"),
        ("replicas", "١", "the replica count must be a whole number"),
        ("ctx_size", "lots", "the engine's context pool must be a whole number"),
        ("min_memory_gb", "8GB", "the memory requirement must be a whole number"),
    ],
)
def test_a_number_that_is_not_a_whole_number_is_refused_beside_its_field(field, value, sentence):
    error = refused(**{field: value})
    assert error.sentence == sentence
    assert error.field == field


def test_which_engine_should_run_it():
    error = refused(engine="")
    assert (error.field, error.sentence) == ("engine", "which engine should run it?")


def test_an_unknown_engine_is_refused():
    assert refused(engine="ollama").field == "engine"


def test_a_source_off_the_byte_listener_is_refused():
    for source in [
        "http://evil.example/m/v1/",
        "https://mirror:8001/m/v1/",
        "http://mirror:8002/m/v1/",
        "http://mirror:8001/",
        "http://mirror:8001/m/../../etc/",
        "http://mirror:8001@evil.example/m/v1/",
    ]:
        error = refused(source=source)
        assert error.field == "source", source
        assert "byte listener" in error.sentence


def test_a_selector_needs_both_its_key_and_its_value():
    assert refused(selector_key="size").field == "selector_key"


def test_the_context_pool_is_a_llamacpp_setting():
    assert refused(engine="vllm", ctx_size="8192").field == "ctx_size"
    _, profile = built(engine="vllm")
    assert profile.gpus == 1
    assert profile.args == []


# --- parallel slots and the pool they share ---------------------------------------


def test_a_gguf_is_offered_with_four_slots_and_a_safetensors_model_with_none():
    assert plan_serve("m", "v1", [FileFacts("m.gguf", 10)], BASE, [], CatalogFacts()).parallel == 4
    assert plan_serve("m", "v1", [FileFacts("m.safetensors", 10)], BASE, [], CatalogFacts()).parallel == 0


def test_the_pool_left_blank_is_slots_times_the_context_length_and_the_target_load_is_the_slots():
    model, profile = built(parallel="8")
    assert profile.parallel == 8 and model.target_load == 8
    assert profile.args == ["--ctx-size", str(8 * 4096)]
    assert slot_warning(model, profile) == ""
    # What the engine is started with: the pool and the slots it is shared by.
    assert profile.engine_args() == ["--ctx-size", "32768", "--parallel", "8"]


def test_the_api_without_slots_gets_what_the_page_offers():
    model, profile = built()
    assert (profile.parallel, model.target_load, profile.args) == (4, 4, ["--ctx-size", "16384"])


def test_a_pool_that_gives_a_slot_less_than_the_context_length_is_saved_with_a_warning():
    model, profile = built(parallel="4", ctx_size="8192")
    assert slot_warning(model, profile) == (
        "the context pool of 8192 tokens gives each of the 4 slots 2048, less than the context length of 4096 "
        "a client may ask for: make the pool 16384 or the context length smaller"
    )


@pytest.mark.parametrize(
    "changes, sentence",
    [
        ({"parallel": "0"}, "a replica needs at least one slot"),
        ({"parallel": "many"}, "the number of parallel slots must be a whole number"),
        ({"engine": "vllm", "parallel": "4"}, "parallel slots are a llama.cpp setting; vLLM schedules its own"),
    ],
)
def test_slots_that_cannot_be_are_refused_beside_their_field(changes, sentence):
    problem = refused(**changes)
    assert (problem.field, problem.sentence) == ("parallel", sentence)
