"""Staff roles (docs/roles.md): a view-only staff member reads everything and changes nothing; operators act.

Every admin page and action (from the admin's registry) and every address of the admin port
(from the URLconf) is walked, so a new page, action or endpoint is covered by itself: it is
either read like the rest, or refused like the rest, or this module fails naming it.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from dataclasses import dataclass

import pytest
from auditlog.models import LogEntry
from django.apps import apps as django_apps
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from django.utils.regex_helper import normalize
from django.views.generic import RedirectView

from accounts.models import Team, TeamMember
from catalog.models import Model, Profile
from common.permissions import OPERATORS, VIEWERS, is_llmgw
from contracts import signing
from fleet import enrolment
from fleet.models import Fetch, MeasuredMemory, Node, Replica, Scale
from gateway.keys import create_key
from gateway.models import ApiKey, Usage
from mirror.models import MirrorFile, MirrorPull, MirrorVersion

from .support.roles import groups

pytestmark = pytest.mark.django_db

PASSWORD = "a long staff password"
# Addresses every signed-in staff member uses for their own session, whatever their groups.
EVERY_STAFF = {
    "admin:login",
    "admin:logout",
    "admin:password_change",
    "admin:password_change_done",
    "admin:jsi18n",
    "admin:index",
    "admin:app_list",
    "admin:view_on_site",
    "admin:autocomplete",
    "admin:one-time-secrets",
    "",  # / → /admin/
}
# What a read needs besides its address, by the address's name.
# /me/, /api/people/ and /playground/: for everyone signed in, staff or not, each seeing the rows
# people/access.py gives them and using models through their own key; tests/test_me_page.py,
# tests/test_people_api.py and tests/test_playground.py attack those, not this walk of staff roles.
EVERY_SIGNED_IN = ("people:", "people-", "playground:")
# Open to anyone on purpose: what a load balancer and Prometheus ask (tests/test_health.py), naming no row.
OPEN = {"healthz"}
QUERIES = {
    "api-progress": "?source=http://127.0.0.1:8001/tiny/v1/",
    "fleet:progress": "?source=http://127.0.0.1:8001/tiny/v1/",
    "serve-plan": "?model=tiny&version=v1",
}
ADMIN_VIEWS = ("changelist", "add", "change", "delete", "history")
WRITES = ("post", "put", "patch", "delete")


# --- people and rows ---------------------------------------------------------------------


def _person(username: str, group: str | None) -> Client:
    user = get_user_model().objects.create_user(username, password=PASSWORD, is_staff=True)
    if group:
        user.groups.add(Group.objects.get(name=group))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def people(db) -> dict[str, Client]:
    """A viewer, an operator, a staff member of no group and a superuser, each signed in."""
    groups()
    boss = get_user_model().objects.create_superuser("boss", "", PASSWORD)
    superuser = Client()
    superuser.force_login(boss)
    return {
        "viewer": _person("vera", VIEWERS),
        "operator": _person("otto", OPERATORS),
        "nobody": _person("nora", None),
        "superuser": superuser,
    }


@dataclass
class Rows:
    by_model: dict
    secrets: list[str]


@pytest.fixture
def rows(people, settings, tmp_path) -> Rows:
    """One row of every model the admin shows, and the secrets among them, which no viewer may ever read."""
    settings.MIRROR_ROOT = tmp_path / "mirror"
    settings.MIRROR_ROOT.mkdir()
    version = MirrorVersion.objects.create(model="tiny", version="v1", scanned_at=timezone.now())
    MirrorFile.objects.create(version=version, name="tiny.gguf", bytes=10, mtime_ns=1, sha256="a" * 64)
    pull_pass = signing.token_hash("the other site's token")
    pull = MirrorPull.objects.create(url="https://other:8001/big/v2/", model="big", version="v2", pass_key=pull_pass)
    model = Model.objects.create(name="tiny", source="http://127.0.0.1:8001/tiny/v1/", context_length=512)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp")
    node_token = enrolment.issue_token("n1")
    node = Node.objects.get(name="n1")
    node.last_heartbeat = timezone.now()
    node.save()
    replica = Replica.objects.create(model_name="tiny", profile_name="cpu", node=node, state="ready")
    scale = Scale.objects.create(model_name="tiny", replicas=1)
    fetch = Fetch.objects.create(node=node, source="http://127.0.0.1:8001/tiny/v1/", state="done")
    measured = MeasuredMemory.objects.create(
        model_name="tiny", profile_name="cpu", bench={"levels": [], "suggested_target_load": 3}
    )
    key, key_secret = create_key("team-a")
    usage = Usage.objects.create(key=key, model_name="tiny", day=timezone.now().date(), requests=1)
    User = get_user_model()
    team = Team.objects.create(name="blue")
    member = TeamMember.objects.create(team=team, user=User.objects.create_user("bea", password=PASSWORD))
    return Rows(
        by_model={
            MirrorVersion: version,
            MirrorPull: pull,
            Model: model,
            Node: node,
            Replica: replica,
            Scale: scale,
            Fetch: fetch,
            MeasuredMemory: measured,
            ApiKey: key,
            Usage: usage,
            Team: team,
            TeamMember: member,
            LogEntry: LogEntry.objects.get_for_object(node).last(),
            Group: Group.objects.get(name=VIEWERS),
            User: User.objects.get(username="vera"),
        },
        secrets=[node_token, node.token_hash, key_secret, key.key_hash, pull_pass],
    )


def _pk(rows: Rows, model: type):
    """The sample row's key; a model outside llmgw's apps without one is refused before its row is looked up."""
    if model in rows.by_model:
        return rows.by_model[model].pk
    assert not is_llmgw(model), f"add a sample row of {model.__name__} to the rows fixture"
    return 0


def database_state() -> dict:
    """Every row of every table but the sessions' and the login throttle's, to tell that nothing changed."""
    state = {}
    for model in django_apps.get_models():
        if model._meta.app_label in ("sessions", "axes"):
            continue
        values = model.objects.order_by("pk").values_list()
        state[model._meta.label] = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in values]
    return state


# --- what there is to walk -----------------------------------------------------------------


@dataclass
class Address:
    name: str
    url: str
    api: bool


def _patterns(resolver: URLResolver, pieces: tuple = (), namespace: str = ""):
    for entry in resolver.url_patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            yield from _patterns(entry, (*pieces, entry.pattern), inner)
        elif isinstance(entry, URLPattern):
            yield entry, f"{namespace}{entry.name or ''}", (*pieces, entry.pattern)


def _admin_model_prefixes() -> dict[str, type]:
    return {f"admin:{m._meta.app_label}_{m._meta.model_name}_": m for m in admin.site._registry}


def _sample(entry: URLPattern, name: str, part: str, rows: Rows, model_of_name: type | None):
    """A value for one part of an address: a row of the model its view serves, or the mirror version's names."""
    view_class = getattr(entry.callback, "cls", None)
    queryset = getattr(view_class, "queryset", None)
    if queryset is not None:
        return getattr(rows.by_model[queryset.model], getattr(view_class, "lookup_field", "pk"))
    if model_of_name is not None and model_of_name in rows.by_model:
        return rows.by_model[model_of_name].pk
    if part in ("model", "version"):
        return getattr(rows.by_model[MirrorVersion], part)
    if name == "admin:mirror_pull_detail" and part == "pk":
        return rows.by_model[MirrorPull].pk
    raise AssertionError(f"{name} has a part {part!r} this test has no sample for: add one")


def addresses(rows: Rows, llmgw: bool = True) -> list[Address]:
    """Every address of the admin port but the admin's own pages of each model (walked from the registry).

    llmgw=False: the admin's other addresses of models outside llmgw's apps (a user's password page).
    """
    prefixes = _admin_model_prefixes()
    out, seen = [], set()
    for entry, name, pieces in _patterns(get_resolver()):
        if entry.callback.__name__ == "catch_all_view" or name in EVERY_STAFF or name.endswith(":autocomplete"):
            continue
        if name.startswith(EVERY_SIGNED_IN) or name in OPEN:
            continue
        if entry.name is None and getattr(entry.callback, "view_class", None) is RedirectView:
            continue  # the admin's old address of a row, which only redirects to its page
        model = next((m for prefix, m in prefixes.items() if name.startswith(prefix)), None)
        if (
            model is not None
            and name.removeprefix(f"admin:{model._meta.app_label}_{model._meta.model_name}_") in ADMIN_VIEWS
        ):
            continue  # walked from the registry
        if llmgw != (model is None or is_llmgw(model)):
            continue
        assert name, f"the address {''.join(map(str, pieces))} has no name: name it so it can be walked"
        url = "/"
        groups = set()
        for piece in pieces:
            groups |= set(piece.regex.groupindex)
        if "format" in groups:
            continue  # DRF's `.json` twin of an address walked already: the same view and permissions
        for piece in pieces:
            template, params = normalize(piece.regex.pattern)[0]
            url += template % {p: _sample(entry, name, p, rows, model) for p in params}
        if url not in seen:
            seen.add(url)
            out.append(Address(name, url, api=url.startswith("/api/")))
    return out


def _send(client: Client, method: str, address: Address):
    if method == "get":
        return client.get(address.url + QUERIES.get(address.name, ""))
    if address.api and method != "get":
        return getattr(client, method)(address.url, data=json.dumps({}), content_type="application/json")
    if method in ("put", "patch", "delete"):
        return getattr(client, method)(address.url, data="", content_type="application/x-www-form-urlencoded")
    return getattr(client, method)(address.url, data={})


def _in_savepoint(call, *args):
    """What a request answers, its writes undone: an operator's walk leaves the rows for the next request."""
    with transaction.atomic():
        response = call(*args)
        transaction.set_rollback(True)
    return response


def _text(response) -> str:
    return b"".join(response.streaming_content).decode() if response.streaming else response.content.decode()


# --- the walk --------------------------------------------------------------------------------


def test_the_walk_finds_the_custom_pages_actions_and_endpoints_that_can_write_or_mint(rows):
    """The walk is not empty by accident: it reaches the doors issue 34 names."""
    urls = {a.url for a in addresses(rows)}
    assert {"/serve/tiny/v1/", "/admin/mirror/mirrorversion/pull/", "/admin/mirror/mirrorversion/scan/"} <= urls
    assert {"/api/gateway/keys/", "/api/serve/", "/api/fleet/nodes/", "/api/catalog/models/"} <= urls
    assert "make_token" in admin.site._registry[Node].actions
    assert "make_new_secret" in admin.site._registry[ApiKey].actions


def test_every_admin_action_names_the_permission_it_needs():
    """An action without `permissions=` is offered to anyone who may open the list, a viewer too."""
    for model, model_admin in admin.site._registry.items():
        for function, name, _ in model_admin._get_base_actions():
            assert getattr(function, "allowed_permissions", None), (
                f"{model.__name__}'s action {name} names no permission"
            )


def test_a_viewer_is_shown_the_pull_page_and_a_version_without_the_buttons_to_pull_and_serve(people, rows):
    pull = "/admin/mirror/mirrorversion/pull/"
    version = reverse("admin:mirror_mirrorversion_change", args=[rows.by_model[MirrorVersion].pk])
    for role, shown in (("viewer", False), ("operator", True)):
        assert ('id="pull-submit"' in _text(people[role].get(pull))) is shown, role
        page = _text(people[role].get(version))
        assert ('id="serve-button"' in page) is shown and "tiny" in page, role


def test_a_viewer_reads_every_page_and_endpoint_and_sees_no_secret(people, rows):
    viewer, boss = people["viewer"], people["superuser"]
    seen = []
    for model in admin.site._registry:
        if not is_llmgw(model):
            continue
        info = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        pk = _pk(rows, model)
        for url in (
            reverse(f"{info}_changelist"),
            reverse(f"{info}_change", args=[pk]),
            reverse(f"{info}_history", args=[pk]),
        ):
            response = viewer.get(url)
            assert response.status_code == 200, f"a viewer could not read {url}: {response.status_code}"
            assert boss.get(url).status_code == 200
            seen.append((url, _text(response)))
    for address in addresses(rows):
        response = _send(viewer, "get", address)
        if response.status_code == 405:  # an address only to write to: there is nothing there to read, for anyone
            assert boss.get(address.url).status_code == 405
            continue
        assert response.status_code in (200, 302), f"a viewer could not read {address.url}: {response.status_code}"
        seen.append((address.url, _text(response)))
    response = viewer.get("/admin/")
    assert response.status_code == 200 and 'id="overview-nodes"' in _text(response)
    seen.append(("/admin/", _text(response)))
    for url, text in seen:
        for secret in rows.secrets:
            assert secret not in text, f"{url} shows a viewer a secret"


def test_a_viewer_is_refused_every_write_action_and_secret_and_nothing_changes(people, rows, broker):
    viewer = people["viewer"]
    before = database_state()
    refusals = 0
    for model, model_admin in admin.site._registry.items():
        info = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        pk = _pk(rows, model)
        for url in (reverse(f"{info}_add"), reverse(f"{info}_delete", args=[pk])):
            assert viewer.get(url).status_code == 403, f"a viewer may open {url}"
        for url, data in (
            (reverse(f"{info}_add"), {}),
            (reverse(f"{info}_change", args=[pk]), {}),
            (reverse(f"{info}_delete", args=[pk]), {"post": "yes"}),
        ):
            assert viewer.post(url, data).status_code == 403, f"a viewer may write through {url}"
            refusals += 1
        changelist = reverse(f"{info}_changelist")
        offered = viewer.get(changelist).context
        if is_llmgw(model):
            action_form = offered.get("action_form") if offered else None
            assert action_form is None, f"a viewer is offered {model.__name__}'s actions"
        for action in [*(model_admin.actions or ()), "delete_selected"]:
            name = action if isinstance(action, str) else action.__name__
            response = viewer.post(changelist, {"action": name, "_selected_action": [pk], "index": 0, "post": "yes"})
            # Offered no action, the admin shows the list again (200); refused the list, 403.
            assert response.status_code in (200, 302, 403), f"{model.__name__}'s {name}: {response.status_code}"
            assert database_state() == before, f"a viewer's {name} on {model.__name__} changed the database"
            refusals += 1
    for address in addresses(rows):
        for method in WRITES:
            response = _send(viewer, method, address)
            assert response.status_code in (403, 405), (
                f"a viewer's {method.upper()} {address.url}: {response.status_code}"
            )
            if response.status_code == 403:
                assert "needs the permission" in _text(response), f"{address.url} refuses without saying why"
            refusals += 1
    assert database_state() == before
    # Nothing was handed over: no secret waits on the one-time page, no task was sent.
    assert "<code" not in _text(viewer.get("/admin/secrets/"))
    assert broker.keys("*") == []
    assert refusals > 100


def test_an_operator_may_do_what_a_superuser_may_in_llmgw_and_nothing_with_accounts(people, rows, broker):
    operator, boss = people["operator"], people["superuser"]
    for model in admin.site._registry:
        info = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        pk = _pk(rows, model)
        urls = [reverse(f"{info}_{v}") for v in ("changelist", "add")]
        # A history page looks its row up before it asks: only of a row that is there.
        urls += [reverse(f"{info}_{v}", args=[pk]) for v in ("change", "delete", "history")[: 3 if pk else 2]]
        for url in urls:
            mine, theirs = operator.get(url).status_code, boss.get(url).status_code
            if is_llmgw(model):
                assert mine == theirs, f"{url}: an operator gets {mine}, a superuser {theirs}"
            else:
                assert mine == 403, f"an operator may open {url}"
        if is_llmgw(model):
            changelist = reverse(f"{info}_changelist")
            choices = [_actions_offered(r) for r in (operator.get(changelist), boss.get(changelist))]
            assert choices[0] == choices[1], (
                f"{model.__name__}: an operator is offered {choices[0]}, a superuser {choices[1]}"
            )
    for address in addresses(rows):
        assert _send(operator, "get", address).status_code in (200, 302, 405), address.url
        for method in WRITES:
            response = _in_savepoint(_send, operator, method, address)
            assert response.status_code != 403, (
                f"an operator is refused {method.upper()} {address.url}: {_text(response)}"
            )


def test_only_a_superuser_opens_the_accounts_pages(people, rows):
    """Users, groups and API tokens are not llmgw's models: neither group reaches them."""
    accounts = addresses(rows, llmgw=False)
    assert "admin:auth_user_password_change" in {a.name for a in accounts}
    for role in ("viewer", "operator", "nobody"):
        for address in accounts:
            for method in ("get", "post"):
                assert _send(people[role], method, address).status_code == 403, f"{role} {method} {address.url}"
    for address in accounts:
        assert people["superuser"].get(address.url).status_code == 200


def _actions_offered(changelist) -> dict:
    form = changelist.context["action_form"]
    return {} if form is None else dict(form.fields["action"].choices)


def test_a_staff_member_of_no_group_can_do_nothing(people, rows):
    nobody = people["nobody"]
    before = database_state()
    for model in admin.site._registry:
        info = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        pk = _pk(rows, model)
        for url in (reverse(f"{info}_changelist"), reverse(f"{info}_change", args=[pk])):
            assert nobody.get(url).status_code == 403, url
    for address in addresses(rows):
        for method in ("get", *WRITES):
            response = _send(nobody, method, address)
            assert response.status_code in (401, 403, 405), f"{method.upper()} {address.url}: {response.status_code}"
    front = _text(nobody.get("/admin/"))
    assert 'id="overview-nodes"' not in front and "tiny" not in front
    assert database_state() == before


# --- the attacks of issue 34, one at a time ------------------------------------------------


def test_a_viewer_cannot_mint_a_nodes_token_rotate_a_key_make_a_key_or_serve_a_model(people, rows):
    viewer = people["viewer"]
    node, key = rows.by_model[Node], rows.by_model[ApiKey]
    viewer.post(
        reverse("admin:fleet_node_changelist"), {"action": "make_token", "_selected_action": [node.pk], "index": 0}
    )
    viewer.post(
        reverse("admin:gateway_apikey_changelist"),
        {"action": "make_new_secret", "_selected_action": [key.pk], "index": 0},
    )
    made = viewer.post("/api/gateway/keys/", {"name": "mine"}, content_type="application/json")
    served = viewer.post(
        "/api/serve/", {"model": "tiny", "version": "v1", "name": "mine"}, content_type="application/json"
    )
    page = viewer.post("/serve/tiny/v1/", {"name": "mine"})
    assert (made.status_code, served.status_code, page.status_code) == (403, 403, 403)
    assert "gateway.add_apikey" in made.json()["detail"] and "catalog.add_model" in page.content.decode()
    node.refresh_from_db()
    key.refresh_from_db()
    assert node.token_hash == rows.secrets[1] and key.key_hash == rows.secrets[3]
    assert not ApiKey.objects.filter(name="mine").exists() and not Model.objects.filter(name="mine").exists()


def test_a_viewer_reads_every_team_and_member_through_the_api_and_cannot_add_or_remove_one(people, rows):
    """Teams are llmgw's: a viewer in no team sees them all (as the admin shows them) and changes none; an operator does."""
    viewer, operator = people["viewer"], people["operator"]
    team, member = rows.by_model[Team], rows.by_model[TeamMember]
    teams = viewer.get("/api/people/teams/")
    members = viewer.get("/api/people/members/")
    assert [t["name"] for t in teams.json()["results"]] == ["blue"]
    assert [m["username"] for m in members.json()["results"]] == ["bea"]
    assert viewer.get(f"/api/people/members/{member.pk}/").json()["team"] == team.pk
    before = database_state()
    added = viewer.post("/api/people/members/", {"team": team.pk, "who": "vera"}, content_type="application/json")
    removed = viewer.delete(f"/api/people/members/{member.pk}/")
    assert (added.status_code, removed.status_code) == (404, 404), (added.content, removed.content)
    assert database_state() == before
    added = operator.post("/api/people/members/", {"team": team.pk, "who": "vera"}, content_type="application/json")
    assert added.status_code == 201, added.content
    assert operator.delete(f"/api/people/members/{member.pk}/").status_code == 204
    assert list(team.members.values_list("user__username", flat=True)) == ["vera"]


def test_staff_pick_a_keys_team_by_searching_for_it(people, rows):
    """The key's team field searches teams (autocomplete), which needs the team's view permission both groups hold."""
    search = "/admin/autocomplete/?app_label=gateway&model_name=apikey&field_name=team&term=blu"
    page = _text(people["operator"].get(reverse("admin:gateway_apikey_add")))
    assert re.search(r'<select [^>]*class="admin-autocomplete"[^>]*data-field-name="team"', page), "no team search"
    for role in ("viewer", "operator"):
        found = people[role].get(search)
        assert found.status_code == 200, f"{role}: {found.status_code}"
        assert [r["text"] for r in found.json()["results"]] == ["blue"], role
    assert people["nobody"].get(search).status_code == 403


def _readable(cookie_value: str) -> str:
    """A cookie as anyone holding it reads it: the value, and a signed payload decoded (signed is not sealed)."""
    texts = [cookie_value]
    payload = cookie_value.split(":")[0]
    try:
        raw = base64.urlsafe_b64decode(payload.lstrip(".") + "=" * (-len(payload.lstrip(".")) % 4))
        texts.append((zlib.decompress(raw) if payload.startswith(".") else raw).decode(errors="replace"))
    except (ValueError, zlib.error):
        pass
    return "\n".join(texts)


def _chain(client: Client, method: str, url: str, data: dict) -> list:
    """The responses of a request and the redirects it leads to, as a browser follows them."""
    responses = [getattr(client, method)(url, data)]
    while responses[-1].status_code in (301, 302) and len(responses) < 5:
        responses.append(client.get(responses[-1]["Location"]))
    return responses


def _secret_shown_once(client: Client, responses: list, pattern: str) -> str:
    page = _text(responses[-1])
    found = re.findall(pattern, page)
    assert len(found) == 1, f"the page shows {len(found)} secrets: {page[:2000]}"
    secret = found[0]
    cookies = "\n".join(_readable(m.value) for r in responses for m in r.cookies.values())
    assert secret not in cookies
    assert responses[-1]["Cache-Control"].startswith("max-age=0") or "no-store" in responses[-1]["Cache-Control"]
    again = _text(client.get("/admin/secrets/"))
    assert secret not in again and "Nothing to show" in again
    return secret


def test_a_node_token_made_in_the_admin_is_shown_once_on_its_own_page_and_never_in_a_cookie(people, rows):
    operator = people["operator"]
    node = rows.by_model[Node]
    responses = _chain(
        operator,
        "post",
        reverse("admin:fleet_node_changelist"),
        {"action": "make_token", "_selected_action": [node.pk], "index": 0},
    )
    token = _secret_shown_once(operator, responses, r"llmgw-node-[\w-]+")
    node.refresh_from_db()
    assert node.token_hash == signing.token_hash(token)
    # A node added in the admin gets its token the same way.
    responses = _chain(operator, "post", reverse("admin:fleet_node_add"), {"name": "n2", "labels": "{}"})
    token = _secret_shown_once(operator, responses, r"llmgw-node-[\w-]+")
    assert Node.objects.get(name="n2").token_hash == signing.token_hash(token)


def test_an_api_key_made_or_rotated_in_the_admin_is_shown_once_on_its_own_page_and_never_in_a_cookie(people, rows):
    from gateway.keys import hash_key

    operator = people["operator"]
    responses = _chain(
        operator,
        "post",
        reverse("admin:gateway_apikey_add"),
        {"name": "team-b", "model_names": "[]", "active": "on", **_inline_management("usage")},
    )
    secret = _secret_shown_once(operator, responses, r"llmgw-(?!node-)[\w-]{20,}")
    assert ApiKey.objects.get(name="team-b").key_hash == hash_key(secret)
    key = rows.by_model[ApiKey]
    responses = _chain(
        operator,
        "post",
        reverse("admin:gateway_apikey_changelist"),
        {"action": "make_new_secret", "_selected_action": [key.pk], "index": 0},
    )
    secret = _secret_shown_once(operator, responses, r"llmgw-(?!node-)[\w-]{20,}")
    key.refresh_from_db()
    assert key.key_hash == hash_key(secret)


def _inline_management(prefix: str) -> dict:
    return {
        f"{prefix}-TOTAL_FORMS": "0",
        f"{prefix}-INITIAL_FORMS": "0",
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "0",
    }


def test_messages_are_kept_in_the_session_not_in_a_cookie(people, rows):
    operator = people["operator"]
    key = rows.by_model[ApiKey]
    responses = _chain(
        operator,
        "post",
        reverse("admin:gateway_apikey_changelist"),
        {"action": "turn_off", "_selected_action": [key.pk], "index": 0},
    )
    assert "turned off" in _text(responses[-1])
    assert all("messages" not in r.cookies for r in responses)


def test_the_staff_login_locks_after_too_many_failures_even_for_the_right_password(people, settings):
    browser = Client()
    for attempt in range(1, settings.LOGIN_FAILURES + 1):
        refused = browser.post("/admin/login/?next=/admin/", {"username": "vera", "password": "a guess"})
        if attempt < settings.LOGIN_FAILURES:
            assert refused.status_code == 200 and "correct username and password" in refused.content.decode()
    # The last failure locks; from then on the right password is refused too, with a sentence.
    assert refused.status_code == 429
    locked = browser.post("/admin/login/?next=/admin/", {"username": "vera", "password": PASSWORD})
    assert locked.status_code == 429 and "Too many failed logins" in locked.content.decode()
    assert browser.get("/admin/").status_code == 302  # not signed in
    # Another staff member, from the same address, still signs in: the lock is the username's there.
    other = Client()
    signed_in = other.post("/admin/login/?next=/admin/", {"username": "otto", "password": PASSWORD})
    assert signed_in.status_code == 302 and other.get("/admin/").status_code == 200


def test_the_swagger_page_loads_nothing_from_another_host(people):
    page = people["viewer"].get("/api/docs/")
    assert page.status_code == 200
    html = _text(page)
    hosts = re.findall(r"""(?:https?:)?//([\w.-]+)""", html)
    assert hosts == [], f"the Swagger page names other hosts: {hosts}"
    scripts = re.findall(r"""src=["']([^"']+)["']""", html)
    assert scripts and all(s.startswith("/static/") for s in scripts), scripts
    for script in scripts:
        served = people["viewer"].get(script)
        assert served.status_code == 200, script
    assert people["nobody"].get("/api/docs/").status_code == 403
