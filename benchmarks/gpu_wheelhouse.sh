#!/usr/bin/env bash
# Build, on a CPU machine with the package index, one folder of wheels holding everything the GPU
# suite (benchmarks/gpu_suite.py) needs beyond what the lent GPU machine's image already has, so no
# device minute goes to installing:
#
#   bash benchmarks/gpu_wheelhouse.sh [FOLDER]      # default: wheelhouse/ (git-ignored)
#   bash benchmarks/gpu_wheelhouse.sh --dry-run     # resolve and list, download nothing
#
# mega's packages and plugins are built as wheels; pip then resolves their dependencies, with
# torchao, liger-kernel and the server's, for the GPU machine's Python (3.12, manylinux x86_64),
# treating the packages of benchmarks/gpu_machine_packages.txt as installed (small stand-in
# records in a throwaway environment), and downloads what remains. On the GPU machine:
#
#   python3 -m pip install --no-index --find-links wheelhouse mega-core mega-models mega-data \
#       mega-ckpt-convert mega-inference mega-torchao mega-liger liger-kernel
#
# The folder must stay under 60 MiB (the device tool carries 64 MiB with the working tree): the
# script fails if it does not.
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0; out=wheelhouse
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) out=$arg ;;
  esac
done
target=(--python-version 3.12 --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python=${PYTHON:-python3}
# The GPU machine keeps its own torch: the development pin (nox sets PIP_CONSTRAINT to constraints.txt)
# would make pip replace the image's torch with the pinned one and carry CUDA wheels.
unset PIP_CONSTRAINT
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

# A throwaway environment whose only "installed" packages are the GPU image's, as stand-in records.
"$python" -m venv "$work/env"
"$work/env/bin/python" -m pip install -q --disable-pip-version-check -U "pip>=23.3"  # --dry-run --report
site=$("$work/env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
grep -E '^[A-Za-z0-9_.-]+==' benchmarks/gpu_machine_packages.txt | while IFS='=' read -r name _ version; do
  record="$site/${name//-/_}-$version.dist-info"
  mkdir -p "$record"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" >"$record/METADATA"
  echo gpu-image >"$record/INSTALLER"; : >"$record/RECORD"
done

# mega's own distributions: every package and plugin of the repository.
sources=(packages/* plugins/*)
"$work/env/bin/python" -m pip install -q --disable-pip-version-check --dry-run --report "$work/report.json" \
    "${target[@]}" "${sources[@]/#/./}" 'liger-kernel>=0.5.3'
"$work/env/bin/python" - "$work/report.json" >"$work/pins.txt" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for item in report["install"]:
    meta = item["metadata"]
    if "dir_info" not in item["download_info"]:  # mega's own sources are built below, not downloaded
        print(f"{meta['name']}=={meta['version']}")
PY
echo "to carry ($(wc -l <"$work/pins.txt") from the index, plus ${#sources[@]} of mega's):"
sed 's/^/  /' "$work/pins.txt"
if [ "$dry_run" = 1 ]; then
  echo "dry run: resolved; nothing downloaded"
  exit 0
fi
mkdir -p "$out"
"$work/env/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "${sources[@]/#/./}"
if [ -s "$work/pins.txt" ]; then
  "$work/env/bin/python" -m pip download -q --disable-pip-version-check --no-deps "${target[@]}" -d "$out" \
      -r "$work/pins.txt"
fi
size=$(du -sm "$out" | cut -f1)
echo "$out: $(ls "$out" | wc -l) wheels, ${size} MiB"
if [ "$size" -ge 60 ]; then
  echo "gpu_wheelhouse: $out is ${size} MiB, over the 60 MiB the device tool can carry" >&2
  exit 1
fi
