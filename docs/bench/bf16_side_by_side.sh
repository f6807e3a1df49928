#!/usr/bin/env bash
# Reference numbers, not part of stapo: `stapo bench train|generate` against PyTorch
# (docs/bench/torch_bf16.py) in f32 and bf16, side by side in one run.
#
#   docs/bench/bf16_side_by_side.sh STAPO PYTHON [SHAPE] [ROUNDS]
#
# STAPO is a release binary, PYTHON a throw-away virtualenv's python with torch and
# transformers, SHAPE `16.8m` (default: batch 8 x 128 updates, batch 8 x 64 new tokens)
# or `0.6b` (batch 1 x 2048 updates, batch 8 x 64 new tokens), ROUNDS (default 3).
# Each measurement is its own process. Every round runs each row's two sides back to
# back, stapo first in odd rounds and PyTorch first in even ones, so a drift in the
# machine's load falls on both. Prints each process's figure as it comes, then a table
# of medians and the ratio stapo / PyTorch (time ratio for updates: below 1 is faster;
# rate ratio for generation: above 1 is faster). PyTorch runs on 2 threads with
# OMP_WAIT_POLICY=PASSIVE (its better setting on a shared 2-core machine).
set -euo pipefail
stapo=${1:?usage: $0 STAPO PYTHON [SHAPE] [ROUNDS]}
py=${2:?usage: $0 STAPO PYTHON [SHAPE] [ROUNDS]}
shape=${3:-16.8m}
rounds=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
case "$shape" in
  16.8m) sshape=(); train=(--batch 8 --seq 128); ptrain=(--batch 8 --seq 128); reps=3 ;;
  0.6b) sshape=(--hidden 1024 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 3072 --vocab 151936)
        train=(--batch 1 --seq 2048); ptrain=(--batch 1 --seq 2048); reps=1 ;;
  *) echo "SHAPE must be 16.8m or 0.6b, got '$shape'" >&2; exit 2 ;;
esac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# One figure per process: seconds per update, or tokens per second.
stapo_row() { # what dtype
  local dt=(); [ "$2" = bf16 ] && dt=(--dtype bfloat16)
  if [ "$1" = train ]; then
    "$stapo" bench train "${sshape[@]}" "${train[@]}" --reps "$reps" "${dt[@]}" 2>&1 |
      awk '/^full update step  /{print $4 / 1000}'
  else
    "$stapo" bench generate "${sshape[@]}" --batch 8 --reps "$reps" "${dt[@]}" 2>&1 |
      awk '/^generate \(/{for(i=1;i<=NF;i++) if($i=="tok/s"){print $(i-1); exit}}'
  fi
}
torch_row() { # what dtype
  local extra=(); [ "$1" = train ] && extra=("${ptrain[@]}")
  OMP_WAIT_POLICY=PASSIVE "$py" "$here/torch_bf16.py" --what "$1" --dtype "$2" --shape "$shape" \
    --reps "$reps" "${extra[@]}" 2>&1 |
    awk '/^torch update/{print $(NF-1)} /^torch generate/{print $(NF-1)}'
}
one() { # side what dtype
  local v; v=$("$1_row" "$2" "$3")
  [ -n "$v" ] || { echo "no figure from $1 $2 $3" >&2; exit 1; }
  echo "$v" >>"$out/$1-$2-$3"
  printf '%s %-8s %-5s %s\n' "$(date +%T)" "$1 $2" "$3" "$v"
}
echo "# $(date -u +%FT%TZ) shape $shape, $rounds rounds, load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
  for row in "train f32" "train bf16" "generate f32" "generate bf16"; do
    if [ $((r % 2)) = 1 ]; then one stapo $row; one torch $row; else one torch $row; one stapo $row; fi
  done
done
median() { sort -g "$1" | awk '{a[NR]=$1} END{print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "# load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| $shape | stapo (median) | PyTorch (median) | stapo / PyTorch |"
echo "|---|---|---|---|"
for row in "train f32" "train bf16" "generate f32" "generate bf16"; do
  set -- $row
  s=$(median "$out/stapo-$1-$2"); t=$(median "$out/torch-$1-$2")
  unit=$([ "$1" = train ] && echo "s/update" || echo "tok/s")
  echo "| $1 $2 ($unit) | $s | $t | $(awk -v s="$s" -v t="$t" 'BEGIN{printf "%.2fx", s/t}') |"
done
