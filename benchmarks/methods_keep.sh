#!/usr/bin/env bash
# Keep what a methods_table.sh sweep has finished, for committing: per setting, the comparison's
# manifest and tables, and each finished run's config.yaml, summary.json and clients.npz (its per-client,
# per-class counts at the last evaluation, 2 KB: paired differences between methods; never checkpoints,
# metrics or partitions). A later sweep resumes from the kept cells: copy them back first,
#   cp -r DEST/. OUT_DIR/   then   benchmarks/methods_table.sh ... OUT_DIR ...   (finished cells are reused).
# Usage: benchmarks/methods_keep.sh [OUT_DIR] [DEST]   (defaults runs/methods, docs/results/methods)
set -euo pipefail
OUT=${1:-runs/methods}
DEST=${2:-docs/results/methods}
[ -d "$OUT" ] || { echo "$OUT: no sweep here" >&2; exit 1; }
kept=0
for setting in "$OUT"/*/; do
  name=$(basename "$setting")
  [ -f "$setting/comparison.json" ] || continue
  mkdir -p "$DEST/$name"
  # the table of the finished cells (a sweep cut midway has none, or an older one)
  python -c "import sys; from pfedkit.experiments.comparison import finished_records, write_seed_table; \
records = finished_records(sys.argv[1]); records and write_seed_table(__import__('pathlib').Path(sys.argv[1]), records)" "$setting"
  for file in comparison.json table.csv table.md; do
    [ -f "$setting/$file" ] && cp "$setting/$file" "$DEST/$name/"
  done
  for run in "$setting"/runs/*/; do
    [ -f "$run/summary.json" ] || continue   # unfinished: nothing to keep
    mkdir -p "$DEST/$name/runs/$(basename "$run")"
    cp "$run/config.yaml" "$run/summary.json" "$DEST/$name/runs/$(basename "$run")/"
    [ -f "$run/clients.npz" ] && cp "$run/clients.npz" "$DEST/$name/runs/$(basename "$run")/"
    kept=$((kept + 1))
  done
done
echo "kept $kept finished runs under $DEST"
