#!/usr/bin/env bash
# The GPU check: CPU-vs-CUDA parity on a small model, then update and
# generation benchmarks at the Qwen3-0.6B and 1.7B shapes, including the
# paper's shape of work (an update of 8 x 8192 tokens at 1.7B, rollouts of
# 256 rows x 4096 new tokens at 0.6B), as one table with peak GPU memory.
# Sized for 15 minutes on a GPU machine: at most BUDGET_S (default 570) seconds
# of commands, each row with its own time limit; a row that the remaining
# budget cannot hold is reported as not run.
#
#   scripts/device_check.sh [path/to/stapo | path/to/stapo.xz]
#   scripts/device_check.sh --pack [path/to/stapo]
#
# The binary is a `--features cuda` build (`.ci/cuda-check` makes one in
# target-cuda/release/stapo; that is the default). `--pack` compresses it with
# xz into target-cuda/stapo.xz for copying to the GPU machine and prints what
# is copied (the tracked and untracked-but-not-ignored files, plus the packed
# binary) against a 64 MiB transfer limit (LIMIT_MIB); given a `.xz`, the check unpacks it into
# a temporary folder first (xz, else python3's lzma). At run time the binary
# needs the driver's libcuda.so.1 and the CUDA 13 libraries libcublas,
# libcublasLt, libcurand, libnvrtc and libcudart. On a machine without a
# system CUDA they are taken from the Python environment's `nvidia` packages
# (PyTorch's CUDA wheels), found with python3; LD_LIBRARY_PATH set by the
# caller comes first.
#
# Env: LOG_DIR (default device-check-logs; $OUT/logs when $OUT is set),
#      BUDGET_S (seconds of commands, default 570),
#      QUICK=1 (parity, the 0.6B update and generate rows, and a 64 x 8 rollout at 0.6B),
#      HOST_CPU=1 (first: the GPU machine's host CPU: `stapo bench kernels` where the binary has
#      it, `bench train` and `bench generate` in f32 and bf16 at the 16.8M shape, and PyTorch's
#      docs/bench/torch_bf16.py beside them where python3 can import torch and transformers),
#      GPU=0 (skip the GPU rows), SKIP_TRAIN=1 (skip the update rows),
#      PEAK_TFLOPS (the device's dense bf16 peak for MFU; known GPUs are looked up by name).
# The roofline column: for rollouts the share of the bandwidth bound (the bytes a decode step
# must read, weights and live keys and values, over the step time, over the bandwidth of a
# device-to-device copy), for updates MFU (model FLOPs per second over the dense bf16 peak);
# the same work through PyTorch/transformers (docs/bench/torch_device.py) follows each
# row where python3 imports torch and transformers.
set -uo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=64
PACKED=target-cuda/stapo.xz

# --pack: compress the binary, measure what travels, fail when over the limit.
if [[ "${1:-}" == "--pack" ]]; then
    bin="${2:-target-cuda/release/stapo}"
    [[ -x "$bin" ]] || { echo "device_check --pack: no executable at $bin" >&2; exit 2; }
    mkdir -p "$(dirname "$PACKED")"
    xz -9 -T0 -c "$bin" >"$PACKED.tmp" && mv "$PACKED.tmp" "$PACKED" || exit 2
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
        awk '{s += $1} END {print s + 0}')
    raw=$(stat -c %s "$bin")
    packed=$(stat -c %s "$PACKED")
    total=$((tree + packed))
    mb() { awk -v b="$1" 'BEGIN{printf "%.1f MB", b / 1e6}'; }
    echo "binary $(mb "$raw") -> $PACKED $(mb "$packed"); tree $(mb "$tree"); total $(mb "$total")" \
        "(limit $LIMIT_MIB MiB = $(mb $((LIMIT_MIB << 20))))"
    if ((total >= LIMIT_MIB << 20)); then
        echo "device_check --pack: what is copied exceeds $LIMIT_MIB MiB" >&2
        exit 1
    fi
    echo "copy $PACKED with the tree; on the GPU machine: scripts/device_check.sh $PACKED"
    exit 0
fi

BIN="${1:-target-cuda/release/stapo}"
if [[ "$BIN" == *.xz ]]; then
    [[ -f "$BIN" ]] || { echo "device_check: no file at $BIN" >&2; exit 2; }
    unpacked="$(mktemp -d)/stapo"
    if command -v xz >/dev/null 2>&1; then
        xz -dc "$BIN" >"$unpacked"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$BIN" "$unpacked"
    fi || { echo "device_check: cannot unpack $BIN" >&2; exit 2; }
    chmod +x "$unpacked"
    echo "device_check: unpacked $BIN to $unpacked"
    BIN="$unpacked"
fi
if [[ ! -x "$BIN" ]]; then
    echo "device_check: no executable at $BIN (build it with .ci/cuda-check)" >&2
    exit 2
fi
if [[ -n "${OUT:-}" ]]; then LOG_DIR="${LOG_DIR:-$OUT/logs}"; fi
LOG_DIR="${LOG_DIR:-device-check-logs}"
mkdir -p "$LOG_DIR"
BUDGET_S="${BUDGET_S:-570}"
START=$SECONDS

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

# --- functions ----------------------------------------------------------------
gpu_mem_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1; }

# run NAME TIMEOUT ARGS...: runs the binary, logs to $LOG_DIR/NAME.log, samples
# GPU memory and utilisation every 100 ms; sets RC, PEAK_MIB (peak above the idle
# baseline) and UTIL (mean utilisation).
# A row whose limit the remaining budget cannot hold gets the rest of it, and
# none (RC 125, "not run") under 15 s.
run() {
    local name=$1 limit=$2
    shift 2
    local log="$LOG_DIR/$name.log" mem="$LOG_DIR/$name.mem"
    local left=$((BUDGET_S - (SECONDS - START)))
    ((left < limit)) && limit=$left
    if ((limit < 15)); then
        RC=125 PEAK_MIB="-" WALL=0 UTIL="-"
        echo "== $name: not run (${left}s of the ${BUDGET_S}s budget left)" | tee "$log"
        return
    fi
    local base
    base=$(gpu_mem_used)
    : >"$mem"
    (while true; do
        nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits 2>/dev/null |
            head -n 1 | tr -d ' ' | tr ',' ' ' >>"$mem"
        sleep 0.1
    done) &
    local sampler=$!
    local t0=$SECONDS
    timeout "$limit" "$BIN" "$@" >"$log" 2>&1
    RC=$?
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    WALL=$((SECONDS - t0))
    PEAK_MIB=$(awk '{print $1}' "$mem" | sort -n | tail -n 1)
    # Mean GPU utilisation over the row: low means the host (launches, copies) is the bound.
    UTIL=$(awk 'NF > 1 {s += $2; n++} END {if (n) printf "%.0f%%", s / n; else print "?"}' "$mem")
    if [[ -n "$PEAK_MIB" && -n "$base" ]]; then PEAK_MIB=$((PEAK_MIB - base)); else PEAK_MIB="?"; fi
    echo "== $name (rc $RC, ${WALL}s, peak GPU +${PEAK_MIB} MiB, mean GPU utilisation $UTIL): $BIN $*"
    tail -n 25 "$log"
}

why() { # the reason a row has no figure
    if [[ $RC -eq 125 ]]; then echo "not run (budget spent)"; elif [[ $RC -eq 124 ]]; then
        echo "timed out"
    elif grep -qi "out of memory" "$LOG_DIR/$1.log"; then
        echo "out of GPU memory"
    else echo "failed (rc $RC, see $LOG_DIR/$1.log)"; fi
}

ROWS=()
row() { # CHECK SETTING TOKS SECS MEM [ROOFLINE]
    ROWS+=("$(printf '| %-34s | %-28s | %12s | %10s | %12s | %-28s |' "$1" "$2" "$3" "$4" "$5" "${6:-not measured}")")
}

# The dense bf16 tensor peak of the GPU, in TFLOP/s (PEAK_TFLOPS overrides; empty when unknown).
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
case "$gpu_name" in
    *H200*) PEAK=989 ;;
    *H100*PCIe*) PEAK=756 ;;
    *H100*) PEAK=989 ;;
    *A100*) PEAK=312 ;;
    *L4*) PEAK=121 ;;
    *) PEAK="" ;;
esac
PEAK="${PEAK_TFLOPS:-$PEAK}"
TORCH=0
python3 -c 'import torch, transformers' 2>/dev/null && TORCH=1

# torch_row NAME LIMIT LABEL SETTING ARGS...: the same work through PyTorch/transformers, a row
# with its tokens/s and the share of the bound it printed ("not measured" without torch).
torch_row() {
    local name=$1 limit=$2 label=$3 setting=$4
    shift 4
    if [[ $TORCH != 1 ]]; then
        row "$label" "$setting" "not measured" "-" "-" "not measured (no torch)"
        return
    fi
    local left=$((BUDGET_S - (SECONDS - START)))
    ((left < limit)) && limit=$left
    if ((limit < 15)); then
        row "$label" "$setting: not run (budget)" "not measured" "-" "-" "not measured"
        return
    fi
    timeout "$limit" python3 docs/bench/torch_device.py "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$? line
    line=$(grep -E "^torch (rollout|update)" "$LOG_DIR/$name.log" | tail -n 1)
    echo "== $name (rc $rc): $line"
    if [[ $rc -eq 0 && -n "$line" ]]; then
        row "$label" "$setting" "$(grep -oE "[0-9]+ tok/s" <<<"$line" | awk '{print $1}')" \
            "$(grep -oE "[0-9.]+ s," <<<"$line" | awk '{print $1}')" "-" \
            "$(grep -oE "(MFU [0-9.]+%|[0-9.]+% of the bandwidth bound)" <<<"$line" | sed 's/ of the bandwidth bound/ of bw bound/')"
    else
        row "$label" "$setting: failed (rc $rc)" "not measured" "-" "-" "not measured"
    fi
}

# --- 0. the host CPU (HOST_CPU=1) ------------------------------------------------
FAILED=0
if [[ "${HOST_CPU:-0}" == 1 ]]; then
    grep -o -w 'amx_bf16\|amx_tile\|avx512_bf16\|avx512f\|avx2' /proc/cpuinfo | sort | uniq -c
    echo "cpus: $(nproc); python3: $(python3 --version 2>&1)"
    torch_ok=0
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
        && torch_ok=1
    if "$BIN" bench --help 2>/dev/null | grep -q -- "- kernels:"; then
        run cpu-kernels 60 bench kernels
        [[ $RC -eq 0 ]] || FAILED=1
    fi
    run cpu-train-float32 60 bench train --device cpu --dtype float32
    run cpu-generate-float32 60 bench generate --device cpu --dtype float32
    # bf16 on each path: AMX and AVX-512 BF16 are chosen only after their self-check passes (mm_bf16::verify); this is the full check.
    for p in amx avx512bf16 avx2; do
        STAPO_CPU_PATH=$p run "cpu-train-bfloat16-$p" 60 bench train --device cpu --dtype bfloat16
        STAPO_CPU_PATH=$p run "cpu-generate-bfloat16-$p" 60 bench generate --device cpu --dtype bfloat16
    done
    if [[ $torch_ok == 1 ]]; then
        for what in train generate; do
            for dt in f32 bf16; do
                echo "== torch $what $dt"
                timeout 90 python3 docs/bench/torch_bf16.py --what "$what" --dtype "$dt" --threads "$(nproc)" \
                    >"$LOG_DIR/torch-$what-$dt.log" 2>&1
                tail -n 3 "$LOG_DIR/torch-$what-$dt.log"
            done
        done
    fi
fi
[[ "${GPU:-1}" == 0 ]] && exit $FAILED

# --- 1. parity ------------------------------------------------------------------
for dt in float32 bfloat16; do
    run "parity-$dt" 45 parity --device cuda --dtype "$dt"
    if [[ $RC -eq 0 ]]; then
        row "parity cuda $dt vs cpu f32" "16.8M shape, 8 x 96" "-" "${WALL}" "${PEAK_MIB} MiB"
    else
        FAILED=1
        row "parity cuda $dt vs cpu f32" "$(why "parity-$dt")" "-" "-" "-"
    fi
done

# --- 2. benchmarks --------------------------------------------------------------
SHAPE_06B="--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 3072 --vocab 151936"
SHAPE_17B="--layers 28 --hidden 2048 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 6144 --vocab 151936"

# bench_train NAME SHAPE BATCH SEQ LIMIT WARMUP: one process, WARMUP untimed
# updates then one timed `train::update` (f32 master weights, AdamW, half of
# each sequence response), via the one-length table of `bench train`.
bench_train() {
    [[ "${SKIP_TRAIN:-0}" == 1 ]] && return
    local name=$1 shape=$2 b=$3 s=$4 limit=$5 warmup=$6
    # shellcheck disable=SC2086
    run "$name" "$limit" bench train $shape --batch "$b" --seq "$s" --table --warmup "$warmup" --reps 1 \
        --device cuda --dtype float32
    local line
    line=$(grep -E "^ +$s +[0-9]+ +[0-9.]+ +[0-9]+ " "$LOG_DIR/$name.log" | head -n 1)
    if [[ $RC -eq 0 && -n "$line" ]]; then
        local secs tps
        secs=$(awk '{print $3}' <<<"$line")
        tps=$(awk '{print $4}' <<<"$line")
        local tflops mfu="not measured (peak unknown)"
        tflops=$(grep -oE "model FLOPs at seq $s: .* ([0-9.]+) TFLOP/s" "$LOG_DIR/$name.log" | grep -oE "[0-9.]+ TFLOP/s" | awk '{print $1}')
        [[ -n "$PEAK" && -n "$tflops" ]] &&
            mfu=$(awk -v f="$tflops" -v p="$PEAK" 'BEGIN{printf "MFU %.1f%% (of %d bf16)", 100 * f / p, p}')
        row "update f32 $name" "$b x $s tokens, warm-up $warmup" "$tps" "$secs" "${PEAK_MIB} MiB" "$mfu"
    else
        row "update f32 $name" "$b x $s: $(why "$name")" "not measured" "not measured" "${PEAK_MIB} MiB"
    fi
}

# bench_generate NAME SHAPE BATCH PROMPT NEW LIMIT: one long-answer run of
# `bench generate --long` (after a warm-up of 8 tokens); peak GPU memory also
# per row of the batch.
bench_generate() {
    local name=$1 shape=$2 b=$3 p=$4 n=$5 limit=$6
    # shellcheck disable=SC2086
    run "$name" "$limit" bench generate $shape --batch "$b" --prompt "$p" --new-tokens 8 --long "$n" \
        --reps 1 --device cuda --dtype bfloat16
    local tps
    tps=$(grep -oE "^generate long .*: [0-9.]+ tok/s" "$LOG_DIR/$name.log" | grep -oE "[0-9.]+ tok/s" | awk '{print $1}')
    local per_row="-"
    [[ "$PEAK_MIB" =~ ^[0-9]+$ ]] && per_row=$(awk -v m="$PEAK_MIB" -v b="$b" 'BEGIN{printf "%.0f", m / b}')
    if [[ $RC -eq 0 && -n "$tps" ]]; then
        row "generate bf16 $name" "$b rows, $p + $n tokens" "$tps" \
            "$(awk -v t="$tps" -v k=$((b * n)) 'BEGIN{printf "%.1f", k/t}')" "${PEAK_MIB} MiB, ${per_row}/row"
    else
        row "generate bf16 $name" "$b rows x $n: $(why "$name")" "not measured" "not measured" \
            "${PEAK_MIB} MiB"
    fi
}

# bench_rollout NAME SHAPE PROMPTS LENGTHS MAX GB LIMIT: one rollout of PROMPTS x 8 responses of
# forced lognormal lengths with the paged engine alone (continuous batching, 256 rows, a
# cache budget of GB).
bench_rollout() {
    local name=$1 shape=$2 np=$3 lengths=$4 max=$5 gb=$6 limit=$7
    # shellcheck disable=SC2086
    run "$name" "$limit" bench rollout $shape --paged-only --prompts "$np" --samples 8 --lengths "$lengths" \
        --max-new "$max" --paged-rows 256 --kv-cache-gb "$gb" --device cuda --dtype bfloat16
    local tps
    tps=$(grep -oE "^rollout \(paged only\): [0-9.]+ tok/s" "$LOG_DIR/$name.log" | grep -oE "[0-9.]+ tok/s" | awk '{print $1}')
    local bound
    bound=$(grep -oE "[0-9.]+% of the bandwidth bound" "$LOG_DIR/$name.log" | tail -n 1 | sed 's/ of the bandwidth bound/ of bw bound/')
    local budget
    # The decode path (`kernels, fused projections` by default: 11 launches per layer) and its counts.
    budget=$(grep -oE "decode \([^)]*\): [0-9]+ steps, [0-9.]+ launches per layer .*, [0-9.]+ copies to the host per step" \
        "$LOG_DIR/$name.log" | tail -n 1)
    [[ -n "$budget" ]] && echo "   decode budget: $budget"
    if [[ $RC -eq 0 && -n "$tps" ]]; then
        row "rollout bf16 $name" "$np x 8, $lengths" "$tps" "${WALL}" "${PEAK_MIB} MiB" "${bound:-not measured}"
    else
        row "rollout bf16 $name" "$np x 8: $(why "$name")" "not measured" "not measured" "${PEAK_MIB} MiB"
    fi
}

if [[ "${QUICK:-0}" != 1 ]]; then
    bench_train 0.6B "$SHAPE_06B" 32 1024 60 1
    bench_generate 0.6B-b256 "$SHAPE_06B" 256 128 256 40
else
    # Smaller and with more time: the first run on a GPU (2026-12-04) timed both out.
    bench_train 0.6B-8x1024 "$SHAPE_06B" 8 1024 90 1
    bench_generate 0.6B-b256 "$SHAPE_06B" 256 128 256 60
fi
[[ "${SKIP_TRAIN:-0}" == 1 ]] ||
    torch_row torch-update-0.6B 90 "torch update bf16 0.6B" "8 x 1024 tokens, warm-up 1" \
        --what update --shape 0.6b --batch 8 --seq 1024 --peak-tflops "${PEAK:-0}"
torch_row torch-generate-0.6B 60 "torch generate bf16 0.6B" "256 rows, 128 + 256 tokens" \
    --what rollout --shape 0.6b --rows 256 --prompt 128 --new 256
if [[ "${QUICK:-0}" != 1 ]]; then
    # The paper's shape of work; the first update of a fresh process (no warm-up).
    bench_train 1.7B-8x8192 "$SHAPE_17B" 8 8192 180 0
    [[ "${SKIP_TRAIN:-0}" == 1 ]] ||
        torch_row torch-update-1.7B 120 "torch update bf16 1.7B" "8 x 8192 tokens, warm-up 1" \
            --what update --shape 1.7b --batch 8 --seq 8192 --peak-tflops "${PEAK:-0}"
fi
if [[ "${QUICK:-0}" != 1 ]]; then
    bench_generate 0.6B-256x4096 "$SHAPE_06B" 256 128 4096 210
    # The paper's rollout: 2048 responses, lognormal lengths up to 8k, a ~100 GB cache. Last, so it
    # gets what the rows above leave of the budget (raise BUDGET_S to give it the whole 150 s).
    bench_rollout 0.6B-2048-lognormal "$SHAPE_06B" 256 lognormal:500:8000 8192 100 150
else
    # The 0.6B rollout row: 64 prompts x 8, lognormal:100:4000 (the log has the peak host RSS).
    bench_rollout 0.6B-512-lognormal "$SHAPE_06B" 64 lognormal:100:4000 4096 20 150
fi

# --- the table ------------------------------------------------------------------
echo
echo "device check: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $(date -u +%F)"
printf '| %-34s | %-28s | %12s | %10s | %12s | %-28s |\n' "check" "setting" "tok/s" "step s" "peak GPU mem" "roofline"
printf '|%s|%s|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..36})" "$(printf -- '-%.0s' {1..30})" \
    "$(printf -- '-%.0s' {1..14})" "$(printf -- '-%.0s' {1..12})" "$(printf -- '-%.0s' {1..14})" \
    "$(printf -- '-%.0s' {1..30})"
printf '%s\n' "${ROWS[@]}"
echo "(update: one train::update of the batch after the stated warm-up updates, f32 master weights,"
echo " AdamW, composed ops (the only ones CUDA has); tok/s counts all tokens. generate: sampled tokens/s,"
echo " prefill included, T=1 device-side sampling; step s = one generate call. rollout: the paged engine's"
echo " sampled tokens/s with forced lengths; step s = wall time. parity: step s = wall time."
echo " roofline: rollouts, the decode steps' share of the bandwidth bound (bytes a step must read over"
echo " its time over a device copy's bandwidth); updates, MFU against the dense bf16 peak (${PEAK:-unknown} TFLOP/s;"
echo " the stapo updates here run in f32); torch rows: docs/bench/torch_device.py, the same work."
echo " peak GPU mem: nvidia-smi memory.used above idle, sampled every 0.1 s; commands took"
echo " $((SECONDS - START)) s of the ${BUDGET_S} s budget.)"
exit $FAILED
