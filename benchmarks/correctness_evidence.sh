#!/usr/bin/env bash
# Issue 12 evidence: DA-PFL lambda sweep and the FedReMa swing with fresh vs kept momentum.
# Usage: benchmarks/correctness_evidence.sh [DATA_DIR] [OUT_DIR] [PART...]   (PART: dapfl_lambda fedrema_swing)
set -euo pipefail
DATA=${1:-../shared/datasets}
OUT=${2:-runs/correctness}
shift 2 || true
PARTS=${*:-dapfl_lambda fedrema_swing}
COMMON="data_dir=$DATA out_dir=$OUT backend=processes workers=2 seed=0 -q"

for part in $PARTS; do
  case $part in
  dapfl_lambda)  # MNIST, 20 clients, Dirichlet 0.1, FedAvgCNN, B=10, E=1, SGD 0.01, 10 rounds: Local and lambda 0.1 / 1 / 10
    MNIST="dataset=mnist model=cnn num_clients=20 partition.scheme=dirichlet partition.alpha=0.1 batch_size=10 lr=0.01 local_epochs=1 rounds=10"
    pfedkit run $COMMON $MNIST algorithm=local name=lam-local
    for lam in 0.1 1 10; do
      pfedkit run $COMMON $MNIST algorithm=dapfl dapfl.lam=$lam name=lam-$lam
    done ;;
  fedrema_swing)  # the audit's collapse: MNIST group_dominant s=0.2, E=1, B=100, SGD 0.01 mom 0.9 clip 10, 12 rounds
    SWING="dataset=mnist model=cnn num_clients=20 partition.scheme=group_dominant partition.s=0.2 partition.samples_per_client=600 partition.train_ratio=0.8 batch_size=100 lr=0.01 momentum=0.9 grad_clip=10 drop_last=true local_epochs=1 rounds=12"
    for keep in false true; do
      pfedkit run $COMMON $SWING algorithm=fedrema keep_optimizer_state=$keep name=swing-fedrema-keep-$keep
      pfedkit run $COMMON $SWING algorithm=fedavg keep_optimizer_state=$keep name=swing-fedavg-keep-$keep
    done ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
