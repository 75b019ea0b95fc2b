#!/bin/bash
# The stargz snapshotter (Debian sid's stargz-snapshotter 0.14.3) for bench/containerd.py's
# "stargz" peer, under /opt/layerbox beside containerd 2.x, never over system packages:
#
# * ctr-remote (converts images to eStargz, pulls lazily): Debian's stargz-snapshotter package,
#   unpacked with tools/deps/debian-unpack into $STARGZ_DIR;
# * the snapshotter daemon: Debian does not package upstream's containerd-stargz-grpc (the .deb
#   holds ctr-remote only, the -dev package leaves out cmd/containerd-stargz-grpc), so
#   bench/peers/stargz-grpc/main.go, a minimal daemon around the packaged library, is built
#   with Debian sid's Go and the library's Go dependencies (golang-*-dev, unpacked into a
#   temporary GOPATH, ~290 MB download, removed after the build) into $STARGZ_GRPC_DIR/bin.
#
#   bash bench/peers/stargz.sh            # a no-op once both are there for this main.go
#
# Environment: STARGZ_DIR (default /opt/layerbox/stargz-snapshotter), STARGZ_GRPC_DIR (default
# /opt/layerbox/stargz-grpc).  Needs only the Debian mirror; root to write /opt/layerbox.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
STARGZ_DIR=${STARGZ_DIR:-/opt/layerbox/stargz-snapshotter}
STARGZ_GRPC_DIR=${STARGZ_GRPC_DIR:-/opt/layerbox/stargz-grpc}
LIBRARY=golang-github-containerd-stargz-snapshotter-dev
main="$here/stargz-grpc/main.go"

die() { echo "stargz.sh: $*" >&2; exit 1; }

"$repo/tools/deps/debian-unpack" sid "$STARGZ_DIR" stargz-snapshotter

want="$(sha256sum < "$main" | cut -d' ' -f1)"
if [ -f "$STARGZ_GRPC_DIR/complete" ] && [ "$(cat "$STARGZ_GRPC_DIR/complete")" = "$want" ]; then
  exit 0
fi
work=$(mktemp -d /var/tmp/stargz-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb http://deb.debian.org/debian sid main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "Dir::State::status=/dev/null"
          -o "APT::Sandbox::User=root" -o "Debug::NoLocking=1" -q)
apt-get "${apt_opts[@]}" update >/dev/null
# the Go toolchain and every Go library the stargz library needs, by name (no C libraries: the
# daemon is built with CGO_ENABLED=0)
mapfile -t packages < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances golang-go "$LIBRARY" \
  | grep -E '^golang-' | grep -E -- '-dev$|^golang-go$|^golang-[0-9.]+-(go|src)$|^golang-src$' | sort -u)
[ "${#packages[@]}" -gt 10 ] || die "sid's $LIBRARY and golang-go resolve to ${#packages[@]} packages: ${packages[*]}"
"$repo/tools/deps/debian-unpack" sid "$work/root" "${packages[@]}" >/dev/null
goroot=$(find "$work/root/usr/lib" -maxdepth 1 -name 'go-1.*' -type d | sort -V | tail -1)
[ -x "$goroot/bin/go" ] || die "no Go toolchain in the unpacked golang-go ($work/root/usr/lib)"
mkdir -p "$work/out" "$work/gocache"
env -i PATH="$goroot/bin:/usr/bin:/bin" HOME="$work" GOROOT="$goroot" GOPATH="$work/root/usr/share/gocode" \
  GO111MODULE=off GOTOOLCHAIN=local GOCACHE="$work/gocache" CGO_ENABLED=0 \
  go build -o "$work/out/stargz-grpc" "$main" || die "building $main failed"
rm -rf "$STARGZ_GRPC_DIR.tmp"
mkdir -p "$STARGZ_GRPC_DIR.tmp/bin"
mv "$work/out/stargz-grpc" "$STARGZ_GRPC_DIR.tmp/bin/"
# what it was built from, for the bench's environment record
for pkg in "$LIBRARY" "$(basename "$goroot" | sed 's/^go-/golang-/')-go"; do
  echo "$pkg=$(apt-cache "${apt_opts[@]}" show --no-all-versions "$pkg" | sed -n 's/^Version: //p')"
done > "$STARGZ_GRPC_DIR.tmp/built-from"
echo "$want" > "$STARGZ_GRPC_DIR.tmp/complete"
rm -rf "$STARGZ_GRPC_DIR"
mv "$STARGZ_GRPC_DIR.tmp" "$STARGZ_GRPC_DIR"
echo "built $STARGZ_GRPC_DIR/bin/stargz-grpc ($(paste -sd' ' "$STARGZ_GRPC_DIR/built-from"))"
