#!/usr/bin/env bash
# Instructions per request on one side of the side-by-side bench (../shared/bench/run.sh), for
# aether-proxy or HAProxy: that side runs under callgrind with counting off, the scenario runs
# for WARM + SPAN + 10 seconds, and callgrind counts only the SPAN seconds after the first
# WARM of the scenario. The request count of that window comes from the proxy's own metrics, read when counting
# starts and when it stops. Prints instructions per request, then the functions that take the
# most (inclusive, in thousands of instructions a request). Callgrind counts instructions, not
# time: the figures repeat from run to run on a noisy machine, and the proxy runs about 50
# times slower under it (wrk and h2load adapt; the rates printed by run.sh mean nothing here).
#
#   benches/callgrind.sh <aether|haproxy> <client|server> [scenario]    (default h; an HTTP
#                                                                       scenario: a-f or h)
#
# Environment: AETHER_BIN (default target/release/aether-proxy), WARM (default 25 s), SPAN
# (15 s), TOP (25 functions), OUT (directory for the callgrind file, default a new temporary
# one, kept). Needs valgrind, curl and run.sh's own tools. callgrind_control acts on every
# process under callgrind: run one of these at a time.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,17p' "$0" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
bench=${BENCH:-$here/../shared/bench/run.sh}
[ -x "$bench" ] || { echo "no bench at $bench (set BENCH)" >&2; exit 1; }
for t in valgrind callgrind_control callgrind_annotate curl; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install -y valgrind curl)" >&2; exit 1; }
done
proxy=$1 side=$2 scenario=${3:-h}
case "$side" in client) admin=19001 ;; server) admin=19002 ;; *) echo "side: client or server" >&2; exit 2 ;; esac
warm=${WARM:-25} span=${SPAN:-15} top=${TOP:-25}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
rm -f "$out/window" "$out/run.txt"
cg="$out/callgrind.$proxy.$side.$scenario"

wrap=$(mktemp -d)
trap 'rm -rf "$wrap"' EXIT
# wrapper <name> <real program> [environment]: the side's process (told apart by its config
# file's name, as in placement.sh) runs under callgrind, with the environment given; the other
# side, and config checks, run as they are.
wrapper() {
  cat >"$wrap/$1" <<EOF
#!/usr/bin/env bash
[[ " \$* " == *" -c "* ]] && exec "$2" "\$@"
for a in "\$@"; do
  case "\$a" in
    *$side.yaml|*$side.cfg)
      exec env ${3:-} valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$cg" "$2" "\$@" ;;
  esac
done
exec "$2" "\$@"
EOF
  chmod +x "$wrap/$1"
}
case "$proxy" in
  aether)
    bin=$(realpath "${AETHER_BIN:-$here/target/release/aether-proxy}")
    [ -x "$bin" ] || { echo "no binary at $bin (cargo build --release, or set AETHER_BIN)" >&2; exit 1; }
    # `run` starts itself again to set glibc's tcache tunable (docs/behaviour.md, "The allocator's thread
    # cache"), which valgrind cannot follow: the tunable is set here, as that step sets it
    # (`TCACHE_COUNT` in src/memory/policy.rs; keep the two equal).
    wrapper aether-proxy "$bin" "AETHER_MALLOC_TUNED=1 GLIBC_TUNABLES=glibc.malloc.tcache_count=1024"
    export AETHER_BIN=$wrap/aether-proxy
    # The client's outbound requests and the server's inbound ones.
    metric=aether_requests_total ;;
  haproxy)
    wrapper haproxy "$(command -v haproxy || { echo "needs haproxy" >&2; exit 1; })"
    export PATH=$wrap:$PATH
    metric=haproxy_backend_http_requests_total ;;
  *) echo "proxy: aether or haproxy" >&2; exit 2 ;;
esac
# Requests this side handled so far: the sum of the metric's series on its admin listener. A
# proxy under callgrind on a loaded machine can take seconds to answer; a read that fails is
# an error, never a count of 0.
requests() {
  local body
  body=$(curl -sf --max-time 20 "http://127.0.0.1:$admin/metrics") || return 1
  awk -v m="$metric{" 'index($0, m) == 1 {s += $NF} END {printf "%d\n", s}' <<<"$body"
}

# Counting is switched on and off from outside while run.sh drives the load, WARM seconds
# after run.sh starts the scenario (the pair's start-up under callgrind takes from a few
# seconds to half a minute, with the machine's load).
(
  for _ in $(seq 600); do
    grep -q "scenario $scenario:" "$out/run.txt" 2>/dev/null && break
    sleep 1
  done
  sleep "$warm"
  before=$(requests)
  callgrind_control -z >/dev/null 2>&1 || true
  callgrind_control -i on >/dev/null 2>&1 || true
  sleep "$span"
  callgrind_control -i off >/dev/null 2>&1 || true
  after=$(requests)
  callgrind_control -d >/dev/null 2>&1 || true
  echo "$before $after" >"$out/window"
) &
counter=$!
PROXY=$proxy SCENARIOS=$scenario DURATION=$((warm + span + 10)) QUIET_MAX=100 QUIET_WAIT=0 \
  bash "$bench" bench >"$out/run.txt" 2>&1 || { tail -n 5 "$out/run.txt" >&2; exit 1; }
wait "$counter" || true
[ -s "$out/window" ] || { echo "the counting window did not complete (see $out/run.txt)" >&2; exit 1; }
read -r before after <"$out/window"
n=$((after - before))
dump=$(ls -t "$cg".* 2>/dev/null | head -n1)
[ "$n" -gt 0 ] && [ -n "$dump" ] || { echo "no requests counted (window: $before -> $after)" >&2; exit 1; }
total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
echo "$proxy $side, scenario $scenario: $n requests, $total instructions, $((total / n)) a request"
echo "thousands of instructions a request, inclusive (callgrind file: $dump):"
callgrind_annotate --inclusive=yes "$dump" 2>/dev/null |
  awk -v n="$n" -v top="$top" '
    /PROGRAM TOTALS/ { go = 1; next }
    go && /^ *[0-9,]+ +\(/ {
      x = $1; gsub(",", "", x); line = $0
      sub(/^ *[0-9,]+ +\([^)]*\) +/, "", line)
      sub(/[^ ]*\.cargo\/registry\/src\/[^\/]+\//, "", line)
      sub(/ \[[^]]*\]$/, "", line)
      printf "%8.1f  %s\n", x / n / 1000, line
      if (++k >= top) exit
    }'
