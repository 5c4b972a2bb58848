#!/usr/bin/env bash
# A long fuzzing campaign: every target (or the named ones) for <seconds> each, <jobs> at a time,
# optimized build, at low priority. Each run starts from the committed corpus; at the end the
# corpus is minimized (libFuzzer's -merge=1 over the old corpus and the run's finds) and written
# back to fuzz/corpus/<target>, so the campaign's coverage is what CI's short runs start from.
# One line per target goes to fuzz/campaign.tsv: target, wall seconds, CPU seconds, executions,
# corpus files before and after, crashes.
#
#   fuzz/campaign.sh <seconds> [jobs] [target...]
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:?usage: fuzz/campaign.sh <seconds> [jobs] [target...]}
jobs=${2:-$(nproc)}
shift $(($# < 2 ? $# : 2))

if [ "${FUZZ_TOOLCHAIN:-}" != stable ] && rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  cargo=(cargo +nightly)
else
  export RUSTC_BOOTSTRAP=1
  cargo=(cargo)
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <("${cargo[@]}" fuzz list)
fi
"${cargo[@]}" fuzz build -s none
bin=target/$(rustc -vV | sed -n 's/^host: //p')/release

logs=campaign-logs
mkdir -p "$logs"
[ -f campaign.tsv ] || printf 'target\twall_s\tcpu_s\texecutions\tcorpus_before\tcorpus_after\tcrashes\n' >campaign.tsv

one() {
  local t=$1 max_len=4096 finds before start end cpu execs after crashes rc=0
  [ "$t" = clienthello ] && max_len=20000
  finds=$(mktemp -d)
  mkdir -p "corpus/$t" "artifacts/$t"
  before=$(find "corpus/$t" -type f | wc -l)
  start=$(date +%s)
  nice -n 19 /usr/bin/time -f '%U %S' -o "$logs/$t.time" \
    "$bin/$t" "$finds" "corpus/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -max_len="$max_len" -artifact_prefix="artifacts/$t/" -print_final_stats=1 \
    >"$logs/$t.log" 2>&1 || rc=$?
  end=$(date +%s)
  cpu=$(awk '{printf "%d", $1 + $2}' "$logs/$t.time" 2>/dev/null || echo 0)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)
  crashes=$(find "artifacts/$t" -type f | wc -l)
  # Minimize: the smallest set of old and new inputs that keeps the coverage seen.
  local merged
  merged=$(mktemp -d)
  nice -n 19 "$bin/$t" -merge=1 "$merged" "corpus/$t" "$finds" -max_len="$max_len" \
    >"$logs/$t.merge.log" 2>&1 &&
    { find "corpus/$t" -type f ! -name 'seed-*' -delete; cp -n "$merged"/* "corpus/$t"/ 2>/dev/null || true; }
  # The seeds stay under their names; their copies named by hash go.
  for s in "corpus/$t"/seed-*; do
    [ -f "$s" ] && rm -f "corpus/$t/$(sha1sum "$s" | cut -c1-40)"
  done
  after=$(find "corpus/$t" -type f | wc -l)
  rm -rf "$finds" "$merged"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" $((end - start)) "$cpu" "${execs:-0}" "$before" \
    "$after" "$crashes" >>campaign.tsv
  echo "$t: exit $rc, $((end - start)) s, ${execs:-0} executions, corpus $before -> $after, crashes $crashes"
}

running=0
for t in "${targets[@]}"; do
  one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait
