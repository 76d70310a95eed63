#!/usr/bin/env bash
# llama-cpp-py-sync's prebuilt wheels (the `llamacpp-wheel` extra) link four C23 functions of glibc 2.38
# (__isoc23_sscanf, __isoc23_strtol, ...); on an older glibc (Debian 12 has 2.36) their libraries do not
# load. For benchmarks only: this marks those version requirements weak in the installed libraries and
# builds a shim that forwards the C23 names to the classic functions (they differ only in reading "0b"
# prefixes). Then run the benchmark with the shim preloaded:
#
#   bash benchmarks/llamacpp_wheel_old_glibc.sh
#   LD_PRELOAD=$HOME/.cache/fusion/isoc23-shim.so fusion bench --suites weights
set -euo pipefail
python=${PYTHON:-python}
package=$("$python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llama_cpp_py_sync").origin))')
shim=${FUSION_CACHE_DIR:-$HOME/.cache/fusion}/isoc23-shim.so
mkdir -p "$(dirname "$shim")"
cat > "$shim.c" <<'C'
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
int __isoc23_sscanf(const char *s, const char *format, ...) {
    va_list args;
    va_start(args, format);
    int n = vsscanf(s, format, args);
    va_end(args);
    return n;
}
long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
long long __isoc23_strtoll(const char *s, char **end, int base) { return strtoll(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }
C
gcc -O2 -shared -fPIC "$shim.c" -o "$shim"
"$python" - "$package" <<'PY'
import struct, sys
from pathlib import Path

WANTED = b"GLIBC_2.38"
for path in sorted(Path(sys.argv[1]).glob("*.so*")):
    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    weakened = 0
    for _, kind, _, _, offset, _, link, count, _, _ in sections:
        if kind != 0x6FFFFFFE:  # SHT_GNU_verneed: the versions each needed library must define
            continue
        strings, entry = sections[link][4], offset
        for _ in range(count):
            _, aux_count, _, aux, following = struct.unpack_from("<HHIII", data, entry)
            at = entry + aux
            for _ in range(aux_count):
                _, flags, _, name, step = struct.unpack_from("<IHHII", data, at)
                if bytes(data[strings + name:data.index(0, strings + name)]) == WANTED:
                    struct.pack_into("<H", data, at + 4, flags | 0x2)  # VER_FLG_WEAK
                    weakened += 1
                at += step
            entry += following
    if weakened:
        path.write_bytes(bytes(data))
        print(f"{path.name}: {WANTED.decode()} requirement weakened")
PY
echo "preload $shim when running llama-cpp-py-sync"
