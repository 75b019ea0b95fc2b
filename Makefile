# layerbox developer entry points.  On a fresh Debian 12 machine, as root:
#   make demo   build a Debian sample, publish it, mount it lazily, run a command, checkpoint, restore
#               (and the same in a microVM: it builds the guest assets first, as make test does)
#   make test   ruff, mypy and pytest (root-only tests included)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Lives inside .venv so that `rm -rf .venv` (or `make clean`) also forgets the install.
STAMP := $(VENV)/.layerbox-installed

# The real S3 the S3 tests also run on (tests/support/rgw.py: a single-node Ceph RGW, ~280 MB).
CEPH_DEB_PACKAGES := ceph-mon ceph-mgr ceph-osd radosgw ceph-common
DEB_PACKAGES := python3 python3-venv python3-dev erofs-utils fuse3 zstd mmdebstrap \
	util-linux skopeo umoci e2fsprogs kmod tar gzip attr docker-registry libfuse2 crun catatonit nftables iproute2 \
	gcc libc6-dev binutils procps containerd runc postgresql faketime \
	$(CEPH_DEB_PACKAGES)
# microVMs: QEMU >= 8.2 (a read-only private memory mapping for template restores); Debian 12 has
# 7.2, bookworm-backports 10.0.  The guest's kernel and busybox are downloaded by `layerbox vm assets`.
BACKPORTS_SOURCES := /etc/apt/sources.list.d/layerbox-backports.sources
BACKPORTS_PACKAGES := qemu-system-x86 qemu-utils
QEMU_MIN := 1:8.2
KERNEL_FILESYSTEMS := erofs overlay fuse
# Benchmark-only packages (the peers bench/sandbox.py measures against); never needed by the tests.
BENCH_DEB_PACKAGES := podman

DEMO_ARGS ?=

.PHONY: help deps backports containerd2 stargz vm-assets bench-deps bench-peers venv lint typecheck test demo clean

help:
	@echo "make deps      install missing Debian packages, load erofs/overlay/fuse (root)"
	@echo "make bench-deps  deps + the benchmarks' peer tools ($(BENCH_DEB_PACKAGES), erofs-utils 1.8, stargz) (root)"
	@echo "make venv      create $(VENV) and pip install -e '.[test]' (again when pyproject.toml changes)"
	@echo "make lint      ruff check ."
	@echo "make test      deps + venv + vm-assets, then ruff, mypy, pytest"
	@echo "make demo      deps + venv + vm-assets, then '$(BIN)/layerbox demo' (root; DEMO_ARGS=--json for JSON)"
	@echo "make vm-assets build the microVM guest (kernel, initramfs, agent) from Debian packages, once per host"
	@echo "make clean     remove $(VENV) and caches (never the data dir)"

# dpkg-query first so that a machine with everything installed needs neither root nor the network.
deps:
	@missing=""; \
	for pkg in $(DEB_PACKAGES); do \
	  status=$$(dpkg-query -W -f='$${db:Status-Status}' "$$pkg" 2>/dev/null || true); \
	  [ "$$status" = installed ] || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" -ne 0 ]; then \
	    echo "deps: missing Debian packages:$$missing -- run 'sudo make deps'" >&2; exit 1; \
	  fi; \
	  echo "deps: installing$$missing"; \
	  apt-get update -q; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi
	@# Built-in filesystems show up in /proc/filesystems without modprobe (and modprobe fails
	@# when /lib/modules is absent), so look there first and only warn: the tests and the demo
	@# say precisely what they miss.
	@for fs in $(KERNEL_FILESYSTEMS); do \
	  has_fs() { awk -v fs="$$1" '$$NF == fs { found = 1 } END { exit !found }' /proc/filesystems; }; \
	  has_fs "$$fs" && continue; \
	  modprobe "$$fs" 2>/dev/null || true; \
	  has_fs "$$fs" || echo "deps: warning: the kernel has no '$$fs' filesystem (modprobe $$fs failed)" >&2; \
	done
	@$(MAKE) --no-print-directory backports
	@$(MAKE) --no-print-directory containerd2

# QEMU from bookworm-backports unless a new enough one is installed (the same check-then-install).
backports:
	@missing=""; \
	for pkg in $(BACKPORTS_PACKAGES); do \
	  ver=$$(dpkg-query -W -f='$${db:Status-Status} $${Version}' "$$pkg" 2>/dev/null || true); \
	  case "$$ver" in installed\ *) dpkg --compare-versions "$${ver#installed }" ge "$(QEMU_MIN)" && continue;; esac; \
	  missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" -ne 0 ]; then \
	    echo "deps: missing (bookworm-backports):$$missing -- run 'sudo make deps'" >&2; exit 1; \
	  fi; \
	  if [ ! -e $(BACKPORTS_SOURCES) ] && grep -q bookworm /etc/os-release; then \
	    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > $(BACKPORTS_SOURCES); \
	  fi; \
	  echo "deps: installing from bookworm-backports:$$missing"; \
	  apt-get update -q; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -t bookworm-backports $$missing; \
	fi

# containerd 2.x beside Debian 12's 1.6 (the snapshotter is tested on both): Debian's own build from
# sid, unpacked under /opt/layerbox (its binaries need only glibc >= 2.34); the system's stays.
# (sid moves: when the pinned build is gone from the mirror, sid's current one is taken.)
CONTAINERD2_VERSION := 2.1.9+ds1-5
CONTAINERD2_DIR := /opt/layerbox/containerd-2
containerd2:
	@tools/deps/debian-unpack sid $(CONTAINERD2_DIR) containerd=$(CONTAINERD2_VERSION) 2>/dev/null || \
	  tools/deps/debian-unpack sid $(CONTAINERD2_DIR) containerd  # that build left sid: its successor

# The microVM guest (kernel, busybox initramfs, agent), built once per host from Debian packages.
vm-assets: venv
	@$(BIN)/layerbox vm assets --quiet

# The same check-then-install as deps, for BENCH_DEB_PACKAGES only; then the peers that are
# not Debian 12 packages.
bench-deps: deps
	@$(MAKE) --no-print-directory deps DEB_PACKAGES="$(BENCH_DEB_PACKAGES)"
	@$(MAKE) --no-print-directory bench-peers

# erofs-utils 1.8 from Debian 13, unpacked beside (never over) the system's 1.5, for
# bench/convert.py; a no-op once fetched (--force in the script fetches again).  Then the
# stargz snapshotter for bench/containerd.py.
bench-peers:
	@bash bench/peers/erofs-utils.sh >/dev/null
	@$(MAKE) --no-print-directory stargz

# Debian sid's stargz-snapshotter (ctr-remote) under /opt/layerbox/stargz-snapshotter, and its
# daemon, which Debian does not package, built from Debian's stargz library with Debian's Go
# into /opt/layerbox/stargz-grpc (bench/peers/stargz.sh); a no-op once both are there.
stargz:
	@bash bench/peers/stargz.sh

venv: deps $(STAMP)

$(STAMP): pyproject.toml | deps
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/python -m snapshots.containerd.grpcapi
	@touch $@

lint: venv
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/mypy

# pytest exits 5 when it collected nothing: an empty or fully deselected suite is not a pass.
test: lint typecheck vm-assets
	@rc=0; $(BIN)/python -m pytest -q || rc=$$?; \
	if [ "$$rc" -eq 5 ]; then \
	  echo "test: pytest collected no tests (tests/ empty or everything deselected) -- failing" >&2; \
	  exit 1; \
	fi; \
	exit "$$rc"

# vm-assets: the demo's microVM step boots the guest they are (a fresh machine has none)
demo: venv vm-assets
	$(BIN)/layerbox demo $(DEMO_ARGS)

# The data dir (LAYERBOX_DATA_DIR, /var/lib/layerbox or ~/.local/share/layerbox; ./.data in a
# checkout) holds the cached sample image and the stores: clean never touches it.
clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build ./*.egg-info
	find . -path ./.git -prune -o -path ./.data -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
