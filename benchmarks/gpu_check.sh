#!/usr/bin/env bash
# Every GPU check in one command, for a short GPU lease (one H100/H200, no network):
#   1. install the wheels the machine lacks (.whl/, from `make gpu-wheels`) into $GPU_CHECK_SITE (/tmp/site)
#   2. environment: nvidia-smi, versions, GPU name, which kernels hf_packing finds
#   3. `pytest -m gpu` (log, junit xml)
#   4. benchmarks/bench_gpu.py on the full Qwen2.5-VL-3B-shaped model (padded vs flat vs rmpad), 8k packs, frozen tower
#   5. benchmarks/bench_levers.py: the step's levers (checkpointing all / every 2nd / off, compiled layers, fused AdamW,
#      Liger's inner kernels, FA3) at 8k and 16k, frozen then trained tower, as the time budget allows; each arm's
#      MFU, peak memory against the memory model's prediction and a profiler summary
#   6. a summary: stage status and seconds, test counts and failures, the bench table and host syncs, and the sync
#      gate (`set_sync_debug_mode("error")`) of both: bench_gpu's patched arms and pytest's patched-step test, each
#      failure with its origin (in backward: the autograd node and the forward line that created it)
# Each stage has its own timeout and a failed stage does not stop the next; the whole run ends in under 8 minutes
# (timeouts 20 + 10 + 45 + 180 + 80 + 120 = 455 s; about 5 minutes expected on an H100). Outputs go to $OUT/gpu/ (gpu_out/
# when OUT is unset): env.txt, pytest.log, junit.xml, bench.log, levers.log, RESULTS.md (the updated benchmarks/RESULTS.md), any
# png the bench wrote, summary.txt.
# Exit status 0 when every stage passed.
#
# Run: `make gpu` or `bash benchmarks/gpu_check.sh` in the repository root (builds no .venv).
# CPU dry run of the shell logic: GPU_CHECK_DRY=1 (no wheel install; the benches with --smoke / --dry: nothing written).
# Overrides: PYTHON (python3), GPU_CHECK_TESTS (pytest paths: tests), GPU_CHECK_BENCH_ARGS (bench_gpu.py flags),
# GPU_CHECK_LEVERS_ARGS (bench_levers.py flags), GPU_CHECK_SITE (/tmp/site), GPU_CHECK_TIMEOUT_TESTS (180 s),
# GPU_CHECK_TIMEOUT_BENCH (80 s; dry 200), GPU_CHECK_TIMEOUT_LEVERS (120 s; dry 300).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY:-0}
SITE=${GPU_CHECK_SITE:-/tmp/site}
DIR=${OUT:+$OUT/gpu}
DIR=${DIR:-gpu_out}
TESTS=${GPU_CHECK_TESTS:-tests}
if [ "$DRY" = 1 ]; then
    BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---smoke --lengths 256 --vision frozen}
    LEVERS_ARGS=${GPU_CHECK_LEVERS_ARGS:---dry --vision trainable}
    LIMIT_BENCH=200 LIMIT_LEVERS=300  # a CPU check, not a lease: a busy CPU may need longer than a GPU
else
    LIMIT_BENCH=80 LIMIT_LEVERS=120
    # full 3.75B model; the padded / flat / rmpad comparison of both pack sizes and towers is in RESULTS.md already:
    # one setting here (8k, frozen tower), the rest of the lease for the levers
    BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---lengths 8192 --vision frozen --warmup 1 --steps 2 --time-budget 60}
    # --time-budget skips a setting predicted to end after 95 s (8k / 16k frozen first: the issue's MFU targets)
    LEVERS_ARGS=${GPU_CHECK_LEVERS_ARGS:---lengths 8192 16384 --warmup 1 --steps 2 --time-budget 95}
fi
mkdir -p "$DIR"
rm -f "$DIR"/{env.txt,pytest.log,junit.xml,bench.log,levers.log,RESULTS.md,summary.txt} "$DIR"/*.png
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
STAMP=$(mktemp)
T0=$(date +%s)
STATUS=()
FAILED=0

# stage NAME SECONDS LOG CMD...: run CMD under `timeout`, output to the console and appended to LOG
stage() {
    local name=$1 limit=$2 log=$3 t rc
    shift 3
    t=$(date +%s)
    echo "=== $name (timeout ${limit}s) ==="
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    record "$name" "$rc" $(($(date +%s) - t))
}

# record NAME RC SECONDS
record() {
    local state=ok
    if [ "$2" = 124 ] || [ "$2" = 137 ]; then
        state="TIMEOUT"
    elif [ "$2" != 0 ]; then
        state="FAIL (rc $2)"
    fi
    [ "$state" = ok ] || FAILED=1
    STATUS+=("$(printf '%-8s %-14s %4ss' "$1" "$state" "$3")")
}

# 1. wheels
shopt -s nullglob
WHEELS=(.whl/*.whl)
if [ "$DRY" = 1 ]; then
    STATUS+=("$(printf '%-8s %-14s %4ss' wheels 'skipped (dry)' 0)")
elif [ ${#WHEELS[@]} = 0 ]; then
    echo "no .whl/*.whl: run 'make gpu-wheels' before the lease (test modules importing datasets cannot be collected)"
    record wheels 1 0
else
    stage wheels 20 "$DIR/env.txt" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "${WHEELS[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 2. environment
{ timeout 10 nvidia-smi || echo "nvidia-smi: not available"; } 2>&1 | tee -a "$DIR/env.txt"
stage env 45 "$DIR/env.txt" "$PY" - <<'EOF'
import importlib.metadata as md
import platform

import torch

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"

names = ["torch", "transformers", "accelerate", "datasets", "pyarrow", "fsspec", "huggingface-hub", "peft", "numpy",
         "tokenizers", "triton", "flash-attn", "flash-linear-attention", "liger-kernel"]
print(f"python {platform.python_version()}; " + ", ".join(f"{n} {version(n)}" for n in names))
print(f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}, "
          f"{props.multi_processor_count} SMs")
import hf_packing
from hf_packing import _compat
print(f"hf_packing from {hf_packing.__file__}; transformers supported: {_compat.check_transformers_version()}")
print(f"kernels: torch varlen_attn {_compat.torch_varlen_attn() is not None} {sorted(_compat.torch_varlen_params())}; "
      f"flash_attn {_compat.flash_attn_varlen_module() is not None}; fla {_compat.fla_linear_ops() is not None}")
import datasets  # noqa: E402,F401  (last: from the carried wheels; test modules that import it need it)
EOF

# 3. GPU tests (each test at most 90 s; modules that fail to import do not stop the others)
stage tests "${GPU_CHECK_TIMEOUT_TESTS:-180}" "$DIR/pytest.log" "$PY" -m pytest -m gpu -p no:cacheprovider -q -s -rs \
    --continue-on-collection-errors -o timeout=90 --junitxml "$DIR/junit.xml" $TESTS

# 4. the GPU benchmark (writes its section of benchmarks/RESULTS.md unless --smoke / --no-write)
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
stage bench "${GPU_CHECK_TIMEOUT_BENCH:-$LIMIT_BENCH}" "$DIR/bench.log" "$PY" benchmarks/bench_gpu.py $BENCH_ARGS

# 5. the levers (writes its section of benchmarks/RESULTS.md unless --dry / --no-write)
# shellcheck disable=SC2086
stage levers "${GPU_CHECK_TIMEOUT_LEVERS:-$LIMIT_LEVERS}" "$DIR/levers.log" "$PY" benchmarks/bench_levers.py $LEVERS_ARGS
[ benchmarks/RESULTS.md -nt "$STAMP" ] && cp benchmarks/RESULTS.md "$DIR/"
find benchmarks -maxdepth 1 -name '*.png' -newer "$STAMP" | head -n 2 | xargs -r cp -t "$DIR"
rm -f "$STAMP"

# 6. summary, printed last
{
    echo
    echo "=== summary ==="
    grep -h "host syncs per step" "$DIR/bench.log" 2>/dev/null | cut -c1-400
    # the sync gate (set_sync_debug_mode("error")): bench_gpu's patched arms, then pytest's gate test per case
    grep -h "^\[gpu\] sync gate" "$DIR/bench.log" 2>/dev/null | cut -c1-600
    grep -h "^sync gate " "$DIR/pytest.log" 2>/dev/null | cut -c1-600
    sed -n '/^## GPU training step/,$p' "$DIR/bench.log" 2>/dev/null | grep '^|'
    sed -n '/^## GPU levers/,$p' "$DIR/levers.log" 2>/dev/null | grep '^|'
    [ -s "$DIR/junit.xml" ] || echo "tests: no junit xml"
    [ -s "$DIR/junit.xml" ] && "$PY" - "$DIR/junit.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

suites = ET.parse(sys.argv[1]).getroot().iter("testsuite")
counts = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
bad = []
for suite in suites:
    for k in counts:
        counts[k] += int(suite.get(k, 0))
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            bad.append(f"{case.get('classname')}::{case.get('name')}")
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
print(f"tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped")
for name in bad:
    print(f"  FAILED {name}")
EOF
    printf '%s\n' "${STATUS[@]}"
    echo "total    $(($(date +%s) - T0))s; outputs in $DIR"
} 2>&1 | tee "$DIR/summary.txt"
exit "$FAILED"
