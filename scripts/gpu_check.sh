#!/usr/bin/env bash
# The prepared device check (issue 37): on a machine with an NVIDIA GPU, installs what the
# GPU run needs where it can, runs every `gpu`-marked test and the GPU figures
# (benchmarks/transport.py --device cuda, benchmarks/engine.py --device cuda,
# benchmarks/hop.py), all inside 8 minutes, and prints one JSON object as its last line.
#
#   bash scripts/gpu_check.sh            # from the repository root
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# GPU_CHECK_ONLY="tests transport" runs only those steps (of install-*, tests, transport,
# engine, hop). Without a GPU it says so and exits 2 (the JSON line says "no_gpu"). A step that fails
# (an install without network, a benchmark) prints one line naming it and the rest go on.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-}
if [[ -z $PYTHON ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
SMI=${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}
OUT=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
START=$(date +%s)
DEADLINE=$((START + 480)) # 8 minutes in all

say() { echo "gpu_check: $*" >&2; }
left() { echo $((DEADLINE - $(date +%s))); }
# step NAME SECONDS CMD...: run with a timeout no later than the deadline; log to $OUT/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n ${GPU_CHECK_ONLY:-} && " $GPU_CHECK_ONLY " != *" $name "* ]]; then return 0; fi
  local budget
  budget=$(left)
  ((budget < limit)) && limit=$budget
  if ((limit < 10)); then
    say "skip $name: the 8-minute budget is spent"
    echo skipped >"$OUT/$name.rc"
    return 0
  fi
  say "$name (up to ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo $rc >"$OUT/$name.rc"
  ((rc != 0)) && say "$name failed (exit $rc): last lines of $OUT/$name.log:" && tail -5 "$OUT/$name.log" >&2
  return 0
}

if ! gpu=$("$SMI" --query-gpu=name,pci.bus_id,memory.total --format=csv,noheader 2>/dev/null) || [[ -z $gpu ]]; then
  say "no NVIDIA GPU here ($SMI not found or lists none): the GPU tests and figures are still to be run"
  echo '{"gpu_check": "no_gpu", "gpu": null}'
  exit 2
fi
say "GPU: $gpu"

# Installs: each may fail (no network on the device machine); the check goes on without it.
for pkg in "cupy-cuda12x>=13"; do
  if "$PYTHON" -c "import cupy" 2>/dev/null; then continue; fi
  step "install-${pkg%%[>=]*}" 120 "$PYTHON" -m pip install -q "$pkg" ||
    true
  "$PYTHON" -c "import cupy" 2>/dev/null || say "skip install $pkg: not installable here (see $OUT)"
done
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "torch in $PYTHON has no CUDA (a CPU build?); install a CUDA torch for the GPU run"
fi

step tests 200 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
step transport 90 "$PYTHON" benchmarks/transport.py --device cuda --sizes 1,8,64,512 --rounds 5
step engine 120 "$PYTHON" benchmarks/engine.py --device cuda --rounds 3 --requests 16
step hop 60 "$PYTHON" benchmarks/hop.py --calls 2000 --rounds 4

"$PYTHON" - "$OUT" "$gpu" "$START" <<'PY'
import json, pathlib, re, sys, time

out, gpu, start = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
result = {"gpu_check": "ran", "gpu": gpu, "logs": str(out)}
for name in ("tests", "transport", "engine", "hop"):
    rc = (out / f"{name}.rc").read_text().strip() if (out / f"{name}.rc").exists() else "absent"
    log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").exists() else ""
    entry = {"rc": rc}
    if name == "tests":
        counts = re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", log)
        entry.update({kind: int(n) for n, kind in counts})
    else:
        lines = [l for l in log.splitlines() if l.startswith("{")]
        try:
            entry["result"] = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            entry["result"] = None
    result[name] = entry
result["seconds"] = round(time.time() - start, 1)
print(json.dumps(result))
PY
