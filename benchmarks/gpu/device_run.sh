#!/bin/bash
# One call on a lent GPU machine (the device tool): the kit, then the extra checks, each bounded; JSON
# and logs under $OUT. Usage there: bash benchmarks/gpu/device_run.sh [kit s] [extras s] [ddp_cost s] [percall s]
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/commpatch-gpu}; mkdir -p "$OUT"
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import sys, torch, wrapt, pandas; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), wrapt.__version__, pandas.__version__)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"
timeout 90 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 && echo "C hot path built" || echo "C hot path NOT built (pure Python)"
python3 -c "import commpatch.record._hot as h; print('hot:', h.__file__)" 2>&1 | tail -1
timeout "${1:-200}" python3 benchmarks/gpu/validate.py --json "$OUT/validate.json" >"$OUT/validate.log" 2>&1
echo "validate.py exit $?"
timeout "${2:-220}" python3 benchmarks/gpu/extras.py --json "$OUT/extras.json" >"$OUT/extras.log" 2>&1
echo "extras.py exit $?"
timeout "${3:-150}" python3 benchmarks/gpu/ddp_cost.py --json "$OUT/ddp_cost.json" >"$OUT/ddp_cost.log" 2>&1
echo "ddp_cost.py exit $?"
timeout "${4:-90}" python3 benchmarks/gpu/percall.py --json "$OUT/percall.json" >"$OUT/percall.log" 2>&1
echo "percall.py exit $?"
grep -v "^USDT" "$OUT/validate.log" | cut -c1-400 | tail -n 45
grep -v "^USDT" "$OUT/extras.log" | grep -E "^(PASS|FAIL|SKIP)|raised|Error|DRY|PASSED|FAILED" | cut -c1-500 | tail -n 12
grep -v "^USDT" "$OUT/ddp_cost.log" | tail -n 13
grep -v "^USDT" "$OUT/percall.log" | head -n 40
