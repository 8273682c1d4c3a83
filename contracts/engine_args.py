"""Which engine arguments a profile may give, per engine: an allow-list, checked on both sides.

The catalog refuses anything else with a sentence (API, admin, configuration file, serve
page), and a node checks again before it starts an engine, because what arrives on its
queue is not trusted for having been stored. A deny-list lost to spellings the engines
accept: `--trust_remote_code` (vLLM reads `_` as `-`), `--trust-remote-cod` (argparse
takes a prefix) and `--config x.yaml` (a file of any other arguments). Here a flag is
allowed only when written exactly as listed.

Left out on purpose: whatever names a file or an address on the node (`--model`,
`--lora`, `--chat-template-file`, `--config`, `--log-file`, `--ssl-*`, `--path`,
`--download-dir`, `--hf-repo`), where the engine listens (`--host`, `--port`: the agent
chooses), and `--api-key` (the gateway's replica secret is the agent's to set).
"""

from __future__ import annotations

import re

from .engines import LLAMACPP_ARGS as LLAMACPP
from .engines import REMOTE_CODE, SPECS, kind_args, no_such_engine
from .engines import VLLM_ARGS as VLLM

__all__ = ["ALLOWED", "LLAMACPP", "REMOTE_CODE", "VLLM", "args_problem", "kind_args"]

# The allow-lists are each engine's spec's (contracts/engines.py); here is how they are applied.
ALLOWED: dict[str, dict[str, bool]] = {name: spec.allowed_args for name, spec in SPECS.items()}


# A value given as its own argument may start with "-" only as a negative number
# (`-ngl -1`): anything else there is a flag smuggled in as a value.
_NEGATIVE_NUMBER = re.compile(r"-\d[\d.]*")


def args_problem(engine: str, args: list[str], allow_remote_code: bool = False) -> str | None:
    """Why these arguments may not be given to this engine, or None.

    `allow_remote_code` is LLMGW_ALLOW_REMOTE_CODE, which lets vLLM have --trust-remote-code.
    """
    allowed = ALLOWED.get(engine)
    if allowed is None:
        return no_such_engine(engine)
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, _ = arg.partition("=")
        if not arg.startswith("-"):
            return f"{arg!r} is not an engine flag: every argument is a flag (like --ctx-size) or the value after one"
        if flag == REMOTE_CODE and flag in allowed and not allow_remote_code:
            return (
                f"{arg} makes the engine run code that came with the weights; "
                "it is refused unless LLMGW_ALLOW_REMOTE_CODE is set"
            )
        if flag not in allowed:
            return (
                f"{flag} is not an argument llmgw gives {engine}: engine arguments are an allow-list "
                "(docs/engines.md lists them), written exactly as there"
            )
        # A value glued on with "=" cannot be a second flag; the engine says if it objects to it.
        if allowed[flag] and not eq:
            if i + 1 >= len(args):
                return f"{flag} needs a value after it"
            value = args[i + 1]
            if value.startswith("-") and not _NEGATIVE_NUMBER.fullmatch(value):
                return f"{flag} needs a value after it, not the flag {value}"
            i += 1
        i += 1
    return None
