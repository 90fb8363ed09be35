#!/usr/bin/env bash
# Builds .devcarry/, the ignored folder a device call carries for benchmarks/gpu.sh (that machine has
# Python 3.12, torch, numpy, pandas, scipy, scikit-learn, h5py, torchvision..., no network, and
# neither pydantic nor ray):
#   .devcarry/site.tar.xz        pydantic, ray and the requirements of both that the image lacks, from
#                                cp312 manylinux x86_64 wheels, unzipped (a wheel is a zip) into one
#                                tree; gpu.sh setup unpacks it into /tmp/site. Ray loses what a local
#                                ray.init() with actors never loads (Java jars, RLlib, Tune, Train,
#                                Data, Serve, LLM, source maps): 70 MiB of wheel -> ~20 MiB of xz.
#   .devcarry/data/mnist/        MNIST in pfedkit's format, with its SHA256SUMS line
#   .devcarry/pfllib/system/     PFLlib's system/ folder (the anchor; benchmarks/conformance/README.md)
# Usage, from the repository root, where pip can download:
#   benchmarks/devcarry.sh PFLLIB_CHECKOUT [DATA_DIR]      (DATA_DIR default ../shared/datasets)
# WHEELS=DIR reuses (and fills) a folder of downloaded wheels. Then `benchmarks/gpu.sh size`, and the
# call names .devcarry in its carry list.
set -euo pipefail
PFLLIB=${1:?usage: benchmarks/devcarry.sh PFLLIB_CHECKOUT [DATA_DIR]}
DATA=${2:-../shared/datasets}
PY=${PYTHON:-python3}
[ -f "$PFLLIB/system/main.py" ] || { echo "$PFLLIB: no system/main.py (a PFLlib checkout)"; exit 1; }
[ -f "$DATA/mnist/mnist.npz.xz" ] || { echo "$DATA: no mnist/mnist.npz.xz"; exit 1; }

# pydantic's pin of pydantic-core is exact; typing-extensions and attrs travel too, since the image's
# versions are not known to meet pydantic's (>= 4.14.1) and referencing's (>= 22.2) floors.
PACKAGES=(pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
          typing-extensions==4.15.0 ray==2.55.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
          referencing==0.37.0 rpds-py==0.30.0 attrs==25.4.0)
# Ray's parts that a local ray.init() and actors do not import
RAY_UNUSED=(jars rllib tune train data serve llm)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
WHEELS=${WHEELS:-$WORK/wheels}
mkdir -p "$WHEELS" "$WORK/site"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEELS" "${PACKAGES[@]}"
for package in "${PACKAGES[@]}"; do
  name=${package%%==*}; version=${package#*==}
  wheels=("$WHEELS/${name//-/_}-$version"-*.whl)
  [ -f "${wheels[0]}" ] || { echo "no wheel for $package in $WHEELS"; exit 1; }
  unzip -q -o "${wheels[0]}" -d "$WORK/site"
done
for data in "$WORK"/site/*.data; do  # a wheel's purelib/platlib belong at the top of the tree
  [ -d "$data" ] || continue
  for part in purelib platlib; do
    [ -d "$data/$part" ] && cp -a "$data/$part/." "$WORK/site/"
  done
  rm -rf "$data"
done
for part in "${RAY_UNUSED[@]}"; do rm -rf "$WORK/site/ray/$part"; done
find "$WORK/site" \( -name '*.map' -o -name __pycache__ \) -prune -exec rm -rf {} +
for program in ray/core/src/ray/raylet/raylet ray/core/src/ray/gcs/gcs_server; do
  [ -x "$WORK/site/$program" ] || { echo "$program: missing or not executable"; exit 1; }
done

mkdir -p .devcarry/data/mnist .devcarry/pfllib
tar --owner=0 --group=0 --sort=name -C "$WORK/site" -cf - . | xz -9 -T1 > .devcarry/site.tar.xz
cp "$DATA/mnist/mnist.npz.xz" .devcarry/data/mnist/
if [ -f "$DATA/SHA256SUMS" ]; then
  grep '  mnist/mnist.npz.xz$' "$DATA/SHA256SUMS" > .devcarry/data/SHA256SUMS || rm -f .devcarry/data/SHA256SUMS
fi
rm -rf .devcarry/pfllib/system
cp -r "$PFLLIB/system" .devcarry/pfllib/
find .devcarry/pfllib -name __pycache__ -prune -exec rm -rf {} +
chmod -R u+w .devcarry

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.devcarry/' "$exclude" 2>/dev/null || echo '/.devcarry/' >> "$exclude"
du -sh .devcarry/* | sed 's/^/  /'
