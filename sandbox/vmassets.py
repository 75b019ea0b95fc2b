"""The guest side of every microVM and VM: kernel, initramfs (busybox, modules, init, agent), firmware.

Built on the host from Debian packages (``linux-image-cloud-amd64``, ``busybox-static``) and the
agent's C source, cached under one directory per *assets key* (a digest of everything that goes
in), so receipts, templates and checkpoints name exactly what their guest ran and a change of
any input builds a new set beside the old.  ``layerbox vm assets`` builds them; docs/FORMAT.md
Part 5 describes the directory.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import blake3

from sandbox.errors import SandboxError

ASSETS_SCHEMA = "layerbox.vm-assets.v1"
GUEST_DIR = Path(__file__).parent / "guest"
DEFAULT_ROOT = Path(os.environ.get("LAYERBOX_VM_ASSETS", "/var/cache/layerbox/vm"))
KERNEL_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX_PACKAGE = "busybox-static"
# What the init needs, in no particular order: dependencies come from each module's own
# modinfo (the .deb ships no modules.dep) and are loaded first.
MODULES = ("virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "virtio_balloon", "virtio_net",
           "crc32c_intel", "erofs", "overlay")
QBOOT = Path("/usr/share/qemu/qboot.rom")
GUEST_FILES = ("agent.c", "init")


class AssetsError(SandboxError):
    """The guest assets cannot be built or are damaged."""


@dataclass(frozen=True)
class Assets:
    """One built set: ``key`` names it in receipts, templates and checkpoints."""
    key: str
    dir: Path
    kernel: Path
    initrd: Path
    firmware: Path
    manifest: dict[str, object]


def _run(*cmd: str, cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise AssetsError(f"{cmd[0]} is not installed (make deps installs it)") from None
    except subprocess.CalledProcessError as exc:
        raise AssetsError(f"{' '.join(cmd)} failed ({exc.returncode}): {exc.stderr.strip()[-400:]}") from None
    return out.stdout


def _download(package: str, into: Path) -> Path:
    """``apt-get download`` of the candidate version: the package registry is the one source."""
    _run("apt-get", "download", "-q", package, cwd=into)
    debs = sorted(into.glob(f"{package}_*.deb"))
    if not debs:
        raise AssetsError(f"apt-get download {package} left no .deb in {into}")
    return debs[-1]


def _field(deb: Path, name: str) -> str:
    return _run("dpkg-deb", "-f", str(deb), name).strip()


def _candidate(package: str) -> dict[str, str]:
    """The fields of the version apt would install (no download)."""
    out = _run("apt-cache", "show", "--no-all-versions", package)
    return {k: v.strip() for k, _, v in (line.partition(":") for line in out.splitlines() if line[:1] != " ")}


def _versions() -> dict[str, str]:
    try:
        meta = _candidate(KERNEL_PACKAGE)
    except AssetsError:
        # a machine whose package lists were never fetched (or were cleaned, as in many images)
        _run("apt-get", "update", "-q")
        meta = _candidate(KERNEL_PACKAGE)
    # the metapackage depends on exactly one versioned image package
    versioned = next(d.split()[0] for d in meta.get("Depends", "").split(",")
                     if d.strip().startswith("linux-image-"))
    return {"kernel_package": versioned, "kernel_version": _candidate(versioned)["Version"],
            "busybox_version": _candidate(BUSYBOX_PACKAGE)["Version"]}


def assets_key(versions: dict[str, str]) -> str:
    h = blake3.blake3(ASSETS_SCHEMA.encode())
    h.update(json.dumps(versions, sort_keys=True).encode())
    h.update(",".join(MODULES).encode())
    for name in GUEST_FILES:
        h.update((GUEST_DIR / name).read_bytes())
    return h.hexdigest()[:24]


def _module_order(root: Path) -> list[Path]:
    """MODULES and what they depend on, dependencies first; built-in ones are skipped."""
    (kver,) = [d.name for d in (root / "lib/modules").iterdir()]
    base = root / "lib/modules" / kver
    by_name = {p.name.split(".ko")[0].replace("-", "_"): p for p in (base / "kernel").rglob("*.ko*")}
    order: list[Path] = []

    def visit(name: str) -> None:
        path = by_name.get(name.replace("-", "_"))
        if path is None or path in order:
            return  # built in (modules.builtin) or already placed
        deps = _run("modinfo", "-F", "depends", str(path)).strip()
        for dep in filter(None, deps.split(",")):
            visit(dep)
        order.append(path)

    for name in MODULES:
        visit(name)
    return order


def _cpio(root: Path) -> bytes:
    """A newc archive of ``root`` (what the kernel unpacks as its initramfs), gzip-compressed."""
    out = io.BytesIO()
    ino = 1

    def entry(name: str, mode: int, data: bytes = b"") -> None:
        nonlocal ino
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0")
        out.write(b"\0" * (-out.tell() % 4))
        out.write(data)
        out.write(b"\0" * (-out.tell() % 4))
        ino += 1

    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            entry(rel, stat.S_IFDIR | 0o755)
        for f in sorted(files):
            p = Path(dirpath) / f
            name = os.path.normpath(os.path.join(rel, f))
            if p.is_symlink():
                entry(name, stat.S_IFLNK | 0o777, os.readlink(p).encode())
            else:
                entry(name, stat.S_IFREG | (p.stat().st_mode & 0o777), p.read_bytes())
    entry("TRAILER!!!", 0)
    return gzip.compress(out.getvalue(), compresslevel=6, mtime=0)


def build(root: Path = DEFAULT_ROOT) -> Assets:
    """Build (or find) the assets for the candidate packages; safe to run concurrently."""
    root.mkdir(parents=True, exist_ok=True)
    versions = _versions()
    key = assets_key(versions)
    final = root / key
    if (final / "manifest.json").exists():
        return load(root, key)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        work = Path(tmp)
        kernel_deb = _download(versions["kernel_package"], work)
        busybox_deb = _download(BUSYBOX_PACKAGE, work)
        if _field(kernel_deb, "Version") != versions["kernel_version"]:
            raise AssetsError(f"apt-get download {versions['kernel_package']} gave {_field(kernel_deb, 'Version')}, "
                              f"apt-cache said {versions['kernel_version']}: run apt-get update and retry")
        kx, bx, ir = work / "k", work / "b", work / "ir"
        _run("dpkg-deb", "-x", str(kernel_deb), str(kx))
        _run("dpkg-deb", "-x", str(busybox_deb), str(bx))
        for d in ("bin", "lib/modules", "proc", "sys", "dev", "layers", "disk", "sysroot"):
            (ir / d).mkdir(parents=True, exist_ok=True)
        shutil.copy(bx / "bin/busybox", ir / "bin/busybox")
        mods = _module_order(kx)
        for m in mods:
            shutil.copy(m, ir / "lib/modules" / m.name)
        (ir / "lib/modules/order").write_text("".join(m.name.split(".ko")[0] + "\n" for m in mods))
        shutil.copy(GUEST_DIR / "init", ir / "init")
        (ir / "init").chmod(0o755)
        _run("gcc", "-static", "-O2", "-Wall", "-o", str(ir / "bin/lb-agent"), str(GUEST_DIR / "agent.c"))
        _run("strip", str(ir / "bin/lb-agent"))
        stage = work / "out"
        (stage / "fw").mkdir(parents=True)
        (vmlinuz,) = (kx / "boot").glob("vmlinuz-*")
        shutil.copy(vmlinuz, stage / "vmlinuz")
        (stage / "initrd.img").write_bytes(_cpio(ir))
        if not QBOOT.exists():
            raise AssetsError(f"{QBOOT} is missing: the microvm firmware comes with qemu-system-x86 "
                              "from bookworm-backports (make deps installs it)")
        # QEMU looks for bios-microvm.bin in -L: qboot boots a Linux kernel directly (SeaBIOS'
        # microvm build did not boot this kernel in 40 s)
        shutil.copy(QBOOT, stage / "fw/bios-microvm.bin")
        manifest = {"schema": ASSETS_SCHEMA, "key": key, **versions,
                    "modules": [m.name for m in mods],
                    "files": {name: blake3.blake3((stage / name).read_bytes()).hexdigest()
                              for name in ("vmlinuz", "initrd.img", "fw/bios-microvm.bin")}}
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(stage, final)
        except OSError:
            if not (final / "manifest.json").exists():  # not a concurrent builder's finished set
                raise
    return load(root, key)


def load(root: Path, key: str) -> Assets:
    """The built set ``key`` (its manifest read and checked, its files not hashed again)."""
    d = root / key
    try:
        manifest = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise AssetsError(f"VM assets {key} in {root}: {exc}; rebuild with `layerbox vm assets`") from None
    if manifest.get("schema") != ASSETS_SCHEMA or manifest.get("key") != key:
        raise AssetsError(f"VM assets {d}: manifest is not {ASSETS_SCHEMA} for {key}")
    return Assets(key, d, d / "vmlinuz", d / "initrd.img", d / "fw", manifest)


def find(root: Path = DEFAULT_ROOT) -> Assets:
    """The newest set already built here, without the network; an error says how to build one."""
    sets = sorted((p for p in root.glob("*/manifest.json")), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not sets:
        raise AssetsError(f"no VM guest assets in {root}: build them with `layerbox vm assets` (make deps does)")
    return load(root, sets[-1].parent.name)
