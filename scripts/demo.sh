#!/usr/bin/env bash
# Set up (see setup.sh), then the demo of the main job: the example training job run under
# `npu-shadow run` on 2 emulated npu devices (DataParallel, data_parallel and npu casts, float16
# autocast on every other step), serving its metrics on 127.0.0.1:9464 while it trains, then its
# summary and the verdict. The legacy side is torch_npu 2.12.0's own code, its wheel fetched first (the reference
# only where it cannot be, said in the first lines). The first run builds the emulated npu (about 45 s; cached).
# Extra arguments go to `npu-shadow run`, e.g. `bash scripts/demo.sh --drill value:1.0`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t legacy < <(bash scripts/demo_legacy.sh)  # torch_npu 2.12.0's own code, fetched; said on stderr
.venv/bin/npu-shadow doctor --emulate-npu 2 --port 9464 "${legacy[@]}" || true
echo
echo "== training, shadowed (metrics on http://127.0.0.1:9464/metrics while it runs)"
# (a rehearsal compares every call: no overhead budget)
.venv/bin/npu-shadow run --emulate-npu 2 "${legacy[@]}" --sample-rate 1 --budget off --port 9464 --textfile "$work/metrics.prom" \
  --journal "$work/journal-{pid}.jsonl" "$@" -- .venv/bin/python examples/train_dataparallel.py --autocast
echo
echo "== verdict"
set +e
.venv/bin/npu-shadow verdict --metrics-file "$work/metrics.prom"
code=$?
set -e
case $code in
  0|1|3) echo "(verdict exit code $code: 0 promote, 1 rollback, 3 inconclusive)";;
  *) exit "$code";;
esac
echo
echo "== report for the pull request (counts from the metrics, details from the journals)"
.venv/bin/npu-shadow report --metrics-file "$work/metrics.prom" --journal "$work"/journal-*.jsonl \
  --markdown npu-shadow-report.md --html npu-shadow-report.html
sed -n '/^## Verdict/,/^## Risky/p' npu-shadow-report.md | head -n -1
