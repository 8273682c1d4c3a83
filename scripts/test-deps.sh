#!/bin/sh
# What the tests need from Debian's packages, installed when missing: redis-server,
# Chromium (driven by Playwright), nginx (for bench/bytes.py), Prometheus (tests/test_prometheus.py). The llama.cpp engine
# comes from PyPI through the Makefile's `engine` target.
set -e
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
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
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
