#!/usr/bin/env bash
# Builds every fuzz target and runs each for <seconds> (default 30) from its committed seed
# corpus; exits non-zero on the first crash, leak, timeout or out-of-memory, leaving the input
# in fuzz/artifacts/<target>/. New corpus entries go to a scratch directory, not the repository.
#
#   fuzz/run.sh [seconds] [target...]
#
# cargo-fuzz needs nightly-only rustc flags: with a nightly toolchain installed it is used;
# otherwise (or with FUZZ_TOOLCHAIN=stable) stable runs with RUSTC_BOOTSTRAP=1.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-30}
shift || true

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
fi

if [ "${FUZZ_TOOLCHAIN:-}" != stable ] && rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  cargo=(cargo +nightly)
else
  export RUSTC_BOOTSTRAP=1
  cargo=(cargo)
fi

# No sanitizer: the code under test is safe Rust, and the C it links (BoringSSL) is not
# instrumented either way; without ASan the build is faster and the runs quicker. The dev
# profile (debug assertions and overflow checks on) builds in a fraction of release's time,
# which is what a short check wants; FUZZ_RELEASE=1 builds optimized (cargo-fuzz's default:
# release with debug assertions) for long runs.
build=(-s none -D)
if [ "${FUZZ_RELEASE:-0}" = 1 ]; then
  build=(-s none)
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <("${cargo[@]}" fuzz list)
fi

"${cargo[@]}" fuzz build "${build[@]}"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
  max_len=4096
  [ "$t" = clienthello ] && max_len=20000
  mkdir -p "$scratch/$t" "corpus/$t"
  echo "== $t: ${secs}s"
  # -timeout: one input taking 10 s is a finding (superlinear time), not a slow machine.
  rc=0
  "${cargo[@]}" fuzz run "${build[@]}" "$t" "$scratch/$t" "corpus/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
    -print_final_stats=1 >"$scratch/$t.log" 2>&1 || rc=$?
  grep -E '^(#[0-9]+[[:space:]]+DONE|stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb))' \
    "$scratch/$t.log" || true
  if [ "$rc" -ne 0 ]; then
    tail -n 60 "$scratch/$t.log" >&2
    echo "fuzz target $t failed (exit $rc): the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
done
