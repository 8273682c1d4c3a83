#!/bin/sh
# What make needs before anything else: python3 with venv, and a C++ compiler for
# the llama.cpp engine that pip builds from source. On Debian these are packages.
set -e
need=""
python3 -c 'import venv, ensurepip' 2>/dev/null || need="$need python3 python3-venv"
command -v g++ >/dev/null 2>&1 || need="$need g++ make"
[ -z "$need" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
else
    echo "llmgw needs:$need. Install them with: sudo apt-get install$need" >&2
    exit 1
fi
