#!/usr/bin/env bash
# The one device check (issue 45, acceptance 4); every result goes to $OUT (default ./gpu_check_out).
#
#   benchmarks/gpu_check.sh           on a GPU machine: backend parity on cuda, CUDA graphs vs eager (ops, and
#                                     the engine's decode: tests/engine/test_graph_runner.py), the engine on
#                                     cuda (tests/engine/test_device.py), tiny-config throughput vs HF
#                                     transformers on the same GPU. Budget: under 8 minutes on one H100.
#   benchmarks/gpu_check.sh --cpu     the same script end to end on a CPU box: Triton kernels under the
#                                     interpreter (TRITON_INTERPRET=1), a short throughput run; NOT a GPU measurement.
#
# Needs: torch (CUDA build on a GPU), k3serve's dependencies, and for the GPU backends the [gpu] extra
# (triton: comes with CUDA torch; flash-linear-attention + fla-core + einops: pure Python), transformers for
# the HF comparison. The device machine has no internet: put wheels in $WHEELS (e.g. shared/wheels, made with
# `pip download flash-linear-attention fla-core einops transformers -d shared/wheels`) and they are installed
# from there with --no-index first. A missing package skips its steps and says so in summary.txt.
# Files: env.txt, summary.txt (one line per step: name, exit code, seconds), <step>.log, parity.xml /
# graphs.xml / engine_graphs.xml / device.xml (junit), throughput.json.
set -u
MODE=gpu
case "${1:-}" in
  --cpu) MODE=cpu ;;
  "") ;;
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
  *) echo "gpu_check.sh: unknown argument '$1' (use --cpu or nothing)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
: > "$OUT/summary.txt"

if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
  $PY -m pip install --no-index --find-links "$WHEELS" flash-linear-attention fla-core einops transformers \
    > "$OUT/pip.log" 2>&1 || echo "pip install from $WHEELS failed (see pip.log)" >> "$OUT/summary.txt"
fi

$PY - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for m in ("triton", "fla", "transformers", "einops"):
    spec = importlib.util.find_spec(m)
    v = None
    if spec is not None:
        try:
            v = __import__(m).__version__
        except Exception as e:  # a broken install is a finding, not a crash
            v = f"import failed: {e}"
    print(m, v)
EOF
cat "$OUT/env.txt"
have() { $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

if [ "$MODE" = gpu ]; then
  if ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check.sh: no CUDA GPU visible to torch (use --cpu for the interpreter run)" | tee -a "$OUT/summary.txt"
    exit 1
  fi
  export K3SERVE_TEST_DEVICE=cuda
  unset TRITON_INTERPRET
else
  export TRITON_INTERPRET=1
  unset K3SERVE_TEST_DEVICE
fi

# step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, one summary line; never stops the script. The
# limits fit the GPU run's 8 minutes; the interpreter on a (shared) CPU box gets $SLOW times as long.
SLOW=1
[ "$MODE" = cpu ] && SLOW=${SLOW_FACTOR:-5}
step() {
  local name=$1 limit=$(($2 * SLOW)); shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${MODE} $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
}

PYTEST=($PY -m pytest -q -p no:cacheprovider)
# 1. every GPU backend against its torch form / naive spec (interpreter on CPU; fla chunk_kda on GPU only)
if have triton; then
  step parity 240 "${PYTEST[@]}" tests/ops/test_triton_mxfp4.py tests/ops/test_kda_fla.py tests/ops/test_kda_split.py \
    --junitxml="$OUT/parity.xml" -rs
else
  echo "parity skipped: triton not installed" | tee -a "$OUT/summary.txt"
fi
have fla || echo "fla parity skipped: flash-linear-attention not installed (test_kda_fla.py skips)" | tee -a "$OUT/summary.txt"

# 2. CUDA graphs: replay == eager at every bucket including 1 (skips itself without a GPU)
step graphs 120 "${PYTEST[@]}" tests/engine/test_cuda_graphs.py --junitxml="$OUT/graphs.xml" -rs

# 2b. the engine's decode through graphs (engine/graph_runner.py): on a GPU real CUDA graphs == the same static
# forward run eagerly, bit for bit, at every bucket including 1 (and == the eager engine's tokens in fp32); on
# CPU the stand-in under the host-sync check == the eager engine
step engine_graphs 240 "${PYTEST[@]}" tests/engine/test_graph_runner.py --junitxml="$OUT/engine_graphs.xml" -rs

# 3. the whole engine on the device (fp32 and bf16 logprobs against the CPU fp32 run)
if [ "$MODE" = gpu ]; then
  step device 180 "${PYTEST[@]}" tests/engine/test_device.py --junitxml="$OUT/device.xml" -rs
fi

# 4. throughput of the tiny configs, k3serve vs HF transformers generate on the same device
if [ "$MODE" = gpu ]; then
  TP=(--device cuda --dtype bfloat16 --num-requests 64 --hf-batch-sizes 16,64)
else
  TP=(--device cpu --dtype float32 --num-requests 2 --hf-batch-sizes 2)
fi
have transformers || TP+=(--skip-hf)
step throughput 300 $PY benchmarks/throughput.py "${TP[@]}" --json "$OUT/throughput.json"

echo "results in $OUT"
! grep -q "rc=[1-9]" "$OUT/summary.txt"
