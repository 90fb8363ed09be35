#!/usr/bin/env bash
# The methods table of docs/results.md ("Every method beside FedAvg and Local"): each algorithm on
# MNIST and CIFAR-10, Dirichlet 0.1 and pathological 2 classes per client, 20 clients, FedAvgCNN,
# PFLlib's defaults (B = 10, E = 1, lr 0.005), the cpu budget of ROUNDS rounds, over SEEDS.
# One `pfedkit compare` directory per dataset and partition; each resumes where it stopped, so the
# sweep can be killed and started again (finished runs are kept).
# Usage: benchmarks/methods_table.sh [DATA_DIR] [OUT_DIR] [ALGORITHMS|all] [SEEDS] [key=value ...]
#   e.g. benchmarks/methods_table.sh ../shared/datasets runs/methods all 0-2
#        SETTINGS="mnist-dir0.1" benchmarks/methods_table.sh ../shared/datasets runs/methods fedavg,local 0
#        SETTINGS="fashion_mnist-dir0.1 fashion_mnist-pat2" ... (the settings of PFLlib's leaderboard, whose
#        numbers benchmarks/methods_published.yaml holds; DATASET-PARTITION, DATASET as in pfedkit list)
# The table: python benchmarks/methods_table.py OUT_DIR
set -euo pipefail
DATA=${1:-../shared/datasets}
OUT=${2:-runs/methods}
ALGOS=${3:-all}
SEEDS=${4:-0-2}
shift 4 || shift $#
ROUNDS=${ROUNDS:-20}
SETTINGS=${SETTINGS:-"mnist-dir0.1 mnist-pat2 cifar10-dir0.1 cifar10-pat2"}
if [ "$ALGOS" = all ]; then
  ALGOS=$(python -c "from pfedkit.algorithms import algorithm_names; print(','.join(algorithm_names()))")
fi
COMMON="data_dir=$DATA backend=processes workers=2 model=cnn num_clients=20 batch_size=10 local_epochs=1 lr=0.005 rounds=$ROUNDS"
declare -A PARTITIONS=(
  [dir0.1]="partition.scheme=dirichlet partition.alpha=0.1"
  [pat2]="partition.scheme=pathological partition.classes_per_client=2"
)
for setting in $SETTINGS; do
  dataset=${setting%%-*}
  part=${setting#*-}
  echo "== $setting: $ALGOS, seeds $SEEDS, $ROUNDS rounds"
  pfedkit compare -q --algorithms "$ALGOS" --seeds "$SEEDS" --out "$OUT/$setting" \
    $COMMON dataset="$dataset" ${PARTITIONS[$part]} "$@"
done
