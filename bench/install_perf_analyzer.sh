#!/usr/bin/env bash
# Install perf_analyzer, Triton's load generator, into a folder (Linux x86_64 only).
#
#     bench/install_perf_analyzer.sh DEST      # e.g. ~/.cache/asyncinfer-bench/perf_analyzer
#
# perf_analyzer ships as a binary inside the tritonclient wheels up to 2.48 (later wheels dropped
# it). It links against libb64 (Debian/Ubuntu package libb64-0d) and the CUDA runtime
# libcudart.so.12 (even for HTTP-only runs; the pip package nvidia-cuda-runtime-cu12 has it, no GPU
# needed). This script downloads the wheel without its dependencies, unpacks the binary, installs
# the CUDA runtime into DEST, installs libb64 with apt-get when run as root, and writes
# DEST/perf_analyzer: a wrapper that sets LD_LIBRARY_PATH and runs the binary. It ends by printing
# the environment to use; bench/serving_load.py finds the tool through $PERF_ANALYZER or PATH.
#
# Environment: PYTHON (default python3; its pip does the downloads), TRITONCLIENT_VERSION
# (default 2.48.0).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 DEST" >&2
    exit 2
fi
if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "perf_analyzer from the tritonclient wheel runs on Linux x86_64 only (this is $(uname -s)-$(uname -m))" >&2
    exit 1
fi

PYTHON=${PYTHON:-python3}
VERSION=${TRITONCLIENT_VERSION:-2.48.0}
mkdir -p "$1"
DEST=$(cd "$1" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "== downloading the tritonclient $VERSION wheel (no dependencies)"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$TMP" "tritonclient==$VERSION"
WHEEL=$(ls "$TMP"/tritonclient-"$VERSION"-*.whl)

echo "== unpacking perf_analyzer from $(basename "$WHEEL")"
mkdir -p "$DEST/bin"
# Python's zipfile rather than unzip(1): one less tool to require.
"$PYTHON" - "$WHEEL" "$VERSION" "$DEST/bin/perf_analyzer" <<'EOF'
import shutil, sys, zipfile
wheel, version, target = sys.argv[1:]
member = f"tritonclient-{version}.data/data/bin/perf_analyzer"
with zipfile.ZipFile(wheel) as zf:
    if member not in zf.namelist():
        sys.exit(f"{wheel} has no {member}: tritonclient wheels after 2.48 no longer ship perf_analyzer")
    with zf.open(member) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
chmod +x "$DEST/bin/perf_analyzer"

echo "== installing the CUDA runtime library (nvidia-cuda-runtime-cu12) into $DEST/cuda"
"$PYTHON" -m pip install --quiet --no-deps --upgrade --target "$DEST/cuda" "nvidia-cuda-runtime-cu12>=12,<13"
CUDART_DIR=$(dirname "$(find "$DEST/cuda" -name 'libcudart.so.12*' | head -n 1)")

if ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so'; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "== installing libb64-0d"
        apt-get install -y -q libb64-0d >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null; }
    else
        echo "!! libb64 is missing: install it as root (Debian/Ubuntu: apt-get install libb64-0d)" >&2
    fi
fi

cat >"$DEST/perf_analyzer" <<EOF
#!/bin/sh
# perf_analyzer with its CUDA runtime library on the loader path (written by install_perf_analyzer.sh)
LD_LIBRARY_PATH="$CUDART_DIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DEST/bin/perf_analyzer" "\$@"
EOF
chmod +x "$DEST/perf_analyzer"

echo "== checking that it starts"
HELP=$("$DEST/perf_analyzer" --help 2>&1 || true)  # its --help exits non-zero
if grep -q -- '--concurrency-range' <<<"$HELP"; then
    echo "perf_analyzer $VERSION is installed. Use it with:"
else
    echo "perf_analyzer was unpacked but does not start; missing libraries:" >&2
    LD_LIBRARY_PATH="$CUDART_DIR" ldd "$DEST/bin/perf_analyzer" | grep 'not found' >&2 || true
    exit 1
fi
echo
echo "    export PERF_ANALYZER=$DEST/perf_analyzer"
echo
echo "(or: export LD_LIBRARY_PATH=$CUDART_DIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}; export PATH=$DEST/bin:\$PATH)"
