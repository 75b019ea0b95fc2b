#!/bin/bash
# Fetch erofs-utils 1.8 (mkfs.erofs, fsck.erofs) from Debian 13 (trixie) into a private
# directory, for bench/convert.py's "erofs-utils 1.8 --tar" peer.  Never installed over the
# system's erofs-utils (Debian 12 ships 1.5, which the tests use): the trixie .debs of
# erofs-utils and of every library it needs, C library and dynamic loader included, are
# unpacked under DEST and run through that loader with --library-path, so nothing of the
# host's libraries is mixed in.
#
# apt runs with a private configuration (its own sources list, package lists and cache, in a
# temporary directory removed at exit): /etc/apt and the system's package lists are not touched.
#
#   bash bench/peers/erofs-utils.sh            # fetch unless DEST is complete; print DEST
#   bash bench/peers/erofs-utils.sh --force    # fetch again
#
# Environment: LAYERBOX_PEERS_DIR (default /var/cache/layerbox/peers; DEST is
# $LAYERBOX_PEERS_DIR/erofs-utils-1.8), DEBIAN_MIRROR (default http://deb.debian.org/debian).
# DEST holds root/ (the unpacked packages), bin/mkfs.erofs and bin/fsck.erofs (wrappers),
# command (the wrapper's argv prefix, one word a line, for programs that exec it directly),
# packages (name=version of every .deb unpacked) and complete (written last).
set -euo pipefail

SUITE=trixie
WANT=1.8
PEERS_DIR=${LAYERBOX_PEERS_DIR:-/var/cache/layerbox/peers}
DEST=$PEERS_DIR/erofs-utils-$WANT
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

die() { echo "erofs-utils.sh: $*" >&2; exit 1; }

force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  *) die "usage: bash bench/peers/erofs-utils.sh [--force]" ;;
esac

if [ "$force" = 0 ] && [ -e "$DEST/complete" ]; then
  echo "$DEST"
  exit 0
fi
for tool in apt-get apt-cache dpkg-deb; do
  command -v "$tool" >/dev/null || die "$tool is missing: this script needs Debian's apt and dpkg"
done
[ -r "$KEYRING" ] || die "$KEYRING is missing: apt-get install debian-archive-keyring"
# Debian 12's keyring has carried the trixie keys since 2023.3+deb12u1
gpg_keys=$(LC_ALL=C tr -c '[:print:]' '\n' < "$KEYRING" | grep -c 'trixie' || true)
[ "$gpg_keys" -gt 0 ] || die "$KEYRING has no Debian 13 (trixie) key: apt-get install debian-archive-keyring (2023.3+deb12u1 or later)"
mkdir -p "$PEERS_DIR" 2>/dev/null || die "cannot create $PEERS_DIR: run as root or set LAYERBOX_PEERS_DIR"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/layerbox-peer-erofs.XXXXXX")
build="$PEERS_DIR/.erofs-utils-$WANT.tmp-$$"
trap 'rm -rf "$tmp" "$build"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/empty" "$tmp/debs" "$build/root" "$build/bin"
cat > "$tmp/trixie.sources" <<SOURCES
Types: deb
URIs: $MIRROR
Suites: $SUITE
Components: main
Signed-By: $KEYRING
SOURCES
apt_opts=(
  -q -o "Dir::Etc::SourceList=$tmp/trixie.sources" -o "Dir::Etc::SourceParts=$tmp/empty"
  -o "Dir::Etc::Preferences=$tmp/empty/none" -o "Dir::Etc::PreferencesParts=$tmp/empty"
  -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache"
)
# as root apt drops to the _apt user to download, which cannot write into our 0700 directory
[ "$(id -u)" -ne 0 ] || apt_opts+=(-o APT::Sandbox::User=root)

echo "erofs-utils.sh: reading the $SUITE package list from $MIRROR" >&2
apt-get "${apt_opts[@]}" update >"$tmp/update.log" 2>&1 || { cat "$tmp/update.log" >&2; die "apt-get update of $SUITE failed"; }
version=$(apt-cache "${apt_opts[@]}" show --no-all-versions erofs-utils | sed -n 's/^Version: //p')
case "$version" in
  $WANT.*) ;;
  "") die "$SUITE has no erofs-utils package" ;;
  *) die "$SUITE's erofs-utils is $version, not $WANT.x: update WANT/SUITE in this script" ;;
esac
# erofs-utils and everything it needs to run (the C library brings the loader); no virtual
# packages occur in this closure, so the names are downloadable as they are
mapfile -t packages < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances erofs-utils | grep -v '^ ' | grep -v '^<' | sort -u)
echo "erofs-utils.sh: downloading erofs-utils $version and ${#packages[@]} package(s) in all: ${packages[*]}" >&2
(cd "$tmp/debs" && apt-get "${apt_opts[@]}" download "${packages[@]}" >"$tmp/download.log" 2>&1) \
  || { cat "$tmp/download.log" >&2; die "apt-get download failed"; }
for deb in "$tmp"/debs/*.deb; do
  dpkg-deb -x "$deb" "$build/root"
  dpkg-deb -f "$deb" Package Version | paste -sd= | sed 's/^Package: //; s/=Version: /=/' >> "$build/packages"
done

libc=$(find "$build/root" -name libc.so.6 -print -quit)
[ -n "$libc" ] || die "no libc.so.6 in the unpacked packages"
libdir=$(dirname "$libc")
loader=$(find "$libdir" -maxdepth 1 -name 'ld-linux*.so.*' -print -quit)
[ -n "$loader" ] || die "no dynamic loader (ld-linux*.so.*) in $libdir"
# paths as they will be once $build is renamed to $DEST
final() { echo "$DEST${1#"$build"}"; }
for prog in mkfs.erofs fsck.erofs; do
  [ -x "$build/root/usr/bin/$prog" ] || die "erofs-utils $version has no /usr/bin/$prog"
  # every library must resolve inside root/, none from the host
  listed=$("$loader" --inhibit-cache --library-path "$libdir" --list "$build/root/usr/bin/$prog")
  outside=$(echo "$listed" | awk '/=>/ && $3 !~ /^\// { next } /=>/ { print $3 }' | grep -v "^$build/" || true)
  if echo "$listed" | grep -q 'not found' || [ -n "$outside" ]; then
    die "$prog needs libraries the packages do not provide: $listed"
  fi
  cat > "$build/bin/$prog" <<WRAPPER
#!/bin/sh
# erofs-utils $version from Debian $SUITE, run with its own loader and libraries (bench/peers/erofs-utils.sh)
exec "$(final "$loader")" --inhibit-cache --library-path "$(final "$libdir")" "$(final "$build/root/usr/bin/$prog")" "\$@"
WRAPPER
  chmod 755 "$build/bin/$prog"
done
printf '%s\n' "$(final "$loader")" --inhibit-cache --library-path "$(final "$libdir")" \
  "$(final "$build/root/usr/bin/mkfs.erofs")" > "$build/command"
"$loader" --inhibit-cache --library-path "$libdir" "$build/root/usr/bin/mkfs.erofs" --version | grep -q "$WANT" \
  || die "the unpacked mkfs.erofs does not report version $WANT"
echo "$version" > "$build/complete"

rm -rf "$DEST"
mv "$build" "$DEST"
"$DEST/bin/mkfs.erofs" --version | head -1 >&2
echo "$DEST"
