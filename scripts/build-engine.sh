#!/bin/sh
# Build llama.cpp's own `llama-server` and `rpc-server` (GGML_RPC on) for the CPU this machine
# has, and link them into the venv.
#
# The source is the llama.cpp that the pinned llama-cpp-python sdist vendors
# (requirements-engine.txt names the version; nothing of it is installed): one
# pinned llama.cpp, fetched through pip like every other package.
#
# Why not llama.cpp's default build: it compiles with -march=native, which on these
# CPUs turns on AMX kernels; the CPU reports AMX but a process here cannot use it, and
# the engine dies with SIGILL on the first token of a Q4/Q8 model. So GGML_NATIVE is
# off and each instruction set is turned on only when /proc/cpuinfo lists it; AMX is
# always off. LLMGW_ENGINE_ISA=avx2 builds for AVX2 without AVX-512 even where the CPU
# has it: the other mix a fleet runs on, so the real-model tests can be run against it
# here (docs/testing.md).
#
# The binary is kept under a key made of the version and those flags
# (~/.cache/llmgw/engines/<key>/llama-server and rpc-server, or under LLMGW_ENGINE_BUILDS), so a
# build for one mix is never handed to another CPU, and switching back is a link. Run as
# root, the binaries the venv links to are copies under /usr/local/lib/llmgw/engines/<key>/ (or
# LLMGW_ENGINE_INSTALL), which the agent's user reads under systemd's ProtectHome=yes.
#
# Usage: sh scripts/build-engine.sh [PYTHON]   (default .venv/bin/python)
#        sh scripts/build-engine.sh --where    the path this CPU's build is linked from (built or not)
set -e
WHERE=
if [ "$1" = "--where" ]; then WHERE=1; shift; fi
PY=${1:-.venv/bin/python}
HERE=$(cd "$(dirname "$0")/.." && pwd)
SPEC=$(grep -v '^#' "$HERE/requirements-engine.txt" | grep llama-cpp-python | head -n 1)
VERSION=${SPEC##*==}
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
case "${LLMGW_ENGINE_ISA:-native}" in
    native) ;;
    # What an AMD EPYC of the kind CI lands on reports: AVX2, FMA, F16C, BMI2, no AVX-512, no AVX-VNNI.
    avx2) flags=$(printf '%s\n' "$flags" | tr ' ' '\n' | grep -v -e '^avx512' -e '^avx_vnni$' | tr '\n' ' ') ;;
    *) echo "LLMGW_ENGINE_ISA is ${LLMGW_ENGINE_ISA}; it may be native (this CPU's own) or avx2" >&2; exit 1 ;;
esac
has() { case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
ARGS="$ARGS -DGGML_SSE42=$(has sse4_2) -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2)"
ARGS="$ARGS -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2)"
ARGS="$ARGS -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f)"
ARGS="$ARGS -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
ARGS="$ARGS -DGGML_AVX512_BF16=$(has avx512_bf16)"
# Static binaries, no curl (a node fetches weights itself): the server, and with GGML_RPC the
# server's `--rpc` and `rpc-server`, a worker's half of one replica across several nodes (issue 37).
ARGS="$ARGS -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF"
ARGS="$ARGS -DGGML_RPC=ON"
ARGS="$ARGS -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release"
KEY=$(printf '%s %s %s' "$VERSION" "$(uname -m)" "$ARGS" | sha256sum | cut -c1-16)
BUILDS=${LLMGW_ENGINE_BUILDS:-$HOME/.cache/llmgw/engines}
DIR=$BUILDS/llama-server-$VERSION-$KEY
# Installed outside any home: a node's agent runs as llmgw with ProtectHome=yes and would find
# nothing behind a link into root's ~/.cache (issue 41). As another user, the build stays its own.
if [ "$(id -u)" = 0 ]; then INSTALL=${LLMGW_ENGINE_INSTALL:-/usr/local/lib/llmgw/engines}; else INSTALL=${LLMGW_ENGINE_INSTALL:-$BUILDS}; fi
INSTALLED=$INSTALL/${DIR##*/}
if [ -n "$WHERE" ]; then echo "$INSTALLED/llama-server"; exit 0; fi
if [ ! -x "$DIR/llama-server" ] || [ ! -x "$DIR/rpc-server" ]; then
    echo "Building llama.cpp's llama-server $VERSION for this CPU (about 6 minutes on two cores)..."
    WORK="$DIR.tmp"
    rm -rf "$WORK" && mkdir -p "$WORK/src"
    SDIST=$BUILDS/sources/llama_cpp_python-$VERSION.tar.gz
    if [ ! -f "$SDIST" ]; then
        mkdir -p "$BUILDS/sources"
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$BUILDS/sources" "llama-cpp-python==$VERSION"
    fi
    tar -xzf "$SDIST" -C "$WORK/src" --strip-components=1 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    # shellcheck disable=SC2086  # ARGS is a list of words on purpose
    cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" $ARGS >"$WORK/configure.log"
    # llama.cpp's target for rpc-server is `ggml-rpc-server` (tools/rpc); kept here as rpc-server.
    cmake --build "$WORK/build" --target llama-server ggml-rpc-server -j2 >"$WORK/build.log"
    cp "$WORK/build/bin/llama-server" "$WORK/"
    cp "$WORK/build/bin/ggml-rpc-server" "$WORK/rpc-server"
    printf '%s\n' "$ARGS" > "$WORK/CMAKE_ARGS"
    rm -rf "$WORK/src" "$WORK/build"
    rm -rf "$DIR" && mv "$WORK" "$DIR"
fi
if [ "$INSTALLED" != "$DIR" ] && ! { cmp -s "$DIR/llama-server" "$INSTALLED/llama-server" && cmp -s "$DIR/rpc-server" "$INSTALLED/rpc-server"; }; then
    install -D -m 0644 "$DIR/CMAKE_ARGS" "$INSTALLED/CMAKE_ARGS"
    install -D -m 0755 "$DIR/llama-server" "$INSTALLED/llama-server"
    install -D -m 0755 "$DIR/rpc-server" "$INSTALLED/rpc-server"
fi
# The venv's bin/ is where this checkout's agent looks first (agent/engine_binary.py).
BIN="$(dirname "$PY")"
ln -sfn "$INSTALLED/llama-server" "$BIN/llama-server"
ln -sfn "$INSTALLED/rpc-server" "$BIN/rpc-server"
"$BIN/llama-server" --version >/dev/null 2>&1 || { echo "the llama-server built in $DIR does not run" >&2; exit 1; }
"$BIN/rpc-server" --help >/dev/null 2>&1 || { echo "the rpc-server built in $DIR does not run" >&2; exit 1; }
printf '%s\n' "$ARGS" > "$BIN/../.engine-cmake-args"
