#!/usr/bin/env bash
# Times what a newcomer sees, on a fresh clone of this repository in a temporary directory with a fresh npu-shadow
# cache (no venv, no torch_npu wheels, no emulated npu build; pip's own cache is the machine's): the first demo,
# the warm demo, fetching torch_npu 2.13.0's wheel, `npu-shadow census 2.13.0 --against 2.12.0`, and the test command. Each line gives the seconds,
# the exit code and the load average at its end; the figures go to stdout and to first-hour.txt in the clone's
# parent directory (kept, with each step's log).
#
#   bash scripts/first_hour.sh [--busy] [--tests N]
#
# --busy keeps both cores busy with two `yes > /dev/null` from start to end; --tests N runs the test command N times
# in a row (default 1; 0 skips it). The README's figures are this script's, idle and --busy.
set -uo pipefail
busy=0
tests=1
while [ $# -gt 0 ]; do
  case $1 in
    --busy) busy=1;;
    --tests) tests=$2; shift;;
    *) echo "usage: bash scripts/first_hour.sh [--busy] [--tests N]" >&2; exit 2;;
  esac
  shift
done
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/first-hour.XXXXXX)
report=$work/first-hour.txt
git clone -q "$here" "$work/clone"
export NPU_SHADOW_CACHE_DIR=$work/cache
unset NPU_SHADOW_WHEEL_DIR
hogs=()
stop_hogs() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done; }
trap stop_hogs EXIT
if [ "$busy" = 1 ]; then
  yes > /dev/null & hogs+=($!)
  yes > /dev/null & hogs+=($!)
fi
echo "first hour of $(git -C "$here" rev-parse --short HEAD), $(nproc) cores, $([ "$busy" = 1 ] && echo "both kept busy by two yes" || echo "no other work started"), in $work" | tee "$report"
timed() {
  local label=$1
  shift
  local start end code
  start=$(date +%s.%N)
  "$@" > "$work/${label// /-}.log" 2>&1
  code=$?
  end=$(date +%s.%N)
  printf '%-16s %7.1f s  exit %s  load %s\n' "$label" "$(awk "BEGIN { print $end - $start }")" "$code" \
    "$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$report"
}
cd "$work/clone"
timed "first demo" bash scripts/demo.sh
timed "warm demo" bash scripts/demo.sh
timed "fetch 2.13.0" bash scripts/fetch_torch_npu.sh 2.13.0  # (the census's release: its wheel, as its message says)
timed "census" .venv/bin/npu-shadow census 2.13.0 --against 2.12.0
for run in $(seq 1 "$tests"); do
  timed "test command $run" bash scripts/test.sh
  grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$work/test-command-$run.log" | tail -1 | tee -a "$report"
done
