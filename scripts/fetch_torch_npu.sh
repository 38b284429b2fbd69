#!/usr/bin/env bash
# Fetch the torch_npu wheels that carry the patches (2.8.0 to 2.12.0) into npu-shadow's cache, outside the
# repository, for the differential tests and the demo, which read their Python source (never import it).
# Wheels already cached are kept. Without access to the package index this says so and exits 0: the tests
# that need a wheel then skip, naming it.
set -uo pipefail
cd "$(dirname "$0")/.."
cache=$(.venv/bin/python -c "from shadow.npu.torch_npu_source import wheel_cache; print(wheel_cache())")
releases=$(.venv/bin/python -c "from shadow.npu.torch_npu_source import RELEASES; print(*RELEASES)")
mkdir -p "$cache"
for version in $releases; do
  if compgen -G "$cache/torch_npu-$version-*.whl" >/dev/null; then
    continue
  fi
  partial=$(mktemp -d "$cache/.partial.XXXXXX")
  # Any platform's wheel holds the same Python source; pin one so the host's own does not matter.
  if .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 -d "$partial" "torch_npu==$version" >"$partial.log" 2>&1; then
    mv "$partial"/torch_npu-*.whl "$cache/"
  else
    echo "npu-shadow: could not fetch torch_npu $version into $cache (tests that need it will skip):" \
      "$(tail -1 "$partial.log")" >&2
  fi
  rm -rf "$partial" "$partial.log"
done
