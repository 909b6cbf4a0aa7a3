#!/bin/bash
# One call on a lent GPU machine (the device tool): the kit, then the extra checks, each bounded; the
# JSONs under $OUT, every log in $OUT/logs.tgz (at most 8 files come back).
# Usage there: bash benchmarks/gpu/device_run.sh [kit s] [extras s] [ddp_cost s] [percall s] [checks] [verdicts s]
# (checks: a comma-separated subset of validate,extras,ddp_cost,percall,verdicts; default the first
# four. verdicts: the straggler truth table's 4-rank DDP and ZeRO cells, quiet and beside a CPU hog,
# on that machine's 16 cores, where this project's 2-core machine puts 4 ranks on 2 cores; CPU only)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/commpatch-gpu}; mkdir -p "$OUT"
LOGS=$(mktemp -d); mkdir -p "$LOGS/gloo"
CHECKS=${5:-validate,extras,ddp_cost,percall}
want() { [[ ",$CHECKS," == *",$1,"* ]]; }
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import sys, torch, wrapt, pandas; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), wrapt.__version__, pandas.__version__)"
  nproc; uptime
} >"$LOGS/env.log" 2>&1
cat "$LOGS/env.log"
timeout 90 python3 setup.py -q build_ext --inplace >"$LOGS/build.log" 2>&1 && echo "C hot path built" || echo "C hot path NOT built (pure Python)"
python3 -c "import commpatch.record._hot as h; print('hot:', h.__file__)" 2>&1 | tail -1
if want validate; then
  timeout "${1:-200}" python3 benchmarks/gpu/validate.py --json "$OUT/validate.json" >"$LOGS/validate.log" 2>&1
  echo "validate.py exit $?"
fi
if want extras; then
  timeout "${2:-220}" python3 benchmarks/gpu/extras.py --json "$OUT/extras.json" --logs "$LOGS/gloo" >"$LOGS/extras.log" 2>&1
  echo "extras.py exit $?"
fi
if want ddp_cost; then
  timeout "${3:-150}" python3 benchmarks/gpu/ddp_cost.py --where --json "$OUT/ddp_cost.json" >"$LOGS/ddp_cost.log" 2>&1
  echo "ddp_cost.py exit $?"
fi
if want percall; then
  timeout "${4:-90}" python3 benchmarks/gpu/percall.py --json "$OUT/percall.json" >"$LOGS/percall.log" 2>&1
  echo "percall.py exit $?"
fi
if want verdicts; then
  timeout "${6:-420}" python3 benchmarks/verdicts.py --kinds ddp,zero --worlds 4 --json "$OUT/verdicts.json" \
    >"$LOGS/verdicts.log" 2>&1
  echo "verdicts.py exit $?"
fi
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
for f in validate extras; do
  [ -f "$LOGS/$f.log" ] && grep -v "^USDT" "$LOGS/$f.log" | grep -E "^(PASS|FAIL|SKIP)|raised|Error|PASSED|FAILED" | cut -c1-600 | tail -n 60
done
[ -f "$LOGS/ddp_cost.log" ] && grep -v "^USDT" "$LOGS/ddp_cost.log" | head -n 70
[ -f "$LOGS/percall.log" ] && grep -v "^USDT" "$LOGS/percall.log" | head -n 24
[ -f "$LOGS/verdicts.log" ] && grep -v "^USDT" "$LOGS/verdicts.log" | tail -n 40
