#!/usr/bin/env bash
# What an idle downstream connection costs: a client sidecar (outbound, plaintext from the app)
# in front of a server sidecar and nginx, all on loopback. For h1 and for h2 (prior knowledge),
# a fresh client sidecar gets COUNT connections that each make one request and then stay idle;
# prints the sidecar's RSS before and with them open, and the growth per connection.
#
# Then what a tunnel costs once a bulk transfer through it has ended: TUNNELS (default 200) CONNECT
# tunnels to a tcp port each send BULK_KIB (default 4096) KiB to an app and stay open; prints
# both sidecars' RSS with them open right after the bulk and again after the splices' quiet
# second (when grown buffers are given back and the allocator trimmed).
#
#   benches/idle.sh [count]     (default 10000; needs nginx and python3)
# AETHER_BIN picks the binary (default target/release/aether-proxy, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-10000}
bin=${AETHER_BIN:-target/release/aether-proxy}
[ -x "$bin" ] || cargo build --release --quiet
for t in nginx python3; do command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 1; }; done
# Each process (the driver, the sidecar) holds COUNT sockets and a few more.
need=$((count + 1024))
[ "$(ulimit -Sn)" -ge "$need" ] || ulimit -n "$need" ||
  { echo "needs $need open files per process (ulimit -n)" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" certs --out "$work/certs" --trust-domain aether.local \
  --workload default/payments --workload default/frontend >/dev/null
cat >"$work/nginx.conf" <<EOF
worker_processes 1; daemon off; pid $work/nginx.pid; error_log $work/nginx.err;
events { worker_connections 1024; }
http { access_log off; server { listen 127.0.78.1:8080; keepalive_requests 1000000;
  location / { return 200 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"; } } }
EOF
nginx -c "$work/nginx.conf" & pids+=($!)
echo "services: {}" >"$work/empty.yaml"
cat >"$work/server.yaml" <<EOF
identity: { cert: $work/certs/payments.crt, key: $work/certs/payments.key, ca: $work/certs/ca.crt }
inbound:
  listen: 127.0.78.2:15008
  app_host: 127.0.78.1
  default_port: 8080
  ports: [{ port: 8080, protocol: auto }, { port: 5432, protocol: tcp }]
outbound: { listen: 127.0.78.2:15001 }
admin: { listen: 127.0.78.2:15000 }
catalog: { path: $work/empty.yaml }
EOF
cat >"$work/catalog.yaml" <<EOF
services:
  payments:
    default_port: 8080
    identity: spiffe://aether.local/ns/default/sa/payments
    protocols: { 5432: tcp }
    endpoints:
      - { address: 127.0.78.2, ports: [8080, 5432] }
EOF
cat >"$work/client.yaml" <<EOF
identity: { cert: $work/certs/frontend.crt, key: $work/certs/frontend.key, ca: $work/certs/ca.crt }
inbound: { listen: 127.0.78.3:15008, app_host: 127.0.78.1, default_port: 8080 }
outbound: { listen: 127.0.78.3:15001 }
admin: { listen: 127.0.78.3:15000 }
catalog: { path: $work/catalog.yaml }
EOF
RUST_LOG=warn "$bin" run --config "$work/server.yaml" --concurrency 1 >/dev/null 2>&1 &
server=$!
pids+=($server)

rss_kib() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }
echo "client sidecar: $bin, --concurrency 1; $count idle downstream connections, one request each"
for proto in h1 h2; do
  RUST_LOG=warn "$bin" run --config "$work/client.yaml" --concurrency 1 >/dev/null 2>&1 &
  client=$!
  for _ in $(seq 100); do
    curl -s -o /dev/null -H "Host: payments.aether.internal" http://127.0.78.3:15001/ && break
    sleep 0.1
  done
  before=$(rss_kib "$client")
  mkfifo "$work/hold"
  python3 benches/idle.py 127.0.78.3:15001 payments.aether.internal "$count" "$proto" \
    <"$work/hold" >"$work/idle.out" &
  driver=$!
  exec 9>"$work/hold"
  for _ in $(seq 600); do grep -q '^open' "$work/idle.out" && break; sleep 0.1; done
  sleep 1
  during=$(rss_kib "$client")
  exec 9>&-
  wait "$driver"
  rm -f "$work/hold"
  awk -v p="$proto" -v b="$before" -v d="$during" -v n="$count" -v o="$(cat "$work/idle.out" | tr '\n' ' ')" \
    'BEGIN{ printf "%-3s RSS %6.1f MiB idle -> %6.1f MiB with them open: %5.1f KiB per connection  (%s)\n", p, b/1024, d/1024, (d-b)/n, o }'
  kill -TERM "$client"
  wait "$client" 2>/dev/null || true
done

# Tunnels after bulk. The app counts what each tunnel brings and answers one byte once it has
# all of it, then holds the connection open.
tunnels=${TUNNELS:-200} bulk_kib=${BULK_KIB:-4096}
cat >"$work/ack.py" <<PY
import asyncio
async def serve(r, w):
    left = $bulk_kib * 1024
    while left > 0:
        data = await r.read(1 << 20)
        if not data:
            return
        left -= len(data)
    w.write(b"k")
    await w.drain()
    await r.read()
async def main():
    async with await asyncio.start_server(serve, "127.0.78.1", 5432, backlog=1024) as s:
        await s.serve_forever()
asyncio.run(main())
PY
python3 "$work/ack.py" & pids+=($!)
# Fresh sidecars on both sides, so each one's RSS is the tunnels' alone.
kill -TERM "$server"
wait "$server" 2>/dev/null || true
RUST_LOG=warn "$bin" run --config "$work/server.yaml" --concurrency 1 >/dev/null 2>&1 &
server=$!
pids+=($server)
RUST_LOG=warn "$bin" run --config "$work/client.yaml" --concurrency 1 >/dev/null 2>&1 &
client=$!
pids+=($client)
for _ in $(seq 100); do
  curl -s -o /dev/null -H "Host: payments.aether.internal" http://127.0.78.3:15001/ && break
  sleep 0.1
done
echo "then $tunnels CONNECT tunnels to a tcp port, $bulk_kib KiB through each, then idle"
before="$(rss_kib "$client") $(rss_kib "$server")"
mkfifo "$work/hold"
python3 benches/idle.py 127.0.78.3:15001 payments.aether.internal:5432 "$tunnels" "tcp:$bulk_kib" \
  <"$work/hold" >"$work/idle.out" &
driver=$!
exec 9>"$work/hold"
for _ in $(seq 1200); do grep -q '^open' "$work/idle.out" && break; sleep 0.1; done
after_bulk="$(rss_kib "$client") $(rss_kib "$server")"
sleep 3
quiet="$(rss_kib "$client") $(rss_kib "$server")"
exec 9>&-
wait "$driver"
awk -v b="$before" -v a="$after_bulk" -v q="$quiet" -v n="$tunnels" -v o="$(tr '\n' ' ' <"$work/idle.out")" 'BEGIN {
  split(b, B); split(a, A); split(q, Q)
  printf "client sidecar RSS %6.1f MiB -> %6.1f right after the bulk -> %6.1f after 3 s: %6.1f KiB per tunnel\n", B[1]/1024, A[1]/1024, Q[1]/1024, (Q[1]-B[1])/n
  printf "server sidecar RSS %6.1f MiB -> %6.1f right after the bulk -> %6.1f after 3 s: %6.1f KiB per tunnel  (%s)\n", B[2]/1024, A[2]/1024, Q[2]/1024, (Q[2]-B[2])/n, o }'
