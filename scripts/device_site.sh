#!/usr/bin/env bash
# The Python packages the GPU machine lacks, for a machine with no network: run here (where pip
# reaches the registry), then pass `.whl` in the device call's carry (scripts/gpu_suite.sh
# unpacks it onto PYTHONPATH, skipping the modules the device has).
#
#   scripts/device_site.sh [PYTHON_VERSION]     (default 3.12, the device's)
#
# The device image has torch, triton, transformers, httpx, jinja2, prometheus_client ... but not
# xgrammar (a core dependency), pydantic / fastapi / uvicorn (kiln serve), the openai client
# (the serve tests) or, maybe, nvidia-ml-py (kiln bench's GPU telemetry). The versions are the ones installed here, so that the device runs what CI
# tests. The wheels are unpacked and packed again as one .tar.xz: zipped wheels would not fit
# beside the tracked tree under the device call's 64 MiB (the xz is ~5.5 MB, the wheels ~9 MB).
set -euo pipefail
PY=${1:-3.12}
PACKAGES="xgrammar apache-tvm-ffi pydantic pydantic_core annotated_types typing_inspection
  opentelemetry-api fastapi starlette uvicorn sniffio openai httpx2 httpcore2 jiter truststore
  nvidia-ml-py"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
specs=()
for p in $PACKAGES; do
  v=$(python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] || { echo "$p is not installed here: pip install -e '.[test]' first" >&2; exit 1; }
  specs+=("$p==$v")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK/wheels" "${specs[@]}"
mkdir -p "$WORK/site"
for w in "$WORK"/wheels/*.whl; do python -m zipfile -e "$w" "$WORK/site"; done
# tvm-ffi's headers, sources and bundled third-party code serve only builds of extensions
rm -rf "$WORK"/site/tvm_ffi/{include,src,3rdparty}
mkdir -p .whl
tar cJf .whl/site.tar.xz -C "$WORK/site" .
ls -la .whl/site.tar.xz
