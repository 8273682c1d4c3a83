#!/bin/sh
# What scripts/build-engine.sh needs to build llama.cpp's llama-server on a fresh Debian:
# cmake, a C and a C++ compiler and make, with tar, gzip and sha256sum (there on any Debian,
# checked all the same). And stunnel, which the built rpc-server and llama-server's --rpc are
# used through (docs/engines.md, "One replica across several nodes"): an engine build a node
# cannot use across nodes would be half a build. Installed from Debian's packages when missing,
# as scripts/ensure-python.sh and scripts/test-deps.sh do for theirs.
set -e
need=""
command -v cmake >/dev/null 2>&1 || need="$need cmake"
command -v gcc >/dev/null 2>&1 || need="$need gcc"
command -v g++ >/dev/null 2>&1 || need="$need g++"
command -v make >/dev/null 2>&1 || need="$need make"
command -v tar >/dev/null 2>&1 || need="$need tar"
command -v gzip >/dev/null 2>&1 || need="$need gzip"
command -v sha256sum >/dev/null 2>&1 || need="$need coreutils"
command -v stunnel4 >/dev/null 2>&1 || command -v stunnel >/dev/null 2>&1 || need="$need stunnel4"
[ -z "$need" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "Installing$need from Debian's packages, to build the llama.cpp engine…"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
else
    echo "Building the llama.cpp engine needs:$need. Install them with: sudo apt-get install$need" >&2
    exit 1
fi
