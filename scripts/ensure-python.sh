#!/bin/sh
# python3 with venv is all make needs to start; on Debian venv is a separate package.
set -e
if python3 -c 'import venv, ensurepip' 2>/dev/null; then exit 0; fi
if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
else
    echo "python3 with venv is needed: sudo apt-get install python3 python3-venv" >&2
    exit 1
fi
