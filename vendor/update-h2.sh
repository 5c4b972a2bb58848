#!/usr/bin/env bash
# Rebuilds vendor/h2/ from the crates.io release of h2 named in vendor/h2-patches/UPSTREAM plus
# the patches in vendor/h2-patches/*.patch, applied in file-name order
# (docs/decisions/0013-vendored-h2.md).
#
#   vendor/update-h2.sh            rebuild vendor/h2/ for the version in UPSTREAM
#   vendor/update-h2.sh VERSION    move to another upstream release: fetch it, check its
#                                  checksum against the crates.io index, apply the patches,
#                                  record VERSION in UPSTREAM and update Cargo.lock
#   vendor/update-h2.sh --check    rebuild into a temporary directory and fail if vendor/h2/
#                                  differs from it (CI)
#
# The .crate comes from cargo's download cache when it is there, else from static.crates.io;
# either way its SHA-256 must equal the one recorded in UPSTREAM (or, for a new VERSION, the
# one the crates.io index lists). A patch that no longer applies stops the script and names
# the patch: fix it against the new release, or drop it if upstream now does the same.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
patches=$here/h2-patches
upstream_file=$patches/UPSTREAM

mode=write version= want=
case "${1:-}" in
  --check) mode=check ;;
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
  '') ;;
  -*) echo "unknown option $1" >&2; exit 2 ;;
  *) version=$1 ;;
esac

read -r name cur_version cur_sum <"$upstream_file"
[ "$name" = h2 ] || { echo "$upstream_file: expected 'h2 VERSION SHA256'" >&2; exit 1; }
if [ -z "$version" ] || [ "$version" = "$cur_version" ]; then
  version=$cur_version want=$cur_sum
else
  [ "$mode" = write ] || { echo "--check takes no version" >&2; exit 2; }
  want=$(curl -fsSL https://index.crates.io/h2/h2 | python3 -c '
import json, sys
v = sys.argv[1]
for line in sys.stdin:
    e = json.loads(line)
    if e["vers"] == v:
        print(e["cksum"]); break
' "$version")
  [ -n "$want" ] || { echo "h2 $version is not in the crates.io index" >&2; exit 1; }
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
crate=$work/h2-$version.crate
cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/h2-"$version".crate 2>/dev/null | head -n1 || true)
if [ -n "$cached" ]; then
  cp "$cached" "$crate"
else
  curl -fsSL -o "$crate" "https://static.crates.io/crates/h2/h2-$version.crate"
fi
got=$(sha256sum "$crate" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "h2-$version.crate: sha256 $got, expected $want" >&2; exit 1; }

tar -xzf "$crate" -C "$work"
tree=$work/h2-$version
for p in "$patches"/*.patch; do
  [ -e "$p" ] || continue
  patch -d "$tree" -p1 -s -f --no-backup-if-mismatch <"$p" ||
    { echo "$(basename "$p") does not apply to h2 $version" >&2; exit 1; }
done

if [ "$mode" = check ]; then
  # A build of the crate on its own leaves target/ there; it is not part of the crate.
  if ! diff -r -x target "$tree" "$root/vendor/h2" >"$work/diff"; then
    head -n 40 "$work/diff" >&2
    echo "vendor/h2/ is not h2 $version plus vendor/h2-patches/ (run vendor/update-h2.sh)" >&2
    exit 1
  fi
  echo "vendor/h2/ is h2 $version plus $(ls "$patches"/*.patch 2>/dev/null | wc -l) patches"
  exit 0
fi

rm -rf "$root/vendor/h2"
mv "$tree" "$root/vendor/h2"
echo "h2 $version $want" >"$upstream_file"
if [ "$version" != "$cur_version" ]; then
  (cd "$root" && cargo update -p h2)
fi
# The crate's own .gitignore names Cargo.lock; -f keeps every file under version control, and the
# exclusion keeps out a target/ that running the crate's tests in place leaves behind.
echo "vendor/h2/ is h2 $version plus patches; commit it with: git add -A -f vendor ':(exclude)vendor/h2/target'"
