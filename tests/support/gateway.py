"""A client of the /v1/ gateway as the tests drive it."""

from __future__ import annotations

import time

import requests

from .waiting import wait_until


def client(key: str) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    return session


def until_routed(session, url, model="chat"):
    """The gateway re-reads its table every 100 ms here; wait for the model to be routed."""

    def ready():
        models = session.get(url + "/v1/models").json().get("data", [])
        return any(m["id"] == model and m["ready"] for m in models)

    wait_until(ready, timeout=10, what=f"{model} to be routed")


def held_stream(url: str, secret: str) -> requests.Response:
    """A streamed chat the fake replica holds open after its first chunk, until released."""
    return requests.post(
        url + "/v1/chat/completions",
        json={"model": "chat", "messages": [], "stream": True, "hold": True},
        headers={"Authorization": f"Bearer {secret}"},
        stream=True,
        timeout=30,
    )


def chat(session, url, **body):
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], **body}
    return session.post(url + "/v1/chat/completions", json=body, timeout=30)


def error_of(response) -> dict:
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def clear_of_minute_boundary(needed_s: float = 20) -> None:
    """Fixed windows: a burst that straddles a new minute is counted in two. Start it early in a minute.

    Polls the wall clock until at least `needed_s` seconds of its minute remain: at once
    when they do, else just past the next minute's start.
    """
    wait_until(
        lambda: time.time() % 60 <= 60 - needed_s,
        61,
        interval=0.05,
        what=f"a minute with {needed_s} s left",
    )
