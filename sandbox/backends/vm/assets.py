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
import lzma
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import zstandard

from sandbox.backends.vm.agent import PROTOCOL
from sandbox.core.errors import SandboxError
from sandbox.core.paths import open_beneath

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

    @property
    def agent_protocol(self) -> int:
        """The protocol of the guest agent in its initrd (docs/FORMAT.md Part 5): a set built before
        the manifest said (protocol 2 or older) is 2."""
        value = self.manifest.get("agent_protocol")
        return value if isinstance(value, int) else 2


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


CpioEntry = tuple[str, int, bytes]  # name, mode (type and permissions), data


def _tree_entries(root: Path) -> list[CpioEntry]:
    entries: list[CpioEntry] = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            entries.append((rel, stat.S_IFDIR | 0o755, b""))
        for f in sorted(files):
            p = Path(dirpath) / f
            name = os.path.normpath(os.path.join(rel, f))
            if p.is_symlink():
                entries.append((name, stat.S_IFLNK | 0o777, os.readlink(p).encode()))
            else:
                entries.append((name, stat.S_IFREG | (p.stat().st_mode & 0o777), p.read_bytes()))
    return entries


def _cpio(entries: list[CpioEntry]) -> bytes:
    """A newc archive of ``entries`` (what the kernel unpacks as its initramfs), gzip-compressed."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0")
        out.write(b"\0" * (-out.tell() % 4))
        out.write(data)
        out.write(b"\0" * (-out.tell() % 4))
    return gzip.compress(out.getvalue(), compresslevel=6, mtime=0)


def _read_cpio(blob: bytes) -> list[CpioEntry]:
    """The entries of a gzip'd newc archive :func:`_cpio` wrote (our own initrd: trusted)."""
    data, pos = gzip.decompress(blob), 0
    entries: list[CpioEntry] = []
    while True:
        if data[pos:pos + 6] != b"070701":
            raise AssetsError(f"initrd: no newc header at offset {pos}")
        fields = [int(data[pos + 6 + 8 * i:pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        pos += 110
        name = data[pos:pos + namesize - 1].decode()
        pos += namesize + (-(110 + namesize) % 4)
        if name == "TRAILER!!!":
            return entries
        entries.append((name, mode, data[pos:pos + size]))
        pos += size + (-size % 4)


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
        (stage / "initrd.img").write_bytes(_cpio(_tree_entries(ir)))
        if not QBOOT.exists():
            raise AssetsError(f"{QBOOT} is missing: the microvm firmware comes with qemu-system-x86 "
                              "from bookworm-backports (make deps installs it)")
        # QEMU looks for bios-microvm.bin in -L: qboot boots a Linux kernel directly (SeaBIOS'
        # microvm build did not boot this kernel in 40 s)
        shutil.copy(QBOOT, stage / "fw/bios-microvm.bin")
        manifest = {"schema": ASSETS_SCHEMA, "key": key, **versions, "agent_protocol": PROTOCOL,
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
        raise AssetsError(f"no VM guest assets in {root}: build them with `layerbox vm assets` (make vm-assets, make demo and make test do)")
    return load(root, sets[-1].parent.name)


# -- the image's own kernel (isolation=vm, kernel=image) --------------------------------------------
IMAGE_KERNELS = "image-kernels"  # beside the sets: <root>/image-kernels/<key>/, found by key only
IMAGE_KERNEL_SCHEMA = "layerbox.vm-image-kernel.v1"
# what the init cannot do without: a module of the image's kernel, or built into it
REQUIRED_MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "erofs", "overlay")
MAX_KERNEL = 128 << 20
MAX_MODULE = 64 << 20
KERNEL_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}")


def image_kernel_key(base: Assets, layers: Sequence[str]) -> str:
    """The set of the image's kernel: its layers decide which kernel and modules it has, the base
    set the busybox, init and agent around them."""
    h = blake3.blake3(IMAGE_KERNEL_SCHEMA.encode())
    h.update(json.dumps({"base": base.key, "layers": list(layers), "modules": list(MODULES)}).encode())
    return h.hexdigest()[:24]


def load_image_kernel(base: Assets, layers: Sequence[str]) -> Assets | None:
    key = image_kernel_key(base, layers)
    d = base.dir.parent / IMAGE_KERNELS / key
    return load(d.parent, key) if (d / "manifest.json").is_file() else None


def _read_regular(root: Path, rel: str, limit: int, what: str) -> bytes:
    """The image's file ``rel``, resolved beneath ``root`` without following any symlink (an
    image's link never reaches the host's files), a regular file of at most ``limit`` bytes."""
    try:
        fd = open_beneath(root, rel.lstrip("/"), os.O_RDONLY)
    except OSError as exc:
        raise AssetsError(f"image kernel: {what} /{rel.lstrip('/')}: {exc.strerror} (read without following "
                          "symlinks, inside the image)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise AssetsError(f"image kernel: {what} /{rel.lstrip('/')} is not a regular file of at most {limit} "
                              "bytes")
        return f.read(limit + 1)[:limit]


def _image_vmlinuz(root: Path) -> tuple[str, bytes]:
    """The image's kernel: what ``/vmlinuz`` links to (Debian's, Ubuntu's), else its one
    ``/boot/vmlinuz-<version>``; its version and bytes."""
    link = root / "vmlinuz"
    if link.is_symlink():
        rel = os.path.normpath("/" + os.readlink(link)).lstrip("/")  # relative to / (Debian's: boot/vmlinuz-...)
    else:
        found = sorted((root / "boot").glob("vmlinuz-*")) if (root / "boot").is_dir() else []
        if len(found) != 1:
            raise AssetsError("image kernel: the image has no /vmlinuz link and "
                              f"{len(found)} /boot/vmlinuz-* files: give it one kernel (install one linux-image)")
        rel = f"boot/{found[0].name}"
    name = rel.rsplit("/", 1)[-1]
    version = name.removeprefix("vmlinuz-")
    if name == version or not KERNEL_VERSION.fullmatch(version):
        raise AssetsError(f"image kernel: /{rel} is not /boot/vmlinuz-<version>")
    return version, _read_regular(root, rel, MAX_KERNEL, "kernel")


def _decompressed(name: str, data: bytes) -> bytes:
    if name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if name.endswith(".ko.zst"):
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_MODULE)
    if name.endswith(".ko.gz"):
        return gzip.decompress(data)
    return data


def _image_modules(root: Path, moddir: str) -> list[tuple[str, bytes]]:
    """MODULES and their dependencies from the image's ``modules.dep`` (depmod's, made when its
    kernel package was installed), dependencies first, each decompressed: (name, bytes).  Read
    as text: no tool of the host parses the image's module files."""
    deps: dict[str, list[str]] = {}
    try:
        for line in _read_regular(root, f"{moddir}/modules.dep", 16 << 20, "modules.dep").decode().splitlines():
            mod, _, rest = line.partition(":")
            deps[mod.strip()] = rest.split()
        builtin = set(_read_regular(root, f"{moddir}/modules.builtin", 16 << 20, "modules.builtin").decode().split())
    except UnicodeDecodeError:
        raise AssetsError(f"image kernel: /{moddir}/modules.dep is not text") from None

    def short(path: str) -> str:
        return path.rsplit("/", 1)[-1].split(".ko")[0].replace("-", "_")

    by_name = {short(p): p for p in deps}
    have = set(by_name) | {short(p) for p in builtin}
    missing = [m for m in REQUIRED_MODULES if m not in have]
    if missing:
        raise AssetsError(f"image kernel: /{moddir} has neither a module nor a built-in {', '.join(missing)} "
                          "(the guest mounts its layers with them)")
    order: list[str] = []

    def visit(path: str, depth: int = 0) -> None:
        if path in order or depth > 32:
            return
        for dep in deps.get(path, ()):
            visit(dep, depth + 1)
        order.append(path)

    for name in MODULES:
        if name in by_name:
            visit(by_name[name])
    out = []
    for path in order:
        if ".." in path.split("/") or path.startswith("/"):
            raise AssetsError(f"image kernel: modules.dep names {path!r}")
        out.append((short(path), _decompressed(path, _read_regular(root, f"{moddir}/{path}", MAX_MODULE, "module"))))
    return out


def build_image_kernel(base: Assets, layers: Sequence[str], image_root: Path) -> Assets:
    """The set that boots the kernel of the image mounted at ``image_root`` (its ``layers``):
    that kernel, and the base set's initrd with the image's modules in place of its own.
    Everything read from the image is bounded, regular, and inside it."""
    key = image_kernel_key(base, layers)
    root = base.dir.parent / IMAGE_KERNELS
    final = root / key
    if (final / "manifest.json").is_file():
        return load(root, key)
    version, kernel = _image_vmlinuz(image_root)
    # merged /usr (Debian 12: /lib links to usr/lib) or not; symlinks are not followed below
    libs = [lib for lib in ("usr/lib/modules", "lib/modules") if (image_root / lib / version / "modules.dep").exists()]
    if not libs:
        raise AssetsError(f"image kernel: the image has /boot/vmlinuz-{version} but no "
                          f"/usr/lib/modules/{version}/modules.dep (depmod {version} in the image makes it)")
    modules = _image_modules(image_root, f"{libs[0]}/{version}")
    entries = [e for e in _read_cpio(base.initrd.read_bytes()) if not e[0].startswith("lib/modules/")]
    entries.append(("lib/modules", stat.S_IFDIR | 0o755, b""))
    entries += [(f"lib/modules/{name}.ko", stat.S_IFREG | 0o644, data) for name, data in modules]
    entries.append(("lib/modules/order", stat.S_IFREG | 0o644, "".join(n + "\n" for n, _ in modules).encode()))
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        stage = Path(tmp) / "out"
        stage.mkdir()
        (stage / "vmlinuz").write_bytes(kernel)
        (stage / "initrd.img").write_bytes(_cpio(entries))
        os.symlink(base.firmware, stage / "fw")
        manifest = {"schema": ASSETS_SCHEMA, "key": key, "base": base.key, "kernel_from": "image",
                    "agent_protocol": base.agent_protocol,  # (the base set's initrd, its agent)
                    "layers": list(layers), "kernel_version": version, "modules": [n for n, _ in modules],
                    "files": {name: blake3.blake3((stage / name).read_bytes()).hexdigest()
                              for name in ("vmlinuz", "initrd.img")}}
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(stage, final)
        except OSError:
            if not (final / "manifest.json").exists():
                raise
    return load(root, key)


def load_key(root: Path, key: str) -> Assets:
    """A set by its key: a built set, or an image kernel's (a record or receipt names either)."""
    if (root / IMAGE_KERNELS / key / "manifest.json").is_file():
        return load(root / IMAGE_KERNELS, key)
    return load(root, key)
