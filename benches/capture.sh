#!/usr/bin/env bash
# Captured HTTP against the explicit path, in one sitting: a client pod namespace with the
# capture rules and its sidecar (uid 1337), a payments pod (sidecar + app) on this machine at the
# veth's far end, and wrk inside the namespace, once to the service's virtual address (captured)
# and once to 127.0.0.1:15001 with the mesh Host (explicit). Prints req/s and the client sidecar's
# CPU microseconds per request, for keep-alive connections and for a new connection per request.
#
#   sudo benches/capture.sh [seconds] [rounds]    (default 10 s, 3 rounds; needs root, ip,
#                                                  iptables, setpriv, wrk, python3)
# AETHER_BIN picks the binary (default target/release/aether-proxy, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
rounds=${2:-3}
bin=${AETHER_BIN:-target/release/aether-proxy}
[ -x "$bin" ] || cargo build --release --quiet
for t in ip iptables-restore setpriv wrk python3; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 1; }
done

ns=aebench-$$
host_if=aeb$(($$ % 100000))
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  ip link del "$host_if" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cp "$bin" certs/ca.crt certs/frontend.crt certs/frontend.key certs/payments.crt certs/payments.key "$work/"
ip netns add "$ns"
ip link add "$host_if" type veth peer name eth0 netns "$ns"
ip addr add 10.250.254.2/28 dev "$host_if" && ip link set "$host_if" up
ip -n "$ns" addr add 10.250.254.1/28 dev eth0
ip -n "$ns" link set lo up && ip -n "$ns" link set eth0 up
ip -n "$ns" route add default via 10.250.254.2

# The payments pod: a small fixed answer on 127.0.0.1:18080 behind its sidecar.
cat >"$work/app.py" <<'PY'
import http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = b"x" * 64
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 18080), H).serve_forever()
PY
python3 "$work/app.py" & pids+=($!)
cat >"$work/payments.yaml" <<EOF
identity: { cert: $work/payments.crt, key: $work/payments.key, ca: $work/ca.crt }
inbound: { listen: 10.250.254.2:15008, app_host: 127.0.0.1, default_port: 18080 }
outbound: { listen: 127.0.0.1:25001 }
admin: { listen: 127.0.0.1:25000 }
catalog: { path: $work/empty.yaml }
EOF
echo "services: {}" >"$work/empty.yaml"
cat >"$work/catalog.yaml" <<EOF
services:
  payments:
    default_port: 18080
    identity: spiffe://aether.local/ns/default/sa/payments
    endpoints:
      - { address: 10.250.254.2, ports: [18080] }
EOF
cat >"$work/frontend.yaml" <<EOF
identity: { cert: $work/frontend.crt, key: $work/frontend.key, ca: $work/ca.crt }
inbound: { listen: 10.250.254.1:15008 }
outbound: { listen: 127.0.0.1:15001 }
admin: { listen: 127.0.0.1:15000 }
catalog: { path: $work/catalog.yaml }
EOF
chmod -R a+rX "$work"
"$work/aether-proxy" run --config "$work/payments.yaml" --concurrency 1 >/dev/null 2>&1 & pids+=($!)
ip netns exec "$ns" "$work/aether-proxy" redirect --proxy-uid 1337 --apply
ip netns exec "$ns" setpriv --reuid=1337 --regid=1337 --clear-groups \
  "$work/aether-proxy" run --config "$work/frontend.yaml" --concurrency 1 >/dev/null 2>&1 & pids+=($!)
client=$!
sleep 1
vip=$(ip netns exec "$ns" curl -s http://127.0.0.1:15000/config_dump |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["catalog"]["virtual_ips"]["payments"])')

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
measure() { # label url extra-wrk-args...
  local label=$1 url=$2; shift 2
  local c0 c1 n rps
  c0=$(ticks "$client")
  ip netns exec "$ns" wrk -t1 -c16 -d"${secs}s" -H 'Host: payments.aether.internal' "$@" "$url" >"$work/run.txt" 2>&1
  c1=$(ticks "$client")
  n=$(awk '/requests in/{print $1}' "$work/run.txt")
  rps=$(awk '/^Requests\/sec/{print $2}' "$work/run.txt")
  awk -v l="$label" -v c=$((c1 - c0)) -v n="$n" -v hz="$hz" -v r="$rps" \
    'BEGIN{ printf "%-34s %9s req/s  client %.1f us/req\n", l, r, c/hz*1e6/n }'
}
echo "client sidecar: $bin, --concurrency 1; ${secs}s per run, $rounds rounds, alternated"
for _ in $(seq "$rounds"); do
  measure "explicit keep-alive" "http://127.0.0.1:15001/"
  measure "captured keep-alive" "http://$vip:18080/"
  measure "explicit new conn per request" "http://127.0.0.1:15001/" -H 'Connection: close'
  measure "captured new conn per request" "http://$vip:18080/" -H 'Connection: close'
done
