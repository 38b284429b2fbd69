#!/usr/bin/env bash
# Set up (see setup.sh), then the demo of the main job: the example training job run under
# `npu-shadow run` on 2 emulated npu devices (DataParallel, data_parallel and npu casts, float16
# autocast on every other step), serving its metrics on 127.0.0.1:9464 while it trains, then its
# summary and the verdict. The legacy side is torch_npu 2.12.0's own code, its wheel fetched first (the reference
# only where it cannot be, said in the first lines). The first run builds the emulated npu (about 25 s on 2 idle cores; cached).
# Extra arguments go to `npu-shadow run`, e.g. `bash scripts/demo.sh --drill value:1.0`. `bash scripts/demo.sh
# --canary-drill` runs the canary phase instead (upstream returned) with a fire drill, and shows the rollback switch
# taking effect in the running job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The run's evidence (metrics, journals) stays beside the report that names it, until the next demo run.
# (NPU_SHADOW_DEMO_OUT and NPU_SHADOW_DEMO_PORT move the outputs and the metrics port: the tests run the demo so.)
out=${NPU_SHADOW_DEMO_OUT:-.}
port=${NPU_SHADOW_DEMO_PORT:-9464}
work=$out/npu-shadow-demo
rm -rf "$work"
mkdir -p "$out"
mkdir -m 700 "$work"
mapfile -t legacy < <(bash scripts/demo_legacy.sh)  # torch_npu 2.12.0's own code, fetched; said on stderr
echo "== checking this host (npu-shadow doctor)"
.venv/bin/npu-shadow doctor --emulate-npu 2 --port "$port" "${legacy[@]}" || true
echo
if [ "${1:-}" = "--canary-drill" ]; then
  # The canary phase and its rollback: upstream's result returned, legacy compared, a fire drill injecting a dtype
  # divergence. A watcher (scripts/demo_watcher.py) stands in for Prometheus, Alertmanager and `npu-shadow receiver`:
  # at the first hard mismatch it throws the job's rollback switch (a file). The job returns legacy's result from
  # the next call on, without a restart. (--linger 0: the watcher has stopped once it threw the switch, and the
  # textfile holds the final counts: nothing would come to scrape them.)
  shift
  echo "== canary with a fire drill (upstream returned; metrics on http://127.0.0.1:$port/metrics); watcher armed"
  .venv/bin/python scripts/demo_watcher.py http://127.0.0.1:$port/metrics "$work/rollback" &
  .venv/bin/npu-shadow run --emulate-npu 2 "${legacy[@]}" --sample-rate 1 --budget off --port "$port" \
    --textfile "$work/metrics.prom" --journal "$work/journal-{pid}.jsonl" --primary upstream --drill dtype:0.5 \
    --rollback-file "$work/rollback" --linger 0 "$@" \
    -- .venv/bin/python examples/train_dataparallel.py --autocast --epochs 4
  wait
  echo
  echo "== the rollback, as the job recorded it (journal), and comparisons by the side the caller got (metrics)"
  # (the first 6 in time order, chosen in Python: a `| head` under pipefail fails the demo when sort writes on)
  .venv/bin/python - "$work"/journal-*.jsonl <<'ROLLBACKS'
import json, sys
rollbacks = []
for path in sys.argv[1:]:
    for line in open(path):
        event = json.loads(line)
        if event.get("event") == "rollback":
            rollbacks.append(f'{event["time"]} {event["target"]} rolled back to legacy by {event["by"]} pid {event["pid"]}')
print(*sorted(rollbacks)[:6], sep="\n")
ROLLBACKS
  .venv/bin/python - "$work/metrics.prom" <<'COUNT'
import collections, sys
from prometheus_client.parser import text_string_to_metric_families
returned = collections.Counter()
for family in text_string_to_metric_families(open(sys.argv[1]).read()):
    for sample in family.samples:
        if sample.name == "npu_shadow_comparisons_total" and sample.value:
            returned[(sample.labels["target"], sample.labels["primary"])] += int(sample.value)
for (target, primary), count in sorted(returned.items()):
    print(f"{target:<16} {count:>6} comparisons with {primary}'s result returned")
COUNT
else
  echo "== training, shadowed (metrics on http://127.0.0.1:$port/metrics while it runs)"
  # (a rehearsal compares every call: no overhead budget)
  .venv/bin/npu-shadow run --emulate-npu 2 "${legacy[@]}" --sample-rate 1 --budget off --port "$port" \
    --textfile "$work/metrics.prom" --journal "$work/journal-{pid}.jsonl" "$@" \
    -- .venv/bin/python examples/train_dataparallel.py --autocast
fi
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
echo "== report for the pull request (counts from the metrics, details from the journals; both kept in $work/)"
.venv/bin/npu-shadow report --metrics-file "$work/metrics.prom" --journal "$work"/journal-*.jsonl \
  --markdown "$out/npu-shadow-report.md" --html "$out/npu-shadow-report.html"
sed -n '/^## Verdict/,/^## Risky/p' "$out/npu-shadow-report.md" | head -n -1
