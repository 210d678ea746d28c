#!/usr/bin/env bash
# The GPU check on a stock PyTorch image that has only torch, lightning and transformers and no package
# index. Everything else the check imports (benchmarks/gpu_check_wheels.txt) is carried as one
# compressed tree; this project is used from the checkout.
#
#   bash benchmarks/gpu_check.sh --prepare DIR [--python 3.12]
#       where PyPI is reachable: fetch the listed wheels for that CPython (manylinux x86_64; pure-Python
#       sdists are built into wheels here), install them into a tree and pack it as DIR/site.tar.xz
#       (about 52 MiB: carry DIR to the GPU machine).
#   bash benchmarks/gpu_check.sh --wheels DIR [--out OUT] [--cpu-smoke] [other gpu_check.py flags]
#       no index: unpack DIR/site.tar.xz and run benchmarks/gpu_check.py with it on the path
#       (--cpu-smoke: the same at small sizes on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=benchmarks/gpu_check_wheels.txt
usage="usage: gpu_check.sh --prepare DIR [--python X.Y] | --wheels DIR [gpu_check.py flags]"
requirements() { grep -v '^#' "$LIST" | grep -v '^$'; }

case "${1:-}" in
  --prepare)
    [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
    dir=$2; shift 2
    version=3.12
    if [ "${1:-}" = --python ]; then version=$2; fi
    mkdir -p "$dir"
    wheels=$(mktemp -d) site=$(mktemp -d)
    trap 'rm -rf "$wheels" "$site"' EXIT
    target=(--only-binary=:all: --implementation cp --python-version "$version"
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    while read -r requirement; do
      python -m pip download -q --no-deps "${target[@]}" -d "$wheels" "$requirement" 2>/dev/null \
        || python -m pip wheel -q --no-deps -w "$wheels" "$requirement"  # published as an sdist only
    done < <(requirements)
    python -m pip install -q --no-deps --no-compile --no-index --find-links "$wheels" --target "$site" \
      "${target[@]}" -r <(requirements)
    tar -C "$site" -cJf "$dir/site.tar.xz" .
    echo "$dir/site.tar.xz: $(du -m "$dir/site.tar.xz" | cut -f1) MiB for CPython $version, $(requirements | wc -l) distributions"
    ;;
  --wheels)
    [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
    dir=$2; shift 2
    [ -f "$dir/site.tar.xz" ] || { echo "$dir/site.tar.xz is missing: run gpu_check.sh --prepare $dir where PyPI is reachable" >&2; exit 2; }
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    tar -C "$site" -xJf "$dir/site.tar.xz"
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/gpu_check.py "$@"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
