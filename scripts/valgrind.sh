#!/usr/bin/env bash
# Runs the core's CPU tests under valgrind's memcheck: the unit tests, the stream,
# fault-injection and host conformance tests, growable allocations, and the paged pool's unit
# and paged tests. Exits non-zero on any test failure or memcheck error. (scripts/sanitize.sh
# runs them under the thread and address sanitizers, and the unit tests under Miri.)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
bins=$(cargo test --release -p moonbright -p moonbright-paged --no-run --message-format=json 2>/dev/null | python3 -c '
import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and \
       m["target"]["name"] in ("moonbright", "streams", "faults", "conformance", "growable",
                               "moonbright_paged", "paged"):
        print(m["target"]["name"], m["executable"])
')
while read -r name bin; do
  filter=""; [ "$name" = conformance ] && filter="host::"
  echo "== $name under memcheck"
  log=$(mktemp)
  if valgrind --error-exitcode=9 -q "$bin" --test-threads 2 $filter >"$log" 2>&1; then
    grep -E "test result" "$log"
  else
    grep -E "test result|panicked|==[0-9]+== " "$log" | head -40
    echo "$name failed under valgrind"; exit 1
  fi
done <<< "$bins"
