#!/usr/bin/env bash
# Set up (see setup.sh), install Prometheus and promtool from Debian's `prometheus` package, Alertmanager and amtool
# from `prometheus-alertmanager`, the Pushgateway from `prometheus-pushgateway`, VictoriaMetrics (and vmalert) from
# `victoria-metrics` and Chromium from `chromium` when they are missing (the tests start their own servers on
# 127.0.0.1, never the system services, and render a report in headless Chromium), then run the linter and the
# whole test suite. The torch_npu wheels (for their source) are fetched into the cache first, and
# Triton installed into .venv (its interpreter runs the comparator's GPU kernel in a test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
missing=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 && command -v amtool >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
command -v prometheus-pushgateway >/dev/null 2>&1 || missing+=(prometheus-pushgateway)
command -v victoria-metrics >/dev/null 2>&1 || missing+=(victoria-metrics)  # the fleet-wide store (tests/test_fleet.py)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # renders the report's HTML in a test
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "== installing Debian packages: ${missing[*]} (a few minutes)" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Triton's interpreter runs the comparator's GPU kernel on the host in a test (CI has no GPU); the demo needs none.
if ! compgen -G ".venv/lib/python*/site-packages/triton-*.dist-info" >/dev/null; then
  echo "== installing Triton into .venv for its interpreter (about 290 MB: seconds on a fast link)" >&2
  .venv/bin/python -m pip install -q "triton>=3.0"
fi
bash scripts/fetch_torch_npu.sh
.venv/bin/python -m ruff check .
# (two workers: the suite takes half as long, and its tests wait for conditions, never for an idle machine)
echo "== tests: about 14 minutes on 2 idle cores, longer with both cores busy; the 25 slowest are listed at the end" >&2
.venv/bin/python -m pytest -q -n 2 --durations=25 "$@"
