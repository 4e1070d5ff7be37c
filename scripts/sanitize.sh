#!/usr/bin/env bash
# The CPU tests under ThreadSanitizer and AddressSanitizer, and (with `miri`) the core's unit
# tests under Miri, on a pinned nightly toolchain. The sanitizers rebuild std with their
# instrumentation (-Zbuild-std), so its locks and atomics are seen and nothing is a false alarm.
#
#   bash scripts/sanitize.sh             # thread and address: the core's unit, conformance,
#                                        # stream, fault and growable tests, the paged pool's
#                                        # unit and paged tests, the trace tests, the C API's
#                                        # unit, api and paged tests, and the interposer's
#                                        # (about 5 min)
#   bash scripts/sanitize.sh thread      # one of them
#   bash scripts/sanitize.sh miri        # the core's and the paged pool's unit tests under Miri
#                                        # (about 20 min on 2 cores); those that call the host
#                                        # backend's memfd and mmap, or the CUDA driver, are
#                                        # left out (Miri cannot run them)
#
# The C example (it links the library into a C program built without the sanitizer) and the
# header check are not run here; scripts/test.sh runs them. Leaks inside NVIDIA's libnvrtc are
# suppressed (scripts/lsan.supp); LeakSanitizer can name it only because MoonBright never
# unloads it (src/libs.rs). If the toolchain cannot be installed, the script says so and exits 0
# (the tests then ran only without sanitizers).
set -euo pipefail
cd "$(dirname "$0")/.."
nightly=nightly-2026-10-30
target=$(rustc -vV | sed -n 's/^host: //p')
if ! rustup run "$nightly" rustc --version >/dev/null 2>&1; then
  if ! rustup toolchain install "$nightly" --profile minimal --component rust-src,miri; then
    echo "could not install $nightly: the sanitizer and Miri runs are skipped"
    exit 0
  fi
fi
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(thread address)
for run in "${runs[@]}"; do
  case "$run" in
    thread | address)
      echo "== the CPU tests under the ${run} sanitizer"
      for tests in "-p moonbright --lib --tests" "-p moonbright-paged --lib --tests" \
        "-p moonbright-trace --lib --tests" \
        "-p moonbright-capi --lib --test api --test paged" "-p moonbright-preload --lib --tests"; do
        # shellcheck disable=SC2086 # $tests is a list of arguments
        RUSTFLAGS="-Zsanitizer=$run" CARGO_TARGET_DIR="target/san-$run" \
          LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp" \
          cargo "+$nightly" test -Zbuild-std --target "$target" --release $tests
      done
      ;;
    miri)
      echo "== the core's and the paged pool's unit tests under Miri"
      cargo "+$nightly" miri setup
      MIRIFLAGS="-Zmiri-disable-isolation" PROPTEST_CASES=8 \
        cargo "+$nightly" miri test -p moonbright -p moonbright-paged --lib
      ;;
    *)
      echo "unknown run '$run': thread, address or miri" >&2
      exit 2
      ;;
  esac
done
