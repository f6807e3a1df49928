#!/usr/bin/env bash
# The GPU check: CPU-vs-CUDA parity on a small model, then update and
# generation benchmarks at the Qwen3-0.6B and 1.7B shapes, as one table.
# Sized to finish in about five minutes on one H200.
#
#   scripts/device_check.sh [path/to/stapo]
#
# The binary is a `--features cuda` build (`.ci/cuda-check` makes one in
# target-cuda/release/stapo; that is the default). It needs at run time the
# driver's libcuda.so.1 and the CUDA 13 libraries libcublas, libcublasLt,
# libcurand, libnvrtc and libcudart. On a machine without a system CUDA they
# are taken from the Python environment's `nvidia` packages (PyTorch's CUDA
# wheels), found with python3; LD_LIBRARY_PATH set by the caller comes first.
#
# Env: LOG_DIR (default device-check-logs; $OUT/logs when $OUT is set),
#      QUICK=1 (parity and the 0.6B rows only).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN="${1:-target-cuda/release/stapo}"
if [[ ! -x "$BIN" ]]; then
    echo "device_check: no executable at $BIN (build it with .ci/cuda-check)" >&2
    exit 2
fi
if [[ -n "${OUT:-}" ]]; then LOG_DIR="${LOG_DIR:-$OUT/logs}"; fi
LOG_DIR="${LOG_DIR:-device-check-logs}"
mkdir -p "$LOG_DIR"

# --- CUDA libraries -----------------------------------------------------------
py_libs=$(python3 - <<'EOF' 2>/dev/null
import glob, os
dirs = []
try:
    import nvidia
    for base in nvidia.__path__:
        for d in sorted(glob.glob(os.path.join(base, "*", "lib"))):
            if glob.glob(os.path.join(d, "lib*.so*")):
                dirs.append(d)
except ImportError:
    pass
print(":".join(dirs))
EOF
)
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [[ -e "$d/libcuda.so.1" ]] && py_libs="$py_libs:$d"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$py_libs"
echo "device_check: $BIN"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
if ldd "$BIN" | grep -q "not found"; then
    echo "device_check: libraries not found:" >&2
    ldd "$BIN" | grep "not found" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

# --- helpers ------------------------------------------------------------------
gpu_mem_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1; }

# run NAME TIMEOUT ARGS...: runs the binary, logs to $LOG_DIR/NAME.log, samples
# GPU memory every 100 ms; sets RC and PEAK_MIB (peak above the idle baseline).
run() {
    local name=$1 limit=$2
    shift 2
    local log="$LOG_DIR/$name.log" mem="$LOG_DIR/$name.mem"
    local base
    base=$(gpu_mem_used)
    : >"$mem"
    (while true; do gpu_mem_used >>"$mem"; sleep 0.1; done) &
    local sampler=$!
    local t0=$SECONDS
    timeout "$limit" "$BIN" "$@" >"$log" 2>&1
    RC=$?
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    WALL=$((SECONDS - t0))
    PEAK_MIB=$(sort -n "$mem" | tail -n 1)
    if [[ -n "$PEAK_MIB" && -n "$base" ]]; then PEAK_MIB=$((PEAK_MIB - base)); else PEAK_MIB="?"; fi
    echo "== $name (rc $RC, ${WALL}s, peak GPU +${PEAK_MIB} MiB): $BIN $*"
    tail -n 25 "$log"
}

why() { # the reason a row has no figure
    if [[ $RC -eq 124 ]]; then echo "timed out"; elif grep -qi "out of memory" "$LOG_DIR/$1.log"; then
        echo "out of GPU memory"
    else echo "failed (rc $RC, see $LOG_DIR/$1.log)"; fi
}

ROWS=()
row() { ROWS+=("$(printf '| %-34s | %-28s | %12s | %10s | %12s |' "$@")"); }

# --- 1. parity ------------------------------------------------------------------
FAILED=0
for dt in float32 bfloat16; do
    run "parity-$dt" 90 parity --device cuda --dtype "$dt"
    if [[ $RC -eq 0 ]]; then
        row "parity cuda $dt vs cpu f32" "16.8M shape, 8 x 96" "-" "-" "${PEAK_MIB} MiB"
    else
        FAILED=1
        row "parity cuda $dt vs cpu f32" "$(why "parity-$dt")" "-" "-" "-"
    fi
done

# --- 2. benchmarks --------------------------------------------------------------
SHAPE_06B="--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 3072 --vocab 151936"
SHAPE_17B="--layers 28 --hidden 2048 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 6144 --vocab 151936"

bench_train() { # name shape batch seq limit
    local name=$1 shape=$2 b=$3 s=$4 limit=$5
    # shellcheck disable=SC2086
    run "$name" "$limit" bench train $shape --batch "$b" --seq "$s" --reps 1 --device cuda --dtype float32
    local line
    line=$(grep -E "^full update step +[0-9.]+ ms" "$LOG_DIR/$name.log" | head -n 1)
    if [[ $RC -eq 0 && -n "$line" ]]; then
        local ms tps
        ms=$(awk '{print $4}' <<<"$line")
        tps=$(awk '{print $6}' <<<"$line")
        row "update f32 $name" "$b x $s tokens" "$tps" "$(awk -v m="$ms" 'BEGIN{printf "%.2f", m/1000}')" \
            "${PEAK_MIB} MiB"
    else
        row "update f32 $name" "$b x $s: $(why "$name")" "not measured" "not measured" "${PEAK_MIB} MiB"
    fi
}

bench_generate() { # name shape batch prompt new limit
    local name=$1 shape=$2 b=$3 p=$4 n=$5 limit=$6
    # shellcheck disable=SC2086
    run "$name" "$limit" bench generate $shape --batch "$b" --prompt "$p" --new-tokens "$n" --reps 1 \
        --device cuda --dtype bfloat16
    local tps
    tps=$(grep -oE "^generate .*: [0-9.]+ tok/s mean" "$LOG_DIR/$name.log" | grep -oE "[0-9.]+ tok/s" | awk '{print $1}')
    if [[ $RC -eq 0 && -n "$tps" ]]; then
        row "generate bf16 $name" "$b rows, $p + $n tokens" "$tps" \
            "$(awk -v t="$tps" -v k=$((b * n)) 'BEGIN{printf "%.2f", k/t}')" "${PEAK_MIB} MiB"
    else
        row "generate bf16 $name" "$b rows: $(why "$name")" "not measured" "not measured" "${PEAK_MIB} MiB"
    fi
}

bench_train 0.6B "$SHAPE_06B" 32 1024 75
bench_generate 0.6B-b64 "$SHAPE_06B" 64 128 256 30
bench_generate 0.6B-b256 "$SHAPE_06B" 256 128 256 40
if [[ "${QUICK:-0}" != 1 ]]; then
    bench_train 1.7B "$SHAPE_17B" 32 1024 90
    bench_generate 1.7B-b256 "$SHAPE_17B" 256 128 256 45
fi

# --- the table ------------------------------------------------------------------
echo
echo "device check: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $(date -u +%F)"
printf '| %-34s | %-28s | %12s | %10s | %12s |\n' "check" "setting" "tok/s" "step s" "peak GPU mem"
printf '|%s|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..36})" "$(printf -- '-%.0s' {1..30})" \
    "$(printf -- '-%.0s' {1..14})" "$(printf -- '-%.0s' {1..12})" "$(printf -- '-%.0s' {1..14})"
printf '%s\n' "${ROWS[@]}"
echo "(update: one train::update of the batch, f32 master weights, AdamW; tok/s counts all tokens."
echo " generate: sampled tokens/s, prefill included, T=1 device-side sampling; step s = one generate call."
echo " peak GPU mem: nvidia-smi memory.used above idle, sampled every 0.1 s.)"
exit $FAILED
