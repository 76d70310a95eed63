#!/usr/bin/env bash
# The prepared GPU check: on any CUDA machine, with no network, in under 10 minutes.
#
#   benchmarks/gpu_check.sh [--out DIR] [--wheels DIR] [--cache DIR] [--python PY] [--dry-run]
#
#   --out DIR     where gpu_check.json, gpu_check.txt and the logs go (default: ./out/gpu-check)
#   --wheels DIR  wheels of the packages the machine lacks, installed with --no-index into a private
#                 folder (default: $FUSION_WHEELS, else ./.whl if present). On a machine with pip:
#                   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#                     $(grep -v '^#' benchmarks/gpu_wheels.txt)
#   --cache DIR   a model cache holding the default trio and its router ($FUSION_CACHE_DIR); without
#                 it only the three SmolLM2-sized experts (built here, random weights) are measured
#   --python PY   the interpreter that has torch with CUDA (default: python3)
#   --dry-run     check the machine and print the plan; run nothing
#
# Steps: 1. detect CUDA (exit 3 with a message if none); 2. install missing packages from the wheels;
# 3. the CUDA tests (pytest -m cuda: the captured static step against transformers' forward, replays from
# other threads, the trio on streams); 4. the local builds on one GPU (a CUDA stream each expert) through
# `fusion bench`'s suites, beside transformers' static-cache compiled `generate`: SmolLM2-sized experts, the
# same as one base with two adapters, then the default trio if cached; 5. a remote expert over loopback
# gRPC on the same GPU against it in-process, at 1, 8 and 32 sessions. Every step has a time limit (550 s
# in all); the figures land in OUT/gpu_check.json and OUT/gpu_check.txt.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="$repo/out/gpu-check"
wheels="${FUSION_WHEELS:-}"
cache="${FUSION_CACHE_DIR:-}"
python="python3"
dry_run=0

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --cache) cache="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$wheels" ] && [ -d "$repo/.whl" ]; then wheels="$repo/.whl"; fi

say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*"; }
fail() { echo "gpu_check: $1" >&2; exit "${2:-1}"; }

command -v "$python" >/dev/null 2>&1 || fail "no interpreter '$python' (give --python)" 2

# 1. CUDA
cuda_line="$("$python" - <<'EOF' 2>/dev/null
import torch
if torch.cuda.is_available():
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
)"
if [ -z "$cuda_line" ]; then
  fail "no CUDA device: '$python' has no torch with a visible GPU (torch.cuda.is_available() is False). This check needs a CUDA machine; the CPU suite is the plain test run." 3
fi
say "device: $cuda_line"

# 2. packages: install what is missing from the carried wheels into a private folder
site="${TMPDIR:-/tmp}/fusion-gpu-check-site"
missing="$("$python" - <<'EOF'
import importlib.metadata
import importlib.util
need = ["pydantic", "pydantic_core", "annotated_types", "typing_inspection", "yaml", "transformers",
        "tokenizers", "safetensors", "peft", "pytest"]
missing = [n for n in need if importlib.util.find_spec(n) is None]
# The runtime passes the cache to a model's forward as `cache=`, which transformers takes from 5.24.
if "transformers" not in missing:
    major, minor = (int(part) for part in importlib.metadata.version("transformers").split(".")[:2])
    if (major, minor) < (5, 24):
        missing.append("transformers>=5.24")
print(" ".join(missing))
EOF
)"
if [ "$dry_run" = 1 ]; then
  say "dry run: missing packages: ${missing:-none}; wheels: ${wheels:-none}; cache: ${cache:-none}; out: $out"
  say "dry run: would run pytest -m cuda, then benchmarks/gpu_check.py (SmolLM2-sized trio${cache:+, default trio})"
  exit 0
fi
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$missing" ]; then
  [ -n "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1 \
    || fail "missing packages ($missing) and no wheels to install them from (give --wheels DIR; see --help)" 4
  say "installing from $wheels: $missing"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl >"$out/pip.log" 2>&1 || fail "pip install from $wheels failed (see $out/pip.log)" 4
  export PYTHONPATH="$PYTHONPATH:$site"  # holds only the wheels given, meant for what the image lacks
fi
"$python" -c "import fusion.frontdoor.service, fusion.tools.bench" 2>"$out/import.log" \
  || fail "the runtime does not import (see $out/import.log)" 4

export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$out/inductor-cache}"
status=0

# 3. the CUDA tests (about a minute)
say "CUDA tests"
(cd "$repo" && timeout 120 "$python" -m pytest -q -m cuda -p no:cacheprovider tests/test_fast_decode.py \
  tests/test_static_step.py) \
  2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" = 0 ] || { say "CUDA tests failed (rc $tests_rc)"; status=1; }

# 4. the local builds on one GPU through the bench suites (about 5 minutes, captures and transformers'
# compilation included)
say "benchmarks"
(cd "$repo" && timeout 330 "$python" benchmarks/gpu_check.py --out "$out" --budget-s 300 ${cache:+--cache "$cache"}) \
  2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" = 0 ] || { say "benchmarks failed (rc $bench_rc)"; status=1; }

# 5. a remote expert over loopback gRPC on the same GPU against the same expert in-process, SmolLM2's
# shape and its 49,152-id vocabulary, at 1, 8 and 32 sessions (about a minute)
say "remote expert over loopback"
(cd "$repo" && timeout 100 "$python" benchmarks/bench_remote.py --device cuda --batch 1,8,32 --rounds 2 --steps 16 \
  --wire bfloat16 --json "$out/remote.json") 2>&1 | tee "$out/remote.log"
remote_rc=${PIPESTATUS[0]}
[ "$remote_rc" = 0 ] || { say "remote expert failed (rc $remote_rc)"; status=1; }

say "figures: $out/gpu_check.json, $out/gpu_check.txt $out/remote.json (tests rc $tests_rc, bench rc $bench_rc, remote rc $remote_rc)"
exit $status
