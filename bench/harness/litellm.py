"""LiteLLM's proxy, the gateway's contender in bench/gateway.py: installed once into its own venv, started on loopback."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from .servers import ROOT, Servers, free_port

LITELLM_VERSION = "1.110.2"
LITELLM_VENV = ROOT / "var" / "bench" / "litellm-venv"


def ensure_litellm() -> Path | None:
    """LiteLLM's proxy in its own venv, installed once; None, and why, if it cannot be had."""
    litellm = LITELLM_VENV / "bin" / "litellm"
    installed = LITELLM_VENV / f".installed-{LITELLM_VERSION}"  # not just bin/litellm: a half install has that
    if installed.exists():
        return litellm
    print(f"Installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} (once)...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True)
    pip = [str(LITELLM_VENV / "bin" / "pip"), "install", "-q"]
    if subprocess.run(pip + [f"litellm[proxy]=={LITELLM_VERSION}"], capture_output=True).returncode != 0:
        # The proxy extra pins `litellm-proxy`, a package the registry here does not have, and two
        # helper packages at versions it does not have; the proxy's code ships in `litellm` itself.
        # So: litellm, then the extra's other requirements, the unavailable pins relaxed.
        if subprocess.run(pip + [f"litellm=={LITELLM_VERSION}"], capture_output=True).returncode != 0:
            print(f"LiteLLM {LITELLM_VERSION} could not be installed: it is left out of this run.")
            return None
        script = (
            "from importlib.metadata import requires\n"
            "from packaging.requirements import Requirement\n"
            "for r in requires('litellm'):\n"
            "    q = Requirement(r)\n"
            "    if q.marker and q.marker.evaluate({'extra': 'proxy'}) and not q.marker.evaluate({'extra': ''}):\n"
            "        if q.name == 'litellm-proxy': continue\n"
            "        print(q.name if q.name.startswith('litellm-') else str(q).split(';')[0])\n"
        )
        python = str(LITELLM_VENV / "bin" / "python")
        requirements = subprocess.run([python, "-c", script], capture_output=True, text=True).stdout.splitlines()
        if subprocess.run(pip + requirements, capture_output=True).returncode != 0:
            print("LiteLLM's proxy requirements could not be installed: it is left out of this run.")
            return None
    installed.touch()
    return litellm


def start_litellm(servers: Servers, litellm: Path, stub_port: int) -> tuple[subprocess.Popen, int, str]:
    """LiteLLM's proxy routing `stub` and `stub-hold` to the stub: the process, its port and its master key."""
    port = free_port()
    config = servers.work / "litellm.yaml"
    models = "".join(
        f"""  - model_name: {name}
    litellm_params:
      model: openai/{name}
      api_base: http://127.0.0.1:{stub_port}/v1
      api_key: x
"""
        for name in ("stub", "stub-hold")
    )
    config.write_text(f"model_list:\n{models}litellm_settings:\n  telemetry: false\n")
    key = "sk-" + secrets.token_hex(32)
    env = dict(
        os.environ,
        LITELLM_MASTER_KEY=key,  # it refuses to start without one; llmgw checks a key too
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch of the price list from the internet
        LITELLM_LOG="ERROR",
        LITELLM_TELEMETRY="False",
        DISABLE_ADMIN_UI="True",
    )
    for name in ("DATABASE_URL", "REDIS_URL", "REDIS_HOST"):
        env.pop(name, None)
    argv = [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    process = servers.spawn(argv + ["--num_workers", "1", "--telemetry", "False"], "litellm", env, servers.work)
    return process, port, key
