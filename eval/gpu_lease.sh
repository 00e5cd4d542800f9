#!/bin/bash
# One call of a GPU lease (docs/kernels.md, "Device recipe"): the compiled tests first, then an optional sweep, then
# the GPU check's other parts (eval/gpu/check.py) in the time left, every result copied flat into $OUT (the run tool
# brings back at most eight files: the twelfth lease lost two parts' JSONs to nested folders).
#
#   bash eval/gpu_lease.sh                       # tests, then bandwidth and e2e with gpu_check's defaults
#   LEASE_S=470 LEASE_PARTS=e2e LEASE_CHECK_ARGS="--e2e-contexts 32768 --e2e-batches 8 --budgets 1024" \
#   LEASE_SWEEP="timeout 130 python3 -m eval.kernel_variants --out \$OUT/sweep.json --cases quant:32768:8 ..." \
#   bash eval/gpu_lease.sh
#
# Run from the repository root (the check imports tests/ and eval/ as packages of the checkout).
#
# Should a compiled decode-kernel or dequantization test fail, the device copy's ASM_DEQUANT is set to False before
# anything is timed (the PTX dequantization is the newest code on that path) and $OUT/verdict.txt says so.
set -u
: "${OUT:?set OUT to the folder the run tool brings back}"
T0=$(date +%s)
LEASE_S=${LEASE_S:-520}             # seconds this call may take, installation included
TESTS_BUDGET_S=${TESTS_BUDGET_S:-420}  # gpu_check's budget for the tests part alone (its deadline: 38% of it)
LEASE_PARTS=${LEASE_PARTS:-bandwidth,e2e}
LEASE_CHECK_ARGS=${LEASE_CHECK_ARGS:-}
LEASE_SWEEP=${LEASE_SWEEP:-}
DRY=${LEASE_DRY:+--dry-run}          # LEASE_DRY=1: gpu_check's CPU dry run, to try this script off a GPU
elapsed() { echo $(( $(date +%s) - T0 )); }

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel installation failed"; exit 3; }
fi
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > /tmp/lease_log.txt 2>&1 || echo "no nvidia-smi" > /tmp/lease_log.txt

if [ "$TESTS_BUDGET_S" != 0 ]; then
  python3 -m eval.gpu.check $DRY --out /tmp/lease_tests --parts tests --budget-s "$TESTS_BUDGET_S" \
    >> /tmp/lease_log.txt 2>&1
  cp /tmp/lease_tests/gpu_check.json "$OUT/tests.json"
  cp /tmp/lease_tests/summary.txt "$OUT/tests_summary.txt"
  tail -20 /tmp/lease_tests/summary.txt
  python3 - > "$OUT/verdict.txt" <<'PY'
import json, os
from eval.gpu.check import decode_path_failures
result = json.load(open(os.environ["OUT"] + "/tests.json"))
py = result["parts"]["tests"].get("pytest", {})
bad = decode_path_failures(result)
print("FAIL" if bad else "OK", f"passed={py.get('passed')} failed={py.get('failed')}", *bad[:10])
PY
  if grep -q '^FAIL' "$OUT/verdict.txt"; then
    sed -i 's/^ASM_DEQUANT = True/ASM_DEQUANT = False/' hfkv/kernels/decode_attention.py
    echo "ASM_DEQUANT = False for the rest of this call" >> "$OUT/verdict.txt"
  fi
  cat "$OUT/verdict.txt"
  echo "tests done at $(elapsed) s"
fi

if [ -n "$LEASE_SWEEP" ]; then
  eval "$LEASE_SWEEP" >> /tmp/lease_log.txt 2>&1
  grep -v '^{' /tmp/lease_log.txt | tail -4
  echo "sweep done at $(elapsed) s"
fi

LEFT=$(( LEASE_S - $(elapsed) - 10 ))
if [ "$LEASE_PARTS" != none ] && [ "$LEFT" -gt 60 ]; then
  # gpu_check's last deadline is 97% of its budget.
  # shellcheck disable=SC2086
  python3 -m eval.gpu.check $DRY --out /tmp/lease_check --parts "$LEASE_PARTS" --budget-s $(( LEFT * 100 / 97 )) \
    $LEASE_CHECK_ARGS >> /tmp/lease_log.txt 2>&1
  cp /tmp/lease_check/gpu_check.json "$OUT/check.json"
  cp /tmp/lease_check/summary.txt "$OUT/check_summary.txt"
  cp /tmp/lease_check/gpu_check.png "$OUT/check.png" 2> /dev/null
  cat /tmp/lease_check/summary.txt
fi
cp /tmp/lease_log.txt "$OUT/log.txt"
echo "end at $(elapsed) s"
