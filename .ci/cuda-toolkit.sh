# Sourced by .ci/cuda-check (and by hand: `source .ci/cuda-toolkit.sh`): puts a
# CUDA 13.0 toolkit from PyPI into a cache folder and exports what candle's
# build scripts read, so that `cargo build --features cuda` works on a machine
# with no GPU and no system CUDA.
#
# Why 13.0: the first GPU machine this is built for (an H200, driver 580)
# carries the CUDA 13 runtime libraries in its Python environment
# (libcublas.so.13, libcurand.so.10, libnvrtc.so.13, libcudart.so.13), and a
# driver of the 580 series loads PTX up to ISA 9.0, which is what nvcc 13.0
# writes. A binary linked against these sonames runs there unchanged.
#
# The wheels hold no libcuda.so (that is the driver's); the link gets a stub
# that defines every `cu*` entry point named in cuda.h, with the soname
# libcuda.so.1, so the binary loads the real driver at run time.
#
# NCCL 2.32 (nvidia-nccl-cu13) comes along for `--features cuda,nccl` builds.
#
# With STAPO_CUDA_PIECES=compiler only what `cargo check --features cuda` and
# the kernels' NVRTC check need is installed (nvcc and its front ends, ptxas,
# the runtime headers, CCCL, and NVRTC in a folder of its own), into its own
# folder; linking needs the full set.
#
# Env: STAPO_CUDA_HOME (default ~/.cache/stapo-cuda), CUDA_COMPUTE_CAP (90),
#      STAPO_CUDA_PIECES (all | compiler; default all).

# Installs the wheels named into folder $1 (once: a stamp names what is there).
stapo_cuda_pip() {
    local py="$1"
    shift
    local stamp="$py/.stapo-installed"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$*" ]]; then
        echo "cuda-toolkit: installing $* into $py"
        rm -rf "$py"
        mkdir -p "$(dirname "$py")"
        # Status 3: the toolkit could not be fetched (no python3/pip, no PyPI): nothing was checked.
        command -v python3 >/dev/null 2>&1 || { echo "cuda-toolkit: no python3 to install it with" >&2; return 3; }
        python3 -m pip install --quiet --disable-pip-version-check --no-cache-dir --target "$py" "$@" ||
            { echo "cuda-toolkit: pip could not install $*" >&2; return 3; }
        echo "$*" >"$stamp"
    fi
}

stapo_cuda_setup() {
    local home="${STAPO_CUDA_HOME:-$HOME/.cache/stapo-cuda}"
    local pieces="${STAPO_CUDA_PIECES:-all}"
    local py="$home/py13.0"
    local pkgs=(
        nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
    )
    case "$pieces" in
    all) pkgs+=(nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.1.0.3 nvidia-curand==10.4.0.35 nvidia-nccl-cu13==2.32.3) ;;
    compiler) py="$home/py13.0-compiler" ;;
    *)
        echo "cuda-toolkit: STAPO_CUDA_PIECES must be 'all' or 'compiler', not '$pieces'" >&2
        return 2
        ;;
    esac
    local root="$py/nvidia/cu13"
    stapo_cuda_pip "$py" "${pkgs[@]}" || return
    # NVRTC for the kernels' compile check (.ci/cuda-check --check): the compiler pieces take it
    # from a folder of its own (so that adding it left their folder as it was), linked beside them.
    if [[ $pieces == compiler ]]; then
        local nv="$home/py13.0-nvrtc"
        stapo_cuda_pip "$nv" nvidia-cuda-nvrtc==13.0.88 || return
        for f in "$nv"/nvidia/cu13/lib/libnvrtc*.so*; do
            [[ -e "$root/lib/$(basename "$f")" ]] || ln -s "$f" "$root/lib/$(basename "$f")"
        done
    fi
    # NCCL (for `--features cuda,nccl`) ships in its own folder: put it beside the rest.
    if [[ -d "$py/nvidia/nccl/lib" ]]; then
        for f in "$py"/nvidia/nccl/lib/libnccl.so.*; do
            [[ -e "$root/lib/$(basename "$f")" ]] || ln -s "$f" "$root/lib/$(basename "$f")"
        done
        [[ -e "$root/include/nccl.h" ]] || ln -s "$py/nvidia/nccl/include/nccl.h" "$root/include/nccl.h"
    fi
    # Link names (-lcublas finds libcublas.so, the wheels ship only libcublas.so.13).
    local f base
    for f in "$root"/lib/lib*.so.*; do
        base="${f%%.so.*}.so"
        [[ -e "$base" ]] || ln -s "$(basename "$f")" "$base"
    done
    # The driver stub.
    if [[ ! -f "$root/lib/stubs/libcuda.so" ]]; then
        mkdir -p "$root/lib/stubs"
        grep -oE '\bcu[A-Z][A-Za-z0-9_]*' "$root/include/cuda.h" | sort -u |
            sed 's/.*/void &(void) {}/' >"$root/lib/stubs/cuda_stub.c"
        cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" \
            "$root/lib/stubs/cuda_stub.c" || return 1
    fi
    # The binary asks for the soname; running it here (its CPU path) finds the stub.
    [[ -e "$root/lib/stubs/libcuda.so.1" ]] || ln -s libcuda.so "$root/lib/stubs/libcuda.so.1"
    export CUDA_ROOT="$root" CUDA_PATH="$root" CUDA_HOME="$root"
    export PATH="$root/bin:$PATH"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    nvcc --version | tail -n 2
}

stapo_cuda_setup
