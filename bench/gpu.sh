#!/usr/bin/env bash
# The GPU benchmarks, for a machine with one NVIDIA GPU and a copy of this working tree.
# Self-contained and offline: it installs nothing; it uses the first Python that has torch
# with CUDA ($PYTHON, ./.venv/bin/python, python3, python) and says clearly when there is none.
# Prepared to finish in under 8 minutes (each run has a timeout; --quick halves the steps).
#
#   bench/gpu.sh              # gpt + cnn: textbook fp32 vs ours fp32/bf16 x compile off/on, MFU;
#                             # DataParallel vs DDP on the GPU(s); then the report
#   bench/gpu.sh --quick      # fewer steps
#   bench/gpu.sh --cpu-check  # no GPU: bash -n + shellcheck of this file, the Python part shrunk on CPU
#
# Results: bench/report/results/gpu.json and dp_vs_ddp_gpu.json (or $DDPKIT_BENCH_RESULTS),
# then bench/report/BENCHMARKS.md is regenerated. Copy them back with the working tree.
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo" || exit 1
mode=gpu
quick=()
for arg in "$@"; do
  case "$arg" in
    --cpu-check) mode=cpu ;;
    --quick) quick=(--quick) ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
say() { printf '[gpu.sh %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

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
  echo "gpu.sh: $python lacks: $missing (needed by the trainer); nothing is installed from the network" >&2
  exit 3
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
  timeout 600 "$python" bench/gpu_bench.py --cpu-check || exit 1
  timeout 300 "$python" bench/dp_vs_ddp.py --steps 5 --repeats 1 --name dp_vs_ddp_cpu_check || exit 1
  say "CPU dry check passed (results in $DDPKIT_BENCH_RESULTS; figures meaningless)"
  exit 0
fi

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu.sh: torch sees no CUDA device: no GPU figures (use --cpu-check for a dry run)" >&2
  exit 4
fi
status=0
say "1/3 gpt and cnn: textbook fp32 vs ddpkit fp32/bf16 x torch.compile off/on (at most 5.5 min)"
timeout 400 "$python" bench/gpu_bench.py "${quick[@]}" --timeout 150 --budget 330 || { status=$?; say "gpu_bench failed ($status)"; }
say "2/3 DataParallel vs DDP on the GPU(s)"
timeout 90 "$python" bench/dp_vs_ddp.py --device cuda --steps 100 --repeats 2 --batch 256 || { status=$?; say "dp_vs_ddp failed ($status)"; }
say "3/3 report"
"$python" bench/report.py || status=$?
say "done (exit $status)"
exit "$status"
