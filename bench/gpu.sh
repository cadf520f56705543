#!/usr/bin/env bash
# The GPU benchmarks, for a machine with one NVIDIA GPU and a copy of this working tree.
# Offline: it installs nothing from the network. It uses the first Python that has torch
# ($PYTHON, ./.venv/bin/python, python3, python); what the trainer needs beyond torch (pyyaml,
# pydantic, tqdm) comes from wheels carried in the tree (bench/.gpu-wheels, made here
# beforehand with --prepare) when that Python lacks it. Finishes in under 8 minutes (each step
# has a timeout; the sum of the timeouts is 460 s).
#
#   bench/gpu.sh --prepare    # on a machine with the package index: fill bench/.gpu-wheels (ignored
#                             # by git: carry it to the GPU machine with the tree)
#   bench/gpu.sh              # 1/4 the first minutes: NCCL init and network, checkpoint save
#                             #     (async vs sync) and load, a killed worker's warm restart, an
#                             #     interrupted vs an uninterrupted run (bench/gpu_path.py)
#                             # 2/4 gpt: textbook fp32 vs ours fp32/bf16 x compile off/on, MFU
#                             # 3/4 DataParallel vs DDP on the GPU(s); 4/4 the report
#   bench/gpu.sh --cpu-check  # no GPU: bash -n + shellcheck of this file, the Python parts shrunk
#                             # on CPU (tests/test_benches.py runs it)
#
# Results: bench/report/results/gpu_path.json, gpu.json and dp_vs_ddp_gpu.json (or
# $DDPKIT_BENCH_RESULTS), then bench/report/BENCHMARKS.md is regenerated. Copy them back.
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo" || exit 1
mode=gpu
for arg in "$@"; do
  case "$arg" in
    --cpu-check) mode=cpu ;;
    --prepare) mode=prepare ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
say() { printf '[gpu.sh %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

wheels="$repo/bench/.gpu-wheels"
needed=(pyyaml pydantic tqdm)  # numpy: every CUDA torch image has it (and its wheels are 17 MB each)
if [ "$mode" = prepare ]; then
  # Wheels for the CPython versions a GPU image may have; pure-Python ones once, pydantic-core
  # and numpy (compiled) for each. Nothing here runs on the GPU machine's network.
  mkdir -p "$wheels"
  for v in 3.10 3.11 3.12 3.13; do
    python3 -m pip download --quiet --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --python-version "$v" \
      --dest "$wheels" "${needed[@]}" || { echo "gpu.sh: pip download for Python $v failed" >&2; exit 1; }
  done
  say "wheels for Python 3.10-3.13 in $wheels ($(du -sh "$wheels" | cut -f1)); carry that folder with the tree"
  exit 0
fi

# -- which Python, and does it have torch (with CUDA)? -----------------------------------
python=""
for candidate in "${PYTHON:-}" "$repo/.venv/bin/python" python3 python; do
  [ -n "$candidate" ] || continue
  command -v "$candidate" >/dev/null 2>&1 || continue
  if "$candidate" -c 'import torch' >/dev/null 2>&1; then python="$candidate"; break; fi
  say "$candidate: $("$candidate" --version 2>&1), but no torch"
done
if [ -z "$python" ]; then
  echo "gpu.sh: NO PYTHON WITH TORCH FOUND (tried \$PYTHON, .venv/bin/python, python3, python)." >&2
  echo "gpu.sh: this script installs nothing (the GPU machine is offline): provide a Python with" >&2
  echo "gpu.sh: torch (CUDA build), pyyaml, pydantic and tqdm, e.g. PYTHON=/opt/conda/bin/python $0" >&2
  exit 3
fi
say "python: $python ($("$python" --version 2>&1))"
missing=$("$python" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("torch", "yaml", "pydantic", "tqdm", "numpy") if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "gpu.sh: $python lacks: $missing (needed by the trainer), and there are no carried wheels in" >&2
    echo "gpu.sh: $wheels: run 'bench/gpu.sh --prepare' where the package index is reachable, then copy it" >&2
    exit 3
  fi
  site=$(mktemp -d /tmp/ddpkit-gpu-site.XXXXXX)
  # shellcheck disable=SC2086  # $missing is a list of module names
  wanted=$(for m in $missing; do case "$m" in yaml) echo pyyaml ;; *) echo "$m" ;; esac; done)
  # shellcheck disable=SC2086
  "$python" -m pip install --quiet --no-index --find-links "$wheels" --target "$site" $wanted || {
    echo "gpu.sh: could not install $missing from $wheels for $("$python" --version 2>&1)" >&2; exit 3; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  say "installed $missing from the carried wheels into $site (for this run only)"
fi
"$python" - <<'EOF'
import torch
print(f"[gpu.sh] torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"[gpu.sh]   cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, "
              f"bf16 {torch.cuda.is_bf16_supported()}, NCCL {torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else 'missing'}")
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu --format=csv,noheader

if [ "$mode" = cpu ]; then
  say "CPU dry check: bash -n and shellcheck of this script, then the Python part shrunk"
  bash -n "$0" || exit 1
  if command -v shellcheck >/dev/null 2>&1; then shellcheck "$0" || exit 1
  elif [ -x "$repo/.venv/bin/shellcheck" ]; then "$repo/.venv/bin/shellcheck" "$0" || exit 1
  else say "shellcheck not found: skipped"; fi
  export DDPKIT_BENCH_RESULTS="${DDPKIT_BENCH_RESULTS:-$(mktemp -d)}"
  timeout 600 "$python" bench/gpu_path.py --cpu-check || exit 1
  timeout 600 "$python" bench/gpu_bench.py --cpu-check --workloads gpt || exit 1
  timeout 300 "$python" bench/dp_vs_ddp.py --steps 5 --repeats 1 --name dp_vs_ddp_cpu_check || exit 1
  say "CPU dry check passed (results in $DDPKIT_BENCH_RESULTS; figures meaningless)"
  exit 0
fi

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu.sh: torch sees no CUDA device: no GPU figures (use --cpu-check for a dry run)" >&2
  exit 4
fi
status=0
say "1/4 the first minutes: NCCL, checkpoints, a killed worker's warm restart (at most 3.5 min)"
timeout 210 "$python" bench/gpu_path.py || { status=$?; say "gpu_path failed ($status)"; }
say "2/4 gpt: textbook fp32 vs ddpkit fp32/bf16 x torch.compile off/on, MFU (at most 3.2 min)"
timeout 190 "$python" bench/gpu_bench.py --workloads gpt --quick --timeout 120 --budget 170 || { status=$?; say "gpu_bench failed ($status)"; }
say "3/4 DataParallel vs DDP on the GPU(s)"
timeout 60 "$python" bench/dp_vs_ddp.py --device cuda --steps 100 --repeats 2 --batch 256 || { status=$?; say "dp_vs_ddp failed ($status)"; }
say "4/4 report"
"$python" bench/report.py || status=$?
say "done (exit $status)"
exit "$status"
