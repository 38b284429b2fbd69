#!/usr/bin/env bash
# The demo's legacy side: torch_npu 2.12.0's own code, its wheel fetched into the cache as the test command
# fetches it; shadow.npu.reference only where it cannot be. Says which on stderr; prints the launcher's option
# (--legacy-from PATH, or --legacy-from reference) on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
CI= bash scripts/fetch_torch_npu.sh 2.12.0 >&2
wheel=$(.venv/bin/python -c "from shadow.npu.wheels import cached_wheel; print(cached_wheel('2.12.0') or '')")
if [ -n "$wheel" ]; then
  echo "== legacy: torch_npu 2.12.0's own code, read from $wheel" >&2
  printf '%s\n' --legacy-from "$wheel"
else
  echo "== legacy: shadow.npu.reference, NOT torch_npu's own code: its 2.12.0 wheel could not be fetched (above)" >&2
  printf "%s\n" --legacy-from reference
fi
