#!/usr/bin/env bash
# Several pfedkit runs at once on a lent GPU machine, in one call of the device tool, each from a
# config.yaml (e.g. a committed docs/results/.../config.yaml) with overrides; their run directories
# (metrics.csv, written after every round, and summary.json once finished; no checkpoints) and logs
# come back as $OUT/runs.tar.gz. Usage, from the repository root on that machine:
#
#   LIMIT=470 benchmarks/device_runs.sh DATA_DIR 'CONFIG key=value ...' ['cpu: CONFIG key=value ...' ...]
#
# One quoted argument per run, all started together. `cpu:` hides the GPU from that run (use
# backend=processes workers=N to give it N of the machine's cores); the others take device=auto,
# i.e. the GPU (backend=vectorized there: sequential is launch-bound). Each run gets `timeout LIMIT`
# seconds (default 470; give the tool's timeout_s some 60 s more), then the archive is written.
# Setup the machine lacks (see docs/results.md, "Runs on a lent GPU"): pydantic's wheels, carried in .whl/,
# and the data, carried in an ignored folder of the checkout (DATA_DIR); CIFAR-10 (117 MB) is over
# the tool's 64 MiB, MNIST and Fashion-MNIST travel.
set -u
DATA=$1; shift
if ! python3 -c "import pydantic" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/device-runs}; mkdir -p "$WORK/logs"
OUT_DIR=${OUT:-.}

one() {  # index, spec
  local index=$1 spec=$2
  if [[ $spec == cpu:* ]]; then spec=${spec#cpu:}; export CUDA_VISIBLE_DEVICES=""; fi  # this run's subshell only
  # shellcheck disable=SC2086  # the spec is a config path and key=value words
  timeout "${LIMIT:-470}" python3 -m pfedkit.cli run -q $spec out_dir="$WORK" data_dir="$DATA" > "$WORK/logs/run$index.log" 2>&1
  echo "run $index exit $? after $SECONDS s: $spec"
}

index=0
for spec in "$@"; do index=$((index + 1)); one $index "$spec" & done
( while sleep 60; do
    for f in "$WORK"/*/metrics.csv; do [ -f "$f" ] && echo "t=$SECONDS s $(basename "$(dirname "$f")"): $(tail -1 "$f" | cut -d, -f1) rounds"; done
  done ) &
monitor=$!
for _ in "$@"; do wait -n; done
kill $monitor
tar czf "$OUT_DIR/runs.tar.gz" --exclude=checkpoints --exclude=client_states -C "$WORK" .
ls -la "$OUT_DIR/runs.tar.gz"
