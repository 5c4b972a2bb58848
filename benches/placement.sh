#!/usr/bin/env bash
# Runs the side-by-side bench (../shared/bench/run.sh) with its four processes pinned, one CPU
# list each: the app (nginx), the server proxy, the client proxy and the load tool (wrk, h2load,
# or curl for scenario g). On a 2-core machine the scheduler puts those four two to a core, and
# which two share decides much of the rate (benches/README.md, "What bounds g"); pinned, each
# proxy can be measured in the same placement.
#
#   benches/placement.sh <app> <server> <client> <load> [run.sh mode]    e.g. 0 0 1 1 bench
#
# Everything else is run.sh's own environment (PROXY, AETHER_BIN, ENVOY_BIN, SCENARIOS, ...).
# The pinning is done by small wrappers put first on PATH (and in ENVOY_BIN / AETHER_BIN), each
# of which execs the real program under `taskset`, so run.sh's process ids stay the programs'.
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
bench=${BENCH:-$here/../shared/bench/run.sh}
[ -x "$bench" ] || { echo "no bench at $bench (set BENCH)" >&2; exit 1; }
command -v taskset >/dev/null || { echo "needs taskset (util-linux)" >&2; exit 1; }
app=$1 server=$2 client=$3 load=$4 mode=${5:-bench}

wrap=$(mktemp -d)
trap 'rm -rf "$wrap"' EXIT
# wrapper <name> <real program> <cpus, or "side" to choose by the config file's name>
wrapper() {
  local cpus=$3
  if [ "$cpus" = side ]; then
    # A proxy is the server or the client by its config file (`*server.yaml`, `*client.cfg`);
    # a run without one (`--version`) is not pinned.
    cat >"$wrap/$1" <<EOF
#!/usr/bin/env bash
for a in "\$@"; do
  case "\$a" in
    *server.yaml|*server.cfg) exec taskset -c $server "$2" "\$@" ;;
    *client.yaml|*client.cfg) exec taskset -c $client "$2" "\$@" ;;
  esac
done
exec "$2" "\$@"
EOF
  else
    printf '#!/usr/bin/env bash\nexec taskset -c %s "%s" "$@"\n' "$cpus" "$2" >"$wrap/$1"
  fi
  chmod +x "$wrap/$1"
}
real() { command -v "$1" || { echo "needs $1" >&2; exit 1; }; }
wrapper nginx "$(real nginx)" "$app"
for t in wrk h2load curl; do wrapper "$t" "$(real "$t")" "$load"; done
case "${PROXY:-envoy}" in
  aether)
    wrapper aether-proxy "$(realpath "${AETHER_BIN:-$here/target/release/aether-proxy}")" side
    export AETHER_BIN=$wrap/aether-proxy ;;
  envoy)
    e=${ENVOY_BIN:-${CACHE:-/tmp/aether-bench}/envoy/envoy-${ENVOY_VERSION:-1.40.0}}
    [ -x "$e" ] || { echo "set ENVOY_BIN (or run run.sh once to fetch Envoy)" >&2; exit 1; }
    wrapper envoy "$(realpath "$e")" side
    export ENVOY_BIN=$wrap/envoy ;;
  haproxy) wrapper haproxy "$(real haproxy)" side ;;
esac
PATH=$wrap:$PATH "$bench" "$mode"
