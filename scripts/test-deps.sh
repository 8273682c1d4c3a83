#!/bin/sh
# What the tests need from Debian's packages, installed when missing: redis-server,
# PostgreSQL's server (the suite runs on a private one: tests/services.py), Chromium (driven
# by Playwright), nginx (for bench/bytes.py), Prometheus (tests/test_prometheus.py) and
# systemd-analyze (tests/test_deploy.py). The llama.cpp engine comes from PyPI through the
# Makefile's `engine` target.
set -e
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || missing="$missing postgresql"
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
[ -x /usr/bin/chromium ] || missing="$missing chromium"
command -v nginx >/dev/null 2>&1 || missing="$missing nginx-light"
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "The tests need:$missing. Install them with: sudo apt-get install$missing" >&2
        exit 1
    fi
    echo "Installing$missing from Debian's packages…"
    apt-get update -qq
    # The tests make their own PostgreSQL cluster; the package's own (on port 5432) is not wanted.
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/llmgw-tests.conf
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
