"""The playground: a page to talk to a model, and the stream it reads, relayed from the gateway.

The browser never holds a key: it posts its prompt here, this view calls the gateway's
/v1/chat/completions over HTTP with the person's page key (playground/keys.py) and
relays the server-sent events as they come. Limits, budgets and usage apply as to any
client because the request is one. A browser that hangs up (Stop, a closed page) makes
the next write fail; the relay then closes its request to the gateway, which ends the
engine's work on it.
"""

from __future__ import annotations

import json

import requests
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpResponseBadRequest, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from . import code
from .keys import models_for, page_key

TEMPERATURE_RANGE = (0.0, 2.0)
MAX_OUTPUT_TOKENS = 4096
CONNECT_TIMEOUT_S = 5


@login_required(login_url="people:login")
def playground(request):
    key, _ = page_key(request)
    models = models_for(key)
    return render(
        request,
        "playground/index.html",
        {"key": key, "models": models, "title": "Playground", "max_output_tokens": MAX_OUTPUT_TOKENS},
    )


class Problem(ValueError):
    """A request the page should not have sent, said in a sentence."""


def chat_request(data, models: list[str]) -> dict:
    """The OpenAI chat body for a posted form, or Problem with a sentence."""
    model = data.get("model", "")
    if model not in models:
        raise Problem(f"{model or 'No model'} is not a model this key may use.")
    prompt = data.get("prompt", "").strip()
    if not prompt:
        raise Problem("Write a message to send.")
    try:
        temperature = float(data.get("temperature") or 0.7)
        max_tokens = int(data.get("max_tokens") or 256)
    except ValueError:
        raise Problem("Temperature is a number and the output limit a whole number.") from None
    if not TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]:
        raise Problem("Temperature is between 0 and 2.")
    if not 1 <= max_tokens <= MAX_OUTPUT_TOKENS:
        raise Problem(f"The output limit is between 1 and {MAX_OUTPUT_TOKENS} tokens.")
    messages = []
    if system := data.get("system", "").strip():
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}


def event(name: str, payload: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def relay(body: dict, secret: str):
    """The gateway's events as they come; a refusal or a lost gateway as one `refused` event with its sentence."""
    url = settings.GATEWAY_URL + "v1/chat/completions"
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        upstream = requests.post(
            url,
            json=stream_body,
            headers={"Authorization": f"Bearer {secret}"},
            stream=True,
            timeout=(CONNECT_TIMEOUT_S, settings.GATEWAY_UPSTREAM_TIMEOUT_S),
        )
    except requests.RequestException:
        yield event("refused", {"message": f"The gateway at {settings.GATEWAY_URL} did not answer."})
        return
    try:
        if upstream.status_code != 200:
            yield event("refused", {"message": refusal(upstream), "status": upstream.status_code})
            return
        # Bytes as they came: decoding here would guess a charset the event stream does not name.
        for line in upstream.iter_lines():
            if line.startswith(b"data: "):  # comments (a held request's keep-alives) stay here
                yield line + b"\n\n"
    except requests.RequestException:
        yield event("refused", {"message": "The gateway's answer broke off."})
    finally:
        # Reached too when the browser hangs up: the gateway sees its client go, and so does the engine.
        upstream.close()


def refusal(response: requests.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"The gateway refused the request ({response.status_code})."


@login_required(login_url="people:login")
@require_POST
def stream(request):
    key, secret = page_key(request)
    try:
        body = chat_request(request.POST, models_for(key))
    except Problem as problem:
        return HttpResponseBadRequest(str(problem), content_type="text/plain")
    response = StreamingHttpResponse(relay(body, secret), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy in front must not hold the tokens back
    return response


@login_required(login_url="people:login")
@require_POST
def show_code(request):
    key, _ = page_key(request)
    try:
        body = chat_request(request.POST, models_for(key))
    except Problem as problem:
        return render(request, "playground/partials/code.html", {"problem": str(problem)})
    return render(request, "playground/partials/code.html", code.snippets(body, settings.GATEWAY_URL, key))
