"""A fleet deployed the way docs/fleet.md and deploy/ say, for tests/test_deploy_as_operator.py.

What an operator copies is read from those files here, never copied into the test: the
nftables rules from fleet.md (between its `<!-- firewall: ROLE -->` markers), the units
from deploy/systemd/, the env files from deploy/env/.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from .processes import BASE_DIR, Process

FLEET_DOC = BASE_DIR / "docs" / "fleet.md"
EXAMPLE_ADDRESS = re.compile(r"\b10\.0\.0\.\d+\b")


def _block_after(marker: str) -> str:
    text = FLEET_DOC.read_text()
    at = text.find(marker)
    assert at >= 0, f"docs/fleet.md has no {marker}"
    found = re.compile(r"```[a-z]*\n(.*?)```", re.S).search(text, at)
    return found.group(1)


def firewall(role: str, addresses: dict[str, str]) -> str:
    """fleet.md's nftables rules for `role` (control, gateway, node), its example addresses replaced by `addresses`."""
    rules = _block_after("<!-- firewall: control -->")
    if role != "control":
        lines = rules.splitlines()
        first = next(i for i, line in enumerate(lines) if "tcp dport { 80, 443 } accept" in line)
        own = _block_after(f"<!-- firewall: {role} -->").splitlines()
        # "the same with the last three accept lines replaced by" the role's own
        rules = "\n".join(lines[:first] + own + lines[first + 3 :]) + "\n"

    def replace(found: re.Match) -> str:
        return addresses.get(found.group(0), "192.0.2.1")  # an example host this fleet lacks: TEST-NET, never routed

    return EXAMPLE_ADDRESS.sub(replace, rules)


def apply_firewall(netns: str, rules: str) -> None:
    applied = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, capture_output=True, text=True, timeout=30
    )
    assert applied.returncode == 0, f"nft refused fleet.md's rules:\n{applied.stderr}\n{rules}"


# A listener and a client that run inside a namespace: one line of Python each, no port of this host.
LISTEN = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print('listening', flush=True)\n"
    "while True:\n    c,_=s.accept(); c.sendall(b'hello'); c.close()\n"
)
CONNECT = (
    "import socket,sys\n"
    "try:\n    c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "    print(c.recv(5).decode())\n"
    "except OSError as e:\n    print('failed:', e)\n"
)


def listen(netns: str, address: str, port: int) -> subprocess.Popen:
    listener = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", LISTEN, address, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout.readline().strip() == "listening"
    return listener


def connects(netns: str, address: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a connection from `netns` to address:port gets the listener's hello within `timeout`."""
    said = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", CONNECT, address, str(port), str(timeout)],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )
    return said.stdout.strip() == "hello"


# --- Hosts: each a persistent mount namespace over this machine's files (its own disk) ---

UNITS = BASE_DIR / "deploy" / "systemd"
VENV_BIN = (BASE_DIR / ".venv" / "bin").resolve()
# What an operator's steps write to, each an overlay of this machine's directory in the host's
# namespace, its changes kept in the test's directory: users in /etc, the checkout in /opt, nginx's logs, ...
HOST_DISK = ("/etc", "/opt", "/srv", "/var/lib", "/var/log", "/usr/local/lib", "/usr/local/bin", str(VENV_BIN))
# The lab's interpreter (pyenv's, under /root, where a Debian host's is /usr/bin/python3).
LAB_PYTHON = str(Path(os.path.realpath(VENV_BIN / "python")).parents[1])
ROOT_ENGINE_BUILDS = os.path.expanduser("~/.cache/llmgw/engines")
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def unit_directives(name: str) -> dict[str, str]:
    """deploy/systemd/<name>.service's [Service] settings (the last of each key, as systemd keeps a list's)."""
    said: dict[str, str] = {}
    section = ""
    for line in (UNITS / f"{name}.service").read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            said[key] = f"{said[key]} {value}" if key in ("ReadOnlyPaths", "ReadWritePaths") and key in said else value
    return said


class DeployedHost:
    """One host of the fleet: a network namespace (or this machine's network), and a disk of its own."""

    def __init__(self, name: str, work: Path, netns: str | None, address: str):
        self.name = name
        self.netns = netns
        self.address = address
        self.work = work / name
        self.work.mkdir(parents=True)
        self.mount_ns = work / "ns" / name
        self.mount_ns.touch()
        self.processes: list[Process] = []
        setup = ["set -e"]
        for i, point in enumerate(HOST_DISK):
            upper, scratch = self.work / f"disk-{i}", self.work / f"scratch-{i}"
            upper.mkdir()
            scratch.mkdir()
            upper.chmod(os.stat(point).st_mode & 0o7777)
            setup.append(f"mount -t overlay overlay -o lowerdir={point},upperdir={upper},workdir={scratch} {point}")
        # /run empties at boot: the host's own. The lab's interpreter is under /root (pyenv's; a
        # Debian host's is /usr/bin/python3): the host's users may reach it, as they do /usr/bin.
        setup.append("mount -t tmpfs -o mode=0755 tmpfs /run")
        # Root's own build cache (scripts/build-engine.sh's) stays in root's home, as on a node.
        for kept in (LAB_PYTHON, ROOT_ENGINE_BUILDS):
            setup.append(f"mkdir -p /run/keep{kept} && mount --bind {kept} /run/keep{kept}")
        setup.append("mount -t tmpfs -o mode=0711 tmpfs /root")
        for kept in (LAB_PYTHON, ROOT_ENGINE_BUILDS):
            setup.append(f"mkdir -p {kept} && mount --move /run/keep{kept} {kept}")
        made = subprocess.run(
            ["unshare", f"--mount={self.mount_ns}", "--propagation", "private", "sh", "-c", "\n".join(setup)],
            capture_output=True,
            text=True,
        )
        assert made.returncode == 0, made.stderr

    def _enter(self) -> list[str]:
        argv = ["nsenter", f"--mount={self.mount_ns}"]
        if self.netns:
            argv.append(f"--net=/run/netns/{self.netns}")
        return [*argv, "--"]

    def run(self, command: str, **env: str) -> str:
        """A shell command as root on this host, in /opt/llmgw once the checkout is there; its output."""
        done = subprocess.run(
            [*self._enter(), "sh", "-c", f"cd /opt/llmgw 2>/dev/null || cd /; {command}"],
            capture_output=True,
            text=True,
            env={"PATH": SYSTEMD_PATH, "HOME": "/root", **env},
            timeout=300,
        )
        assert done.returncode == 0, f"on {self.name}: {command}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def clone(self) -> None:
        """`git clone <llmgw's repository> /opt/llmgw`: this checkout, as it is, bound there."""
        self.run(f"mkdir -p /opt/llmgw && mount --bind {BASE_DIR} /opt/llmgw")

    def start_unit(self, name: str, node: str = "") -> Process:
        """deploy/systemd/<name>.service's process, started as systemd would start it (tests/support/unit_exec.py)."""
        said = unit_directives(name)
        env_path = said["EnvironmentFile"]
        env = read_env_file_on(self, env_path)
        user = self.run(f"getent passwd {said['User']}").split(":")
        # What systemd gives every service beside its EnvironmentFile=.
        env = {"PATH": SYSTEMD_PATH, "HOME": user[5], "USER": said["User"], "LOGNAME": said["User"], **env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        argv = [word.replace("%H", node or self.name) for word in shlex.split(said["ExecStart"])]
        spec = self.work / f"{name}.json"
        spec.write_text(
            json.dumps(
                {
                    "directives": said,
                    "argv": argv,
                    "env": env,
                    "lab_python": LAB_PYTHON,
                }
            )
        )
        launcher = [*self._enter(), "unshare", "--mount", "--propagation", "private", "--"]
        launcher += [sys.executable, str(Path(__file__).with_name("unit_exec.py")), str(spec)]
        process = Process(f"{self.name}-{name}", launcher, {"PATH": SYSTEMD_PATH}, self.work)
        self.processes.append(process)
        return process

    def start(self, name: str, argv: list[str]) -> Process:
        """A daemon of this host that is not llmgw's (nginx, Prometheus), as root; its own unit's User= is in `argv`."""
        process = Process(f"{self.name}-{name}", [*self._enter(), *argv], {"PATH": SYSTEMD_PATH}, self.work)
        self.processes.append(process)
        return process

    def read(self, path: str) -> str:
        return self.run(f"cat {path}")

    def write(self, path: str, text: str) -> None:
        """The operator's edit of a file: its content replaced, its owner and mode kept."""
        self.run(f"cat > {path} <<'END'\n{text.rstrip()}\nEND")

    def remove(self) -> None:
        for process in reversed(self.processes):  # as systemd stops them: what started last (needing the rest) first
            process.stop()
        subprocess.run(["umount", "-l", str(self.mount_ns)], capture_output=True)


def read_env_file_on(host: DeployedHost, path: str) -> dict[str, str]:
    """An EnvironmentFile= of `host` read as root, as systemd does."""
    pairs = {}
    for line in host.run(f"cat {path}").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def namespaces_dir(work: Path) -> Path:
    """A directory the hosts' mount namespaces can be kept in (a private mount, as unshare --mount=FILE wants)."""
    ns = work / "ns"
    ns.mkdir()
    subprocess.run(["mount", "--bind", str(ns), str(ns)], check=True)
    subprocess.run(["mount", "--make-private", str(ns)], check=True)
    return ns


def remove_namespaces_dir(work: Path) -> None:
    subprocess.run(["umount", "-l", str(work / "ns")], capture_output=True)


def doc_line(starts: str) -> str:
    """The one line of docs/fleet.md's commands that begins with `starts`, as the operator copies it."""
    found = [line.split("  #")[0].strip() for line in FLEET_DOC.read_text().splitlines() if line.startswith(starts)]
    assert found, f"docs/fleet.md has no line starting {starts!r}"
    return found[0]


class GuideReader:
    """docs/fleet.md read top to bottom, as an operator does: each line the walk runs comes after the one before.

    A step placed before one it needs (`llmgw-manage` before its `install`) fails for an operator
    whichever order a test would run them in.
    """

    def __init__(self):
        self.lines = FLEET_DOC.read_text().splitlines()
        self.at, self.previous = -1, "the start"

    def line(self, starts: str) -> str:
        at = next((i for i, line in enumerate(self.lines) if i > self.at and line.startswith(starts)), None)
        first = next((i for i, line in enumerate(self.lines) if line.startswith(starts)), None)
        assert first is not None, f"docs/fleet.md has no line starting {starts!r}"
        assert at is not None, (
            f"docs/fleet.md asks for {starts!r} (its line {first + 1}) before {self.previous!r} (line {self.at + 1}), "
            "which it needs first"
        )
        self.at, self.previous = at, starts
        return self.lines[at].split("  #")[0].strip()


def edit_env_file(host: DeployedHost, path: str, filled: dict[str, str], lab: dict[str, str] | None = None) -> None:
    """The operator's edit of an env file: the values of the lines it has filled in, then the lab's own lines.

    A setting in `filled` that the shipped file lacks fails: an operator fills the lines the
    file has and never learns of one it does not (issue 41: no metrics token in control.env).
    """
    lines = host.read(path).splitlines()
    left = dict(filled)
    for i, line in enumerate(lines):
        name = line.partition("=")[0].strip()
        if not line.lstrip().startswith("#") and name in left:
            lines[i] = f"{name}={left.pop(name)}"
    assert not left, f"{path} (deploy/env/) has no line for {', '.join(sorted(left))}, which the operator must set"
    lines += [f"{name}={value}" for name, value in (lab or {}).items()]
    host.write(path, "\n".join(lines))
