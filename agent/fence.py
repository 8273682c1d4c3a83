"""What keeps an engine away from the node: the agent not dumpable, its capabilities only where engines start, the engine's user.

An engine runs what its weights make it run: a crafted GGUF that exploits llama-server, a vLLM
model's own code. The agent and its supervisor hold the broker's password and the node's token
in their environment (docs/architecture.md, "What an engine taken over can still do").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pwd
from pathlib import Path

# <linux/prctl.h>, <linux/capability.h>
PR_SET_DUMPABLE = 4
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_KILL, CAP_SETGID, CAP_SETUID = 5, 6, 7
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# What the agent needs to start engines as LLMGW_ENGINE_USER and to stop them (a signal to another user's process).
ENGINE_USER_CAPABILITIES = {CAP_SETUID: "CAP_SETUID", CAP_SETGID: "CAP_SETGID", CAP_KILL: "CAP_KILL"}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def not_dumpable() -> None:
    """Make this process not dumpable, so that another process of its user cannot read its
    /proc/PID/environ or its memory (ptrace): an engine run as the agent's user would find the
    broker's password and the node's token there. An exec'd child (an engine) is dumpable again.
    """
    _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def clear_ambient_capabilities() -> None:
    """No capability passes through this process's next exec (an engine, the peers' process).

    systemd gives the agent its capabilities as ambient ones (deploy/systemd/llmgw-agent.service),
    which every exec'd child would otherwise keep. Harmless where there are none.
    """
    _libc().prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Give up every capability, for good: for the agent's worker once the supervisor has started.

    Only the supervisor starts and stops engines; the worker (orders from the broker) and the
    peers' process (the fleet's traffic) need none. An agent run as root is left as it is: root
    gets its capabilities back at any exec, so dropping them here would prove nothing.
    """
    clear_ambient_capabilities()
    if os.geteuid() == 0:
        return
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc().capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def engine_user(name: str) -> tuple[int, int] | None:
    """(uid, gid) engines run as under LLMGW_ENGINE_USER; None when it is empty (the agent's own user).

    The gid is the user's primary group: on a node, the agent's group (docs/agent.md), so the
    engine reads what the agent's umask 0027 leaves group-readable (its weights) and writes none of it.
    """
    if not name:
        return None
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def engine_user_problem(name: str) -> str | None:
    """Why engines cannot be started as LLMGW_ENGINE_USER=name, in a sentence; None when they can."""
    if not name:
        return None
    try:
        uid, gid = engine_user(name)
    except KeyError:
        return (
            f"LLMGW_ENGINE_USER={name}: there is no such user on this host. Make it "
            "(useradd --system --gid llmgw --no-create-home --shell /usr/sbin/nologin llmgw-engine, docs/agent.md) "
            "or leave the setting empty to run engines as the agent's own user."
        )
    if uid == 0 or gid == 0:
        return f"LLMGW_ENGINE_USER={name} is root or in root's group: an engine run so would be fenced from nothing."
    if uid == os.geteuid():
        return f"LLMGW_ENGINE_USER={name} is the agent's own user: name another, or leave it empty."
    held = effective_capabilities()
    missing = [label for cap, label in ENGINE_USER_CAPABILITIES.items() if not held & (1 << cap)]
    if missing:
        return (
            f"LLMGW_ENGINE_USER={name}: the agent may not start or stop processes of another user; it needs "
            f"{', '.join(missing)} (deploy/systemd/llmgw-agent.service gives them, docs/agent.md) or to run as root."
        )
    return None
