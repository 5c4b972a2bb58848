#!/usr/bin/env bash
# Captured HTTP against the explicit path, in one sitting: a client pod namespace with the
# capture rules and its sidecar (uid 1337), a payments pod (sidecar + app) on this machine at the
# veth's far end, and wrk inside the namespace, once to the service's virtual address (captured)
# and once to 127.0.0.1:15001 with the mesh Host (explicit). Prints req/s and the client sidecar's
# CPU microseconds per request, for keep-alive connections and for a new connection per request,
# each as many as wrk can send (closed loop) and then with h2load at one rate for both paths.
# Then captured raw TCP: 1 GiB (BULK_MIB) from a plain client in the pod to the service's
# virtual address on a tcp port, through both sidecars, to a sink app; prints MiB/s and each
# sidecar's CPU seconds per GiB.
#
#   sudo benches/capture.sh [seconds] [rounds]    (default 10 s, 3 rounds; needs root, ip,
#                                                  iptables, setpriv, wrk, h2load, nginx,
#                                                  python3)
# AETHER_BIN picks the binary (default target/release/aether-proxy, built if missing).
# PIN="<load> <client sidecar> <server sidecar> <apps>" pins each to a CPU list with taskset
# (e.g. PIN="0 0 1 1": wrk, h2load or the tcp client with the client sidecar on CPU 0); which
# processes share a core decides much of the rate on a 2-core machine (README.md, "What bounds g").
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
rounds=${2:-3}
bin=${AETHER_BIN:-target/release/aether-proxy}
[ -x "$bin" ] || cargo build --release --quiet
for t in ip iptables-restore setpriv wrk h2load nginx python3; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 1; }
done

pin_load=() pin_client=() pin_server=() pin_app=()
if [ -n "${PIN:-}" ]; then
  read -r pl pc ps pa <<<"$PIN"
  [ -n "$pa" ] || { echo "PIN needs four CPU lists" >&2; exit 2; }
  pin_load=(taskset -c "$pl") pin_client=(taskset -c "$pc") pin_server=(taskset -c "$ps")
  pin_app=(taskset -c "$pa")
fi

ns=aebench-$$
host_if=aeb$(($$ % 100000))
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # The sidecars drain before they exit, and a run started next needs their ports: wait for
  # each (10 s at most, then SIGKILL).
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  ip link del "$host_if" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cp "$bin" "$work/aether-proxy"
cp certs/ca.crt certs/frontend.crt certs/frontend.key certs/payments.crt certs/payments.key "$work/"
ip netns add "$ns"
ip link add "$host_if" type veth peer name eth0 netns "$ns"
ip addr add 10.250.254.2/28 dev "$host_if" && ip link set "$host_if" up
ip -n "$ns" addr add 10.250.254.1/28 dev eth0
ip -n "$ns" link set lo up && ip -n "$ns" link set eth0 up
ip -n "$ns" route add default via 10.250.254.2

# The payments pod: a small fixed answer on 127.0.0.1:18080 behind its sidecar (nginx, so the
# app is never what limits the rate; Python's http.server stalls on delayed ACKs). nginx takes
# more connections than the client sidecar's request breaker lets through (1024): at nginx's
# usual 1024, a rate the pair could not keep up with piled up enough requests for nginx to
# close idle connections to make room, the server sidecar then answered 503 `app-unavailable`
# for requests handed to those (it sends them again on a new connection since), and five of
# those made the client sidecar eject the service's only endpoint (outlier detection),
# failing every request of the runs after it for 30 s and then 60 s.
cat >"$work/nginx.conf" <<EOF
worker_processes 1; daemon off; pid $work/nginx.pid; error_log $work/nginx.err;
worker_rlimit_nofile 16384; events { worker_connections 8192; }
http { access_log off; server { listen 127.0.0.1:18080; keepalive_requests 1000000;
  location / { return 200 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"; } } }
EOF
"${pin_app[@]}" nginx -c "$work/nginx.conf" & pids+=($!)
# A tcp app that counts what it received and answers the count when the client is done.
cat >"$work/sink.py" <<'PY'
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 15432))
s.listen(8)
while True:
    c, _ = s.accept()
    buf, n = bytearray(1 << 20), 0
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        n += k
    c.sendall(str(n).encode())
    c.close()
PY
"${pin_app[@]}" python3 "$work/sink.py" & pids+=($!)
cat >"$work/payments.yaml" <<EOF
identity: { cert: $work/payments.crt, key: $work/payments.key, ca: $work/ca.crt }
inbound:
  listen: 10.250.254.2:15008
  app_host: 127.0.0.1
  default_port: 18080
  ports: [{ port: 18080, protocol: auto }, { port: 15432, protocol: tcp }]
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
    protocols: { 15432: tcp }
    endpoints:
      - { address: 10.250.254.2, ports: [18080, 15432] }
EOF
cat >"$work/frontend.yaml" <<EOF
identity: { cert: $work/frontend.crt, key: $work/frontend.key, ca: $work/ca.crt }
inbound: { listen: 10.250.254.1:15008 }
outbound: { listen: 127.0.0.1:15001 }
admin: { listen: 127.0.0.1:15000 }
catalog: { path: $work/catalog.yaml }
EOF
chmod -R a+rX "$work"
"${pin_server[@]}" "$work/aether-proxy" run --config "$work/payments.yaml" --concurrency 1 >/dev/null 2>&1 & pids+=($!)
server=$!
ip netns exec "$ns" "$work/aether-proxy" redirect --proxy-uid 1337 --apply
ip netns exec "$ns" "${pin_client[@]}" setpriv --reuid=1337 --regid=1337 --clear-groups \
  "$work/aether-proxy" run --config "$work/frontend.yaml" --concurrency 1 >/dev/null 2>&1 & pids+=($!)
client=$!
sleep 1
vip=$(ip netns exec "$ns" curl -s http://127.0.0.1:15000/config_dump |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["catalog"]["virtual_ips"]["payments"])')

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
# Each run prints a line and records `label<TAB>req/s<TAB>µs per request` in runs.tsv.
record() { # label req/s cpu-ticks requests [note]
  awk -v l="$1" -v r="$2" -v c="$3" -v n="$4" -v hz="$hz" -v note="${5:-}" -v tsv="$work/runs.tsv" \
    'BEGIN{ us = n ? c/hz*1e6/n : 0
            printf "%-34s %9.0f req/s  client %.1f us/req%s\n", l, r, us, note
            printf "%s\t%f\t%f\n", l, r, us >> tsv }'
}
measure() { # label url extra-wrk-args...
  local label=$1 url=$2; shift 2
  local c0 c1
  c0=$(ticks "$client")
  ip netns exec "$ns" "${pin_load[@]}" wrk -t1 -c16 -d"${secs}s" -H 'Host: payments.aether.internal' "$@" "$url" >"$work/run.txt" 2>&1
  c1=$(ticks "$client")
  record "$label" "$(awk '/^Requests\/sec/{print $2}' "$work/run.txt")" $((c1 - c0)) \
    "$(awk '/requests in/{print $1}' "$work/run.txt")"
}
# The same pair at one fixed rate, at most 80% of the slower of the two closed-loop runs before
# it (less when the pair cannot keep up with that; see the loop at the end). In a closed loop
# the captured run's client (wrk) also pays for the capture (NAT and a new route for each
# packet it sends), so it offers the sidecar fewer requests per wakeup, which makes each one
# dearer for a reason that is not the sidecar's. At one offered rate for both paths the load has
# the same shape and only the sidecar's own difference is left. h2load holds the rate: per
# connection (--rps) for keep-alive, by opening connections every 10 ms for a new connection
# per request.
h2load_at() { # url kind rate seconds: into run.txt
  local url=$1 kind=$2 rate=$3 secs=$4 n per
  local args=(--h1 -t1 -H ':authority: payments.aether.internal')
  if [ "$kind" = keep-alive ]; then
    args+=(-c16 --rps=$((rate / 16 > 0 ? rate / 16 : 1)) -D "$secs")
  else
    per=$((rate / 100 > 0 ? rate / 100 : 1))
    n=$((per * 100 * secs))
    args+=(-H 'Connection: close' -n "$n" -c "$n" -r "$per" --rate-period 10ms)
  fi
  ip netns exec "$ns" "${pin_load[@]}" h2load "${args[@]}" "$url" >"$work/run.txt" 2>&1 || true
}
# The client sidecar's answers other than 200, by code and error, and its breakers' refusals,
# summed over its metrics: a run's failures are then attributed to the sidecar's own answers
# (e.g. 503 `overflow` when a stall piles up more than a breaker admits) or, if not there, to
# connections that ended without one.
not_ok() {
  ip netns exec "$ns" curl -s http://127.0.0.1:15000/metrics | awk '
    /^aether_requests_total\{/ && !/code="200"/ { match($0, /code="[0-9]+"/); k = substr($0, RSTART, RLENGTH); n[k] += $NF }
    /^aether_cluster_overflow_total\{/ { n["overflow"] += $NF }
    END { for (k in n) printf "%s %d\n", k, n[k] }'
}
measure_rate() { # label url kind rate
  local label=$1 url=$2 kind=$3 rate=$4 c0 c1 answered failed errored before after note
  before=$(not_ok)
  c0=$(ticks "$client")
  h2load_at "$url" "$kind" "$rate" "$secs"
  c1=$(ticks "$client")
  after=$(not_ok)
  # Per answered request, failed ones included: a 503 from the breaker cost the sidecar too.
  answered=$(awk '/^requests:/{print $6}' "$work/run.txt")
  failed=$(awk '/^requests:/{print $10}' "$work/run.txt")
  errored=$(awk '/^requests:/{print $12}' "$work/run.txt")
  note="  (${failed:-?} failed, ${errored:-?} of them without an answer)"
  if [ "${failed:-0}" != 0 ]; then
    # h2load counts an answer other than 2xx or 3xx as failed too: say what it was.
    note+="; $(grep '^status codes:' "$work/run.txt"); the client sidecar: $(awk 'NR == FNR {
      b[$1] = $2; next } $2 > b[$1] { printf "%s +%d ", $1, $2 - b[$1] }' <(echo "$before") \
      <(echo "$after"))"
  fi
  record "$label" $((${answered:-0} / secs)) $((c1 - c0)) "${answered:-0}" "$note"
}
pair() { # round how label [args...]: `how` (measure or measure_rate) on the explicit and the
  # captured path, in an order that turns each round
  local round=$1 how=$2 label=$3; shift 3
  local explicit=("explicit $label" "http://127.0.0.1:15001/") captured=("captured $label" "http://$vip:18080/")
  if [ $((round % 2)) -eq 1 ]; then
    "$how" "${explicit[@]}" "$@"
    "$how" "${captured[@]}" "$@"
  else
    "$how" "${captured[@]}" "$@"
    "$how" "${explicit[@]}" "$@"
  fi
}
slower_rate() { # kind: 80% of the slower closed-loop run of this kind in the round just run
  tail -2 "$work/runs.tsv" | awk -F'\t' -v k="$1" '
    $1 == "explicit " k || $1 == "captured " k { if (!n++ || $2 < low) low = $2 }
    END { printf "%d", low * 0.8 }'
}
# The order turns each round: the run that goes second inherits the first one's TIME_WAIT
# sockets and conntrack entries (a new connection per request leaves ~140,000), which with a
# fixed order would be charged to the captured path every time.
echo "client sidecar: $bin, --concurrency 1; ${secs}s per run, $rounds rounds, order alternated"
for round in $(seq "$rounds"); do
  for kind in "keep-alive" "new conn per request"; do
    close=()
    [ "$kind" = keep-alive ] || close=(-H 'Connection: close')
    pair "$round" measure "$kind" "${close[@]}"
    rate=$(slower_rate "$kind")
    # Two unrecorded seconds at that rate first (a step from wrk's 16 connections makes the
    # sidecars open upstream connections; its first half second can be slow enough for the
    # breaker to answer some 503s), then a run as long as a measured one that must be answered
    # in full (two seconds were not enough to find stalls that come every few). A rate the
    # pair cannot keep up with piles requests up until the client sidecar's request breaker
    # answers 503 `overflow` (h2load counts them failed), and the CPU per request then measures
    # the overload, not the path. h2load opening connections at a rate costs the machine more
    # than wrk's closed loop, so 80% of that loop can be too much (requests of a new connection
    # per request were refused on one machine): the rate steps down by a fifth until a run of
    # it is answered in full.
    h2load_at "http://127.0.0.1:15001/" "$kind" "$rate" 2
    for _ in 1 2 3 4; do
      h2load_at "http://127.0.0.1:15001/" "$kind" "$rate" "$secs"
      [ "$(awk '/^requests:/{print $10}' "$work/run.txt")" = 0 ] && break
      rate=$((rate * 4 / 5))
    done
    pair "$round" measure_rate "$kind at equal rate" "$kind" "$rate"
  done
done
# Each round's own ratio, then their median (the rounds drift more than the paths differ).
us_of() { # label: the µs per request of each run so labelled, in order
  awk -F'\t' -v l="$1" '$1 == l {print $3}' "$work/runs.tsv"
}
for kind in "keep-alive" "new conn per request" "keep-alive at equal rate" \
  "new conn per request at equal rate"; do
  us_of "explicit $kind" >"$work/e.txt"
  us_of "captured $kind" >"$work/c.txt"
  paste "$work/c.txt" "$work/e.txt" | awk '{print $1 / $2}' | sort -n |
    awk -v k="$kind" '{r[NR] = $1} END {
      m = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
      printf "captured / explicit, %s: median %.3f of %d rounds (%.3f-%.3f)\n", k, m, NR, r[1], r[NR] }'
done

# Captured raw TCP: the pod's client dials the virtual address on the tcp port.
cat >"$work/send.py" <<'PY'
import socket, sys, time
dst, mib = (sys.argv[1], 15432), int(sys.argv[2])
chunk = b"\xab" * (1 << 20)
c = socket.create_connection(dst)
t0 = time.monotonic()
for _ in range(mib):
    c.sendall(chunk)
c.shutdown(socket.SHUT_WR)
got = int(c.recv(64) or b"0")
t = time.monotonic() - t0
assert got == mib << 20, f"sink received {got} bytes of {mib << 20}"
print(f"{mib / t:.0f}")
PY
bulk=${BULK_MIB:-1024}
for _ in $(seq "$rounds"); do
  c0=$(ticks "$client"); s0=$(ticks "$server")
  rate=$(ip netns exec "$ns" "${pin_load[@]}" python3 "$work/send.py" "$vip" "$bulk")
  c1=$(ticks "$client"); s1=$(ticks "$server")
  awk -v r="$rate" -v c=$((c1 - c0)) -v s=$((s1 - s0)) -v hz="$hz" -v m="$bulk" \
    'BEGIN{ printf "%-34s %9s MiB/s  client %.2f s/GiB  server %.2f s/GiB\n", "captured tcp, " m " MiB", r, c/hz*1024/m, s/hz*1024/m }'
done
