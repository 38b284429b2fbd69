#!/usr/bin/env bash
# Fetch the torch_npu wheels that carry the patches (2.8.0 to 2.12.0) and the later ones the census reads (2.13.0,
# 2.14.0), or the versions given as arguments (and take their census, kept beside them), into
# npu-shadow's cache, outside the repository, for the differential tests and the demo, which read their Python
# source (never import it). Wheels already cached are kept. A wheel that cannot be fetched is said on stderr; under
# CI (CI=true) that fails the run (exit 1: its tests would otherwise skip and CI stay green), elsewhere it exits 0
# and the tests that need it skip, named in pytest's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
cache=$(.venv/bin/python -c "from shadow.npu.wheels import wheel_cache; print(wheel_cache())")
if [ $# -gt 0 ]; then
  releases="$*"
else
  releases=$(.venv/bin/python -c "from shadow.npu.wheels import LATER_RELEASES, RELEASES; print(*RELEASES, *LATER_RELEASES)")
fi
mkdir -p "$cache"
missing=()
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
    echo "npu-shadow: could not fetch torch_npu $version into $cache:" "$(tail -1 "$partial.log")" >&2
    missing+=("$version")
  fi
  rm -rf "$partial" "$partial.log"
done
if [ $# -gt 0 ]; then
  # Versions asked for by name are for `npu-shadow census`: its census of each is taken now and kept beside the
  # wheels (about 20 s of CPU each), so that the census reads it back in a second at any load.
  for version in $releases; do
    case " ${missing[*]} " in *" $version "*) continue;; esac
    .venv/bin/python -c "import sys; from shadow.analysis.census import kept; kept(sys.argv[1])" "$version" \
      || echo "npu-shadow: the census of torch_npu $version could not be taken now; npu-shadow census takes it" >&2
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${CI:-}" = "true" ]; then
    echo "npu-shadow: under CI every torch_npu wheel is needed (missing: ${missing[*]}): failing" >&2
    exit 1
  fi
  echo "npu-shadow: the tests that need torch_npu ${missing[*]} will skip, named in the test summary" >&2
fi
exit 0
