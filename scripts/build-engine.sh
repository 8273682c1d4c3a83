#!/bin/sh
# Build and install llama.cpp (PyPI's llama-cpp-python) for the CPU this machine has.
#
# Why not pip's default build: it compiles with -march=native, which on these CPUs turns
# on AMX kernels; the CPU reports AMX but a process here cannot use it, and the engine
# dies with SIGILL on the first token of a Q4/Q8 model. So GGML_NATIVE is off and each
# instruction set is turned on only when /proc/cpuinfo lists it; AMX is always off.
# The wheel is kept under a key made of those flags, never in pip's own cache (which
# keys on the source alone and would hand a wheel built for another CPU to this one).
#
# Usage: sh scripts/build-engine.sh [PYTHON]   (default .venv/bin/python)
set -e
PY=${1:-.venv/bin/python}
SPEC=$(grep -v '^#' requirements-engine.txt | grep llama-cpp-python | head -n 1)
VERSION=${SPEC##*==}
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
ARGS="$ARGS -DGGML_SSE42=$(has sse4_2) -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2)"
ARGS="$ARGS -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2)"
ARGS="$ARGS -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f)"
ARGS="$ARGS -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
ARGS="$ARGS -DGGML_AVX512_BF16=$(has avx512_bf16)"
KEY=$(printf '%s %s %s' "$VERSION" "$(uname -m)" "$ARGS" | sha256sum | cut -c1-16)
DIR=${LLMGW_ENGINE_WHEELS:-$HOME/.cache/llmgw/engine-wheels}/$KEY
if ! ls "$DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "Building the llama.cpp engine for this CPU (about 7 minutes the first time)..."
    mkdir -p "$DIR.tmp"
    CMAKE_ARGS="$ARGS" "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
        -w "$DIR.tmp" "llama-cpp-python==$VERSION"
    printf '%s\n' "$ARGS" > "$DIR.tmp/CMAKE_ARGS"
    rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
fi
# --only-binary: the wheel above or nothing, never pip building (or taking from its own
# cache) one with -march=native.
"$PY" -m pip install -q --only-binary llama-cpp-python --find-links "$DIR" -r requirements-engine.txt
# A venv that already holds an engine built some other way (an older `make`, a plain pip
# install) keeps it through the line above, which sees the version satisfied: replace it.
MARK="$(dirname "$PY")/../.engine-cmake-args"
if [ "$(cat "$MARK" 2>/dev/null)" != "$ARGS" ]; then
    "$PY" -m pip install -q --no-deps --force-reinstall "$DIR"/llama_cpp_python-*.whl
fi
"$PY" -c 'import llama_cpp.server'
printf '%s\n' "$ARGS" > "$MARK"
