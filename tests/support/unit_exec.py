"""Start one systemd unit's process the way systemd would, without systemd (run as root, by tests/support/deploy.py).

Run inside a fresh mount namespace of its host's (`unshare --mount`): it makes the unit's
sandbox there (ProtectHome=, ProtectSystem=strict, ReadOnlyPaths=, ReadWritePaths=,
StateDirectory=, RuntimeDirectory=, PrivateTmp=), then becomes User=/Group= with UMask=,
WorkingDirectory=, the unit's capabilities and NoNewPrivileges= through setpriv, and execs
ExecStart with the environment deploy.py read from EnvironmentFile=. One argument: a JSON file.
"""

import json
import os
import pwd
import subprocess
import sys

KEEP_WRITABLE = ("/proc", "/sys", "/dev")


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as info:
        return [line.split()[4].replace("\\040", " ") for line in info]


def under(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def main() -> None:
    with open(sys.argv[1]) as spec_file:
        spec = json.load(spec_file)
    said = spec["directives"]
    user = pwd.getpwnam(said["User"])
    group = said.get("Group", said["User"])
    gid = pwd.getpwnam(group).pw_gid if group == said["User"] else __import__("grp").getgrnam(group).gr_gid
    writable = []
    for key, root in (("StateDirectory", "/var/lib"), ("RuntimeDirectory", "/run")):
        for name in said.get(key, "").split():
            path = f"{root}/{name}"
            os.makedirs(path, exist_ok=True)
            os.chown(path, user.pw_uid, gid)
            writable.append(path)
    writable += said.get("ReadWritePaths", "").split()
    if said.get("PrivateTmp") == "yes":
        for tmp in ("/tmp", "/var/tmp"):
            mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", tmp)
            writable.append(tmp)
    if said.get("ProtectHome") == "yes":
        # The lab's one exception: this machine's interpreter is pyenv's under /root, where a
        # Debian host's is /usr/bin/python3. Only it comes back, read-only; nothing else of root's home.
        kept = spec["lab_python"]
        os.makedirs("/run/lab-python", exist_ok=True)
        mount("--bind", kept, "/run/lab-python")
        for home in ("/home", "/root", "/run/user"):
            if os.path.isdir(home):
                mount("-t", "tmpfs", "-o", "mode=0711", "tmpfs", home)
        os.makedirs(kept)
        mount("--move", "/run/lab-python", kept)
        mount("-o", "remount,bind,ro", kept)
    for path in writable:
        mount("--bind", path, path)
    if said.get("ProtectSystem") == "strict":
        for point in mount_points():
            if not under(point, KEEP_WRITABLE) and point not in writable and not under(point, writable):
                subprocess.run(["mount", "-o", "remount,bind,ro", point], capture_output=True)
    for path in said.get("ReadOnlyPaths", "").split():
        mount("--bind", path, path)
        mount("-o", "remount,bind,ro", path)
    os.umask(int(said.get("UMask", "0022"), 8))
    os.chdir(said.get("WorkingDirectory", user.pw_dir))
    argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={gid}", "--init-groups"]
    caps = [c.removeprefix("CAP_").lower() for c in said.get("AmbientCapabilities", "").split()]
    if caps:
        listed = ",".join("+" + c for c in caps)
        argv += [f"--inh-caps=-all,{listed}", f"--ambient-caps=-all,{listed}", f"--bounding-set=-all,{listed}"]
    if "noroot" in said.get("SecureBits", ""):
        argv += ["--securebits=+noroot,+noroot_locked"]
    if said.get("NoNewPrivileges") == "yes":
        argv += ["--no-new-privs"]
    os.execvpe("setpriv", [*argv, "--", *spec["argv"]], spec["env"])


if __name__ == "__main__":
    main()
