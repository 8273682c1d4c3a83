"""deploy/: the systemd units and environment files docs/fleet.md tells an operator to copy."""

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from .services import free_port
from .support.processes import BASE_DIR, process_env

DEPLOY = BASE_DIR / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def test_there_is_a_unit_for_each_control_plane_process_and_the_agent():
    assert {u.name for u in UNITS} == {
        "llmgw-admin.service",
        "llmgw-bytes.service",
        "llmgw-control.service",
        "llmgw-beat.service",
        "llmgw-pulls.service",
        "llmgw-gateway.service",
        "llmgw-agent.service",
    }
    control = (DEPLOY / "systemd" / "llmgw-control.service").read_text()
    # The scheduler is a unit of its own, on every control host, one sending at a time by its lease (docs/fleet.md).
    assert "--beat" not in control and "-Q control" in control
    assert "llmgw_site beat" in (DEPLOY / "systemd" / "llmgw-beat.service").read_text()
    # Engines outlive an agent restart: systemd must not kill them with it.
    assert "KillMode=process" in (DEPLOY / "systemd" / "llmgw-agent.service").read_text()


def _directives(unit: Path) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line and not line.startswith("#")
    )


def test_pulls_run_on_their_own_worker_the_one_unit_that_may_write_the_mirror():
    """Issue 34: two long pulls on the control worker held its slots; its unit kept the mirror read-only besides."""
    mirror = _env_file(DEPLOY / "env" / "control.env")["LLMGW_MIRROR_ROOT"]
    pulls = _directives(DEPLOY / "systemd" / "llmgw-pulls.service")
    assert " -Q pulls " in pulls["ExecStart"] and "--beat" not in pulls["ExecStart"]
    assert pulls["ReadWritePaths"] == mirror and pulls["UMask"] == "0077"
    for unit in UNITS:
        if unit.name != "llmgw-pulls.service":
            said = _directives(unit)
            assert mirror not in said.get("ReadWritePaths", ""), unit.name
    assert _directives(DEPLOY / "systemd" / "llmgw-control.service")["ReadOnlyPaths"] == mirror
    from django.conf import settings

    assert settings.CELERY_TASK_ROUTES["mirror.pull"] == {"queue": "pulls"}


def test_every_unit_restarts_whatever_way_its_process_exits_and_keeps_its_files_to_itself():
    for unit in UNITS:
        said = _directives(unit)
        # A worker told to shut down (`celery control shutdown`) exits with status 0: on-failure would leave it down.
        assert said["Restart"] == "always", unit.name
        # The agent's engines read their weights through its group; nothing else is for anybody else.
        assert said["UMask"] == ("0027" if unit.name == "llmgw-agent.service" else "0077"), unit.name


def test_the_agent_may_start_engines_as_their_own_user_and_nothing_more():
    said = _directives(DEPLOY / "systemd" / "llmgw-agent.service")
    wanted = {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"}
    assert set(said["AmbientCapabilities"].split()) == set(said["CapabilityBoundingSet"].split()) == wanted
    assert said["User"] != "root" and said["NoNewPrivileges"] == "yes"
    assert _env_file(DEPLOY / "env" / "node.env")["LLMGW_ENGINE_USER"] not in ("", "root", said["User"])
    # node.env holds the token and the broker's password: systemd reads it as root and hands it over.
    assert "mode 0600" in (DEPLOY / "env" / "node.env").read_text().splitlines()[1]


def _as_installed_here(tmp_path: Path) -> list[Path]:
    """The units with /opt/llmgw and /etc/llmgw pointing at this checkout, so every program they name exists."""
    out = []
    for unit in UNITS:
        text = unit.read_text()
        text = text.replace("/opt/llmgw/.venv/bin/python", sys.executable)
        text = text.replace("/opt/llmgw", str(BASE_DIR)).replace("/etc/llmgw/", f"{DEPLOY / 'env'}/")
        (tmp_path / unit.name).write_text(text)
        out.append(tmp_path / unit.name)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_units_pass_systemd_analyze_verify(tmp_path):
    units = _as_installed_here(tmp_path)
    verified = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, units)], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on an unknown key or a value it cannot parse, and says so: both count.
    said = [line for line in (verified.stdout + verified.stderr).splitlines() if line.strip()]
    assert verified.returncode == 0 and said == [], "\n".join(said)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_would_catch_a_mistyped_unit(tmp_path):
    unit = _as_installed_here(tmp_path)[0]
    unit.write_text(unit.read_text().replace("Restart=always", "Restrat=always"))
    verified = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True)
    assert "Unknown key" in verified.stderr


def _env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            pairs[name.strip()] = value.strip()
    return pairs


def test_the_units_read_the_example_environment_files():
    for unit in UNITS:
        wanted = re.search(r"^EnvironmentFile=/etc/llmgw/(\S+)$", unit.read_text(), re.M).group(1)
        assert (DEPLOY / "env" / wanted).exists(), f"{unit.name} reads {wanted}, which deploy/env/ lacks"
    node = _env_file(DEPLOY / "env" / "node.env")
    # A node has no database: what its env file says is all it gets.
    assert "DATABASE_URL" not in node and {"LLMGW_NODE_TOKEN", "REDIS_URL", "LLMGW_BYTES_URL"} <= set(node)


def _check_deploy(tmp_path: Path, **override: str) -> subprocess.CompletedProcess:
    env = _env_file(DEPLOY / "env" / "control.env")
    env.update(
        # This machine's stand-ins for the example's addresses and secrets; the rest as the file says.
        DJANGO_SECRET_KEY=secrets.token_urlsafe(50),
        LLMGW_VAR=str(tmp_path / "var"),
        LLMGW_MIRROR_ROOT=str(tmp_path / "mirror"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"),
    )
    env.update(override)
    (tmp_path / "metrics").mkdir(exist_ok=True)
    environment = process_env(**env)
    environment["DATABASE_URL"] = process_env()["DATABASE_URL"]
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=BASE_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_with_the_production_settings_the_fleet_doc_gives(tmp_path, db):
    checked = _check_deploy(tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and it is those settings that make it so: without the TLS proxy's, Django says what is missing.
    unsafe = _check_deploy(tmp_path, LLMGW_HTTPS="false")
    assert unsafe.returncode != 0 and "SECURE_SSL_REDIRECT" in unsafe.stderr + unsafe.stdout


def test_check_deploy_refuses_the_example_secret_key_a_short_one_and_none(tmp_path, db):
    """The placeholder of deploy/env/control.env passed Django's own check (long, varied); whoever reads it forges sessions."""
    placeholder = _env_file(DEPLOY / "env" / "control.env")["DJANGO_SECRET_KEY"]
    for key, said in ((placeholder, "llmgw.E002"), ("s3cr3t-but-short-" * 2, "llmgw.E003"), ("", "llmgw.E001")):
        checked = _check_deploy(tmp_path, DJANGO_SECRET_KEY=key)
        assert checked.returncode != 0 and said in checked.stdout + checked.stderr, (
            key,
            checked.stdout,
            checked.stderr,
        )
        assert "DJANGO_SECRET_KEY" in checked.stdout + checked.stderr


def test_every_example_environment_file_carries_a_placeholder_the_check_refuses():
    from llmgw_site.checks import PLACEHOLDER_MARK

    for path in sorted((DEPLOY / "env").glob("*.env")):
        key = _env_file(path).get("DJANGO_SECRET_KEY")
        assert key is None or PLACEHOLDER_MARK in key.lower(), f"{path.name} carries a key check --deploy would pass"


def _start_nginx(work: Path, https_port: int, http_port: int, admin_port: int, gateways: list[int]) -> subprocess.Popen:
    """deploy/nginx/llmgw.conf as given, on loopback ports of this test and a certificate made for 127.0.0.1."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=llmgw.test"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(work / "key.pem"), "-out", str(work / "cert.pem")],
        check=True,
        capture_output=True,
    )
    site = (DEPLOY / "nginx" / "llmgw.conf").read_text()
    site = re.sub(r"^\s*listen \[::\].*$", "", site, flags=re.M)
    site = site.replace("listen 443 ssl", f"listen 127.0.0.1:{https_port} ssl").replace(
        "listen 80;", f"listen 127.0.0.1:{http_port};"
    )
    # Control host A is this test's admin server; B a port nothing listens on: a control host that is down.
    for example, port in zip(("10.0.0.10:8000", "10.0.0.11:8000"), (admin_port, free_port()), strict=True):
        site = site.replace(example, f"127.0.0.1:{port}")
    for example, port in zip(("10.0.0.31:8080", "10.0.0.32:8080"), gateways, strict=True):
        site = site.replace(example, f"127.0.0.1:{port}")
    site = site.replace("/etc/ssl/llmgw/fullchain.pem", str(work / "cert.pem"))
    site = site.replace("/etc/ssl/llmgw/privkey.pem", str(work / "key.pem"))
    (work / "site.conf").write_text(site)
    temp = " ".join(f"{kind}_temp_path {work / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (work / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\npid {work}/nginx.pid;\nerror_log {work}/error.log;\nevents {{}}\n"
        + f"http {{ access_log off; {temp} include {work}/site.conf; }}\n"
    )
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    return subprocess.Popen([nginx, "-c", str(work / "nginx.conf"), "-p", str(work)], stderr=subprocess.DEVNULL)


@pytest.mark.skipif(not (shutil.which("nginx") or os.path.exists("/usr/sbin/nginx")), reason="nginx is not installed")
def test_the_tls_proxy_of_the_fleet_doc_serves_the_admin_port_over_https_only(tmp_path, transactional_db):
    from .support.gateway_process import start_gateway
    from .support.processes import start_admin_server
    from .support.waiting import wait_until

    admin, url = start_admin_server(tmp_path, LLMGW_HTTPS="true")
    gateway, gateway_url = start_gateway(tmp_path)
    https_port, http_port = free_port(), free_port()
    # The site's second gateway is a port nothing listens on: a gateway that is down.
    gateways = [int(gateway_url.rsplit(":", 1)[1]), free_port()]
    nginx = _start_nginx(tmp_path, https_port, http_port, int(url.rsplit(":", 1)[1]), gateways)
    try:
        base = f"https://127.0.0.1:{https_port}"
        cert = str(tmp_path / "cert.pem")

        def answers():
            try:
                return requests.get(base + "/admin/login/", verify=cert, timeout=2)
            except requests.RequestException:
                return None

        login = wait_until(answers, timeout=15, what="nginx to answer")
        assert login.status_code == 200, login.text[:500]
        # However often nginx tries the control host that is down first, the other answers.
        for _ in range(4):
            assert requests.get(base + "/admin/login/", verify=cert, timeout=5).status_code == 200
        # Cookies travel only over HTTPS, and browsers are told to keep to it.
        assert "Secure" in login.headers["set-cookie"]
        assert login.headers["strict-transport-security"].startswith("max-age=")
        # The gateways behind it: a request without a key is refused in OpenAI's shape, over TLS,
        # by the gateway that is up, however often nginx tries the one that is down first.
        for _ in range(6):
            refused = requests.get(base + "/v1/models", verify=cert, timeout=5)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        # Plain HTTP, to nginx or to the admin port itself, is sent to HTTPS.
        plain = requests.get(f"http://127.0.0.1:{http_port}/admin/", allow_redirects=False, timeout=5)
        assert plain.status_code == 301 and plain.headers["location"].startswith("https://")
        direct = requests.get(url + "/admin/login/", allow_redirects=False, timeout=5)
        assert direct.status_code == 301 and direct.headers["location"].startswith("https://")
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        gateway.stop()
        admin.stop()


def test_every_unit_makes_the_directories_its_env_file_names_and_llmgw_manage_does_too():
    control = _env_file(DEPLOY / "env" / "control.env")
    for unit in UNITS:
        said = _directives(unit)
        assert said.get("StateDirectory") == "llmgw", unit.name
        if "control.env" in said.get("EnvironmentFile", ""):
            assert "/run/" + said["RuntimeDirectory"] == control["PROMETHEUS_MULTIPROC_DIR"], unit.name
            assert said["RuntimeDirectoryPreserve"] == "yes", unit.name
    manage = (DEPLOY / "llmgw-manage").read_text()
    assert 'install -d -o llmgw -g llmgw -m 0750 "${LLMGW_VAR:-/var/lib/llmgw}"' in manage
    assert 'install -d -o llmgw -g llmgw -m 0755 "$PROMETHEUS_MULTIPROC_DIR"' in manage
