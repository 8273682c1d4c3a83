#!/bin/sh
# What the tests need from Debian's packages, installed when missing: redis-server,
# PostgreSQL's server (the suite runs on a private one: tests/services.py), Chromium (driven
# by Playwright), nginx (for bench/bytes.py), Prometheus (tests/test_prometheus.py) and
# systemd-analyze (tests/test_deploy.py) and nft (docs/fleet.md's firewall,
# tests/test_deploy_as_operator.py). The llama.cpp engine is built by the Makefile's
# `engine` target (scripts/build-engine.sh).
set -e
# Earlier versions of this script left this file behind, and with it no `apt-get install
# postgresql` on this host ever made its cluster again: removed wherever it is found.
NO_CLUSTER=/etc/postgresql-common/createcluster.d/llmgw-tests.conf
if [ "$(id -u)" = 0 ]; then rm -f "$NO_CLUSTER"; fi
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || missing="$missing postgresql"
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
[ -x /usr/bin/chromium ] || missing="$missing chromium"
command -v nginx >/dev/null 2>&1 || missing="$missing nginx-light"
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
command -v nft >/dev/null 2>&1 || missing="$missing nftables"
# stunnel: the PSK-authenticated transport of one replica across several nodes (issue 37).
command -v stunnel4 >/dev/null 2>&1 || command -v stunnel >/dev/null 2>&1 || missing="$missing stunnel4"
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "The tests need:$missing. Install them with: sudo apt-get install$missing" >&2
        exit 1
    fi
    echo "Installing$missing from Debian's packages…"
    apt-get update -qq
    # The tests make their own PostgreSQL cluster; the package's own (on port 5432) is not
    # wanted. Turned off for this install only: the setting is gone once it is done, so a
    # later install on this host (a newer PostgreSQL, or the operator's) makes its cluster.
    trap 'rm -f "$NO_CLUSTER"' EXIT INT TERM
    mkdir -p "$(dirname "$NO_CLUSTER")"
    echo "create_main_cluster = false" > "$NO_CLUSTER"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    rm -f "$NO_CLUSTER"
    case "$missing" in
        *postgresql*) echo "PostgreSQL is installed without a cluster of its own; make one with: pg_createcluster --start $(ls /usr/lib/postgresql | sort -n | tail -n 1) main" ;;
    esac
fi
