"""The playground's request written out for a person to run: as curl and with the `openai` client."""

from __future__ import annotations

import json
import shlex

from gateway.models import ApiKey

SECRET_PLACEHOLDER = "$LLMGW_API_KEY"


def snippets(body: dict, gateway_url: str, key: ApiKey) -> dict:
    """curl and Python for the same streamed request; the key by name only, its secret left to the reader."""
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    curl = (
        f"curl -N {shlex.quote(gateway_url + 'v1/chat/completions')} \\\n"
        f'  -H "Authorization: Bearer {SECRET_PLACEHOLDER}" \\\n'
        "  -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(json.dumps(streamed, indent=2))}"
    )
    python = "\n".join(
        [
            "import os",
            "from openai import OpenAI",
            "",
            f'client = OpenAI(base_url={gateway_url + "v1"!r}, api_key=os.environ["LLMGW_API_KEY"])',
            "stream = client.chat.completions.create(",
            f"    model={body['model']!r},",
            f"    messages={body['messages']!r},",
            f"    temperature={body['temperature']!r},",
            f"    max_tokens={body['max_tokens']!r},",
            "    stream=True,",
            '    stream_options={"include_usage": True},',
            ")",
            "for chunk in stream:",
            "    if chunk.choices and chunk.choices[0].delta.content:",
            '        print(chunk.choices[0].delta.content, end="", flush=True)',
        ]
    )
    return {"curl": curl, "python": python, "key": key}
