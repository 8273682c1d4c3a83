#!/bin/sh
# What the tests need beyond requirements.txt, installed when missing:
# redis-server and Chromium from Debian's packages, and the llama.cpp engine from
# PyPI (llama-cpp-python builds llama.cpp from source, about 7 minutes on two
# cores; pip keeps the built wheel in its cache, so it is built once per machine).
set -e
PIP="$1"
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
[ -x /usr/bin/chromium ] || missing="$missing chromium"
command -v nginx >/dev/null 2>&1 || missing="$missing nginx-light"
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "The tests need:$missing. Install them with: sudo apt-get install$missing" >&2
        exit 1
    fi
    echo "Installing$missing from Debian's packages…"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
$PIP install -q -r requirements-engine.txt
