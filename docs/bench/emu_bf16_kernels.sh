#!/usr/bin/env bash
# A developer check, not part of stapo or of .ci/run: runs the machine code of
# the AMX and AVX-512 BF16 matmul kernels (host/src/model/fused/mm_bf16.rs) in the Bochs
# x86 emulator, on a CPU without either, and checks every product against f64.
#
#   docs/bench/emu_bf16_kernels.sh [VENV]
#
# Builds the library as a cdylib with the `emu-entry` feature (target/release/libstapo.so:
# entry points that run a whole product with no OS), makes a throw-away virtualenv VENV
# (default /tmp/emuvenv) with bochscpu-python 0.4.0, pyelftools and numpy, and runs
# docs/bench/emu_bf16_kernels.py on the library: a table of shapes x paths with the error
# and its bound, exit status 0 when all pass. Needs python3, binutils (as, objcopy, nm,
# objdump) and, where glibc is older than 2.38, a C compiler (see below). What the
# emulator does and does not check (AMX instructions run on the script's SDM model, as
# the wheel's Bochs has no AMX): the docstring of the .py and docs/performance.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${1:-/tmp/emuvenv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q bochscpu-python==0.4.0 pyelftools numpy
(cd "$root" && cargo rustc --release --locked -p stapo --lib --features emu-entry --crate-type cdylib)
lib=$root/target/release/libstapo.so
# The wheel is linked against glibc >= 2.38 (__isoc23_strtoull, __isoc23_sscanf); on an
# older glibc (Debian 12: 2.36) a two-function shim forwards them to the C99 versions.
preload=
if ! "$venv/bin/python" -c "import bochscpu" 2>/dev/null; then
  preload=$venv/isoc23_shim.so
  if [ ! -f "$preload" ]; then
    cat >"$venv/isoc23_shim.c" <<'EOF'
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
int __isoc23_sscanf(const char *s, const char *f, ...) {
  va_list a;
  va_start(a, f);
  int r = vsscanf(s, f, a);
  va_end(a);
  return r;
}
EOF
    cc -shared -fPIC -O2 "$venv/isoc23_shim.c" -o "$preload"
  fi
fi
LD_PRELOAD=$preload "$venv/bin/python" "$here/emu_bf16_kernels.py" "$lib"
