#!/usr/bin/env bash
# Drives wrk (HTTP/1.1) and h2load (h2c) through a local sidecar pair started by
# `aether-proxy demo`, and prints req/s, latency and each sidecar's CPU microseconds per request.
# Loopback only. For the side-by-side comparison with Envoy use ../shared/bench/run.sh.
#
#   benches/pair.sh [seconds]        (default 10; needs wrk and h2load: apt-get install wrk nghttp2-client)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
bin=target/release/aether-proxy
command -v wrk >/dev/null && command -v h2load >/dev/null || { echo "needs wrk and h2load (apt-get install -y wrk nghttp2-client)" >&2; exit 1; }
cargo build --release --quiet
out=$(mktemp -d)
"$bin" demo >"$out/demo.log" 2>&1 &
demo=$!
trap 'kill -TERM $demo 2>/dev/null; wait $demo 2>/dev/null; rm -rf "$out"' EXIT
for _ in $(seq 100); do grep -q "Ctrl-C stops the demo" "$out/demo.log" && break; sleep 0.2; done
grep -q "Ctrl-C stops the demo" "$out/demo.log" || { cat "$out/demo.log" >&2; exit 1; }
# The sidecars are the demo's children: frontend (client) and payments-v2 (the pod serving 9090).
pid_of() { pgrep -P "$demo" -f "$1" | head -n1; }
client=$(pid_of frontend.yaml); server=$(pid_of payments-v2.yaml)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
measure() {  # label tool-command...
  local label=$1; shift
  local c0 s0 c1 s1 n
  c0=$(ticks "$client"); s0=$(ticks "$server")
  "$@" >"$out/run.txt" 2>&1
  c1=$(ticks "$client"); s1=$(ticks "$server")
  if grep -q '^Requests/sec' "$out/run.txt"; then
    n=$(awk '/requests in/{print $1}' "$out/run.txt")
    printf '%-28s %10s req/s  p50 %-8s p99 %-8s' "$label" "$(awk '/^Requests\/sec/{print $2}' "$out/run.txt")" \
      "$(awk '$1=="50%"{print $2}' "$out/run.txt")" "$(awk '$1=="99%"{print $2}' "$out/run.txt")"
  else
    n=$(awk '/^requests:/{print $8}' "$out/run.txt")
    printf '%-28s %10s req/s  %-26s' "$label" "$(awk '/^finished in/{print $4}' "$out/run.txt")" "(h2load)"
  fi
  awk -v c=$((c1 - c0)) -v s=$((s1 - s0)) -v n="$n" -v hz="$hz" \
    'BEGIN{ if (n > 0) printf "  client %.1f us/req  server %.1f us/req (server share: v2 pod only)\n", c/hz*1e6/n, s/hz*1e6/n; else print "  no requests" }'
}
echo "aether-proxy pair via demo (${secs}s each; the h1 default port spreads over both payments pods)"
measure "h1 :8080 wrk -c32" wrk -t1 -c32 -d"${secs}s" --latency -H 'Host: payments.aether.internal' http://127.0.0.1:15001/
measure "h2c :9090 h2load -c4 -m8" h2load -t1 -c4 -m8 -D "$secs" -H ':authority: payments.aether.internal:9090' http://127.0.0.1:15001/
