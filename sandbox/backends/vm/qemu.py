"""MicroVM sandboxes on QEMU: layers as block devices, a qcow2 disk, templates, memory saves.

A VM sandbox's read-only layers reach the guest as two virtio-blk disks each, the layer's
EROFS metadata image and its blob, the blob being the lazyfetch daemon's file: the guest's
reads of it are the only fetches (no host mount is made).  Its writes go to an ext4 disk,
a qcow2 overlay over a *backing* file: this host's pristine ext4 of that size for a new
sandbox, a checkpoint's disk image (lazily fetched) for a restored one.  A template is an
image booted once per host and shape (vCPUs, memory, disk size, guest assets, QEMU), its
layers mounted and its agent answering, and saved twice: before any writable disk is
mounted (a checkpoint's restore mounts its own) and after its own empty disk is (new
sandboxes' disks stand on that file): QEMU's device state with ``x-ignore-shared`` and its
RAM as a ``share=on`` memory file.  Every sandbox then restores a template, its RAM a
private copy-on-write mapping of the template's file (clean pages shared between all of
them) -- this is how VM sandboxes start fast without KVM.  Layout and crash analysis:
docs/FORMAT.md Part 5.

This module knows QEMU, QMP and the guest; the manager decides when, and owns state.json.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from layerstore.hoststate import flocked
from layerstore.objects import SCHEMA_VM_TEMPLATE
from sandbox.backends.vm import assets as vmassets
from sandbox.backends.vm.agent import AgentConnection, AgentError, connect_unix
from sandbox.core.errors import HostUnsupported, SandboxError
from sandbox.core.procs import proc_stat

log = logging.getLogger("layerbox.sandbox")

QEMU = "qemu-system-x86_64"
TEMPLATE_SCHEMA = SCHEMA_VM_TEMPLATE  # template.json; the store's template document adds its layer
VM_SCHEMA = "layerbox.vm.v1"
BOOT_TIMEOUT = 120.0  # TCG on a loaded 2-core host: a cold boot takes 3-5 s, ten times that is trouble
SAVE_TIMEOUT = 120.0
MIN_QEMU = (8, 2)  # a read-only, private memory-backend-file (QEMU 7.2 refuses readonly=on)
DEFAULT_DISK = 1 << 30
# empty qcow2 overlays by (backing as QEMU names it, its format, size): sandbox_disk
OVERLAYS_KEPT = 16
MAX_EMPTY_OVERLAY = 4 << 20  # an empty overlay's header and tables: ~200 KiB for 512 MiB, 1 MiB per 256 GiB
_OVERLAYS: dict[tuple[str, str, int], bytes] = {}
_OVERLAYS_LOCK = threading.Lock()
TCG_TB_MIB = 64  # the translation cache; QEMU's default for system mode is 1 GiB of host RAM
VMM_OVERHEAD = 256 << 20  # the VMM's own memory (TCG cache, device emulation) over guest RAM


class VmError(SandboxError):
    """A VMM that could not start, save or restore; the message names the step and its log."""


# -- the host --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hypervisor:
    """What this host runs VMs with: detected once per manager, reported in /v1/capabilities."""
    qemu: str
    version: tuple[int, int, int]
    accel: str  # "kvm" or "tcg"
    accel_reason: str
    tsc_khz: int | None

    def to_json(self) -> dict[str, Any]:
        return {"vmm": "qemu", "qemu": ".".join(map(str, self.version)), "accel": self.accel,
                "accel_reason": self.accel_reason}


def qemu_version(binary: str = QEMU) -> tuple[int, int, int]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        raise HostUnsupported(f"{binary} is not installed: microVMs need qemu-system-x86 >= "
                              f"{'.'.join(map(str, MIN_QEMU))} (bookworm-backports; make deps installs it)") from None
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise HostUnsupported(f"{binary} --version said {out[:80]!r}")
    return int(m[1]), int(m[2]), int(m[3])


def host_tsc_khz() -> int | None:
    """The host TSC in kHz, for the guest's ``tsc_early_khz=``: without it about one TCG boot
    in three hung calibrating (docs/FORMAT.md Part 5)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"tsc: (?:Refined TSC clocksource calibration|Detected): (\d+)\.(\d+) MHz", out)
        if m:
            return int(m[1]) * 1000 + int(m[2].ljust(3, "0")[:3])
    with contextlib.suppress(OSError):
        m = re.search(r"cpu MHz\s*:\s*(\d+)\.(\d+)", Path("/proc/cpuinfo").read_text())
        if m:
            return int(m[1]) * 1000 + int(m[2].ljust(3, "0")[:3])
    return None


def detect_accel(assets: vmassets.Assets, binary: str = QEMU) -> tuple[str, str]:
    """KVM when /dev/kvm runs the stock guest kernel, else TCG; with the reason.

    ``LAYERBOX_VM_ACCEL=tcg|kvm`` decides instead.  The probe boots the guest kernel under
    KVM without a root and waits up to 3 s for its banner on the serial port: on a PVM-only
    host (this one) /dev/kvm opens, a paused VM starts, and a stock kernel never prints.
    The answer is kept per boot of the host (``accel-<boot id>.json`` beside the assets)."""
    forced = os.environ.get("LAYERBOX_VM_ACCEL")
    if forced in ("tcg", "kvm"):
        return forced, f"LAYERBOX_VM_ACCEL={forced}"
    if not os.path.exists("/dev/kvm"):
        return "tcg", "no /dev/kvm"
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return "tcg", f"/dev/kvm: {exc.strerror}"
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    cache = assets.dir / f"accel-{boot_id}.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        doc = json.loads(cache.read_text())
        return doc["accel"], doc["reason"]
    probe = subprocess.Popen([binary, "-accel", "kvm", "-cpu", "host", "-M", "microvm,rtc=on,isa-serial=on",
                              "-L", str(assets.firmware), "-m", "256M", "-nodefaults", "-no-user-config",
                              "-display", "none", "-no-reboot", "-serial", "stdio", "-kernel", str(assets.kernel),
                              "-append", "console=ttyS0 panic=-1"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = probe.communicate(timeout=3.0)
    except subprocess.TimeoutExpired:
        probe.kill()
        out, _ = probe.communicate()
    text = out.decode(errors="replace")
    if "Linux version" in text:
        accel, reason = "kvm", "/dev/kvm boots the stock guest kernel"
    else:
        tail = text.strip().splitlines()[-1][-160:] if text.strip() else "no output in 3 s"
        accel, reason = "tcg", f"/dev/kvm does not run the stock guest kernel ({tail})"
    with contextlib.suppress(OSError):
        cache.write_text(json.dumps({"accel": accel, "reason": reason}))
    return accel, reason


def hypervisor(assets: vmassets.Assets) -> Hypervisor:
    version = qemu_version()
    if version[:2] < MIN_QEMU:
        raise HostUnsupported(f"{QEMU} {'.'.join(map(str, version))} is too old: microVMs need "
                              f">= {'.'.join(map(str, MIN_QEMU))} (bookworm-backports; make deps installs it)")
    accel, why = detect_accel(assets)
    return Hypervisor(QEMU, version, accel, why, host_tsc_khz())


# -- QMP ----------------------------------------------------------------------------------------------
class Qmp:
    """A QMP connection (one command at a time; events are skipped)."""

    def __init__(self, path: Path, timeout: float = 30.0, alive: Callable[[], bool] | None = None) -> None:
        self.sock = connect_unix(path, timeout, alive)
        self.sock.settimeout(timeout)
        self.file = self.sock.makefile("rb")
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.file.readline()
            if not line:
                raise VmError("QMP: the VMM closed its monitor")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    def execute(self, command: str, **arguments: Any) -> Any:
        return self._call(command, arguments, ())

    def _call(self, command: str, arguments: dict[str, Any], fds: Sequence[int]) -> Any:
        data = json.dumps({"execute": command, **({"arguments": arguments} if arguments else {})}).encode() + b"\n"
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.sendall(data)
        reply = self._read()
        if "error" in reply:
            raise VmError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    @contextlib.contextmanager
    def fdset(self, fd: int) -> Iterator[str]:
        """``fd`` handed to the VMM (``add-fd``: a jailed VMM opens no host path itself) as a
        name its opens accept, ``/dev/fdset/<id>``; removed from it after the block."""
        info = self._call("add-fd", {}, [fd])
        try:
            yield f"/dev/fdset/{info['fdset-id']}"
        finally:
            with contextlib.suppress(VmError, OSError):
                self.execute("remove-fd", **{"fdset-id": info["fdset-id"]})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
            self.sock.close()


# -- one VM's command line ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What must match between a template and every VM restored from it."""
    vcpus: int
    memory: int  # bytes of guest RAM
    disk: int    # bytes of the ext4 disk
    machine: str = "microvm"

    def to_json(self) -> dict[str, Any]:
        return {"vcpus": self.vcpus, "memory": self.memory, "disk": self.disk, "machine": self.machine}


# QEMU's machine per isolation: "microvm" (virtio-mmio, no PCI, no firmware but qboot) or a
# full PC (q35: PCI, ACPI, SeaBIOS) for what needs one (the image's own kernel, PCI devices)
MACHINES = {"microvm": "microvm", "vm": "q35"}


# The least guest RAM a sandbox may ask for, and the least a guest is given: the stock kernel
# decompresses itself into 51.5 MiB (its bzImage's init_size) from 16 MiB up, so 64 MiB does
# not boot, 80 MiB runs out in PID 1's first forks, 96 MiB leaves 14 MiB free; at 128 MiB the
# guest has ~75 MiB free.  A request between the two is a guest of MIN_GUEST_MEMORY (its
# MemTotal says so), host memory accounted at that size.
MIN_MEMORY = 64 << 20
MIN_GUEST_MEMORY = 128 << 20


def shape_of(cpu: float, memory: int, disk: int | None, machine: str = "microvm") -> Shape:
    mem = max(MIN_GUEST_MEMORY, memory >> 20 << 20)  # guest RAM in whole MiB
    return Shape(vcpus=max(1, min(64, int(cpu + 0.999))), memory=mem, disk=disk or DEFAULT_DISK, machine=machine)


def _device(machine: str, kind: str) -> str:
    """The virtio device ``kind`` (blk, net, serial, balloon) on ``machine``'s bus."""
    return f"virtio-{kind}-{'pci' if machine == 'q35' else 'device'}"


def _q(value: str | os.PathLike[str]) -> str:
    """A value inside a QEMU option string (a comma is doubled)."""
    return str(value).replace(",", ",,")


def qemu_path(path: str | os.PathLike[str], vm_dir: Path) -> str:
    """How the VMM names ``path``: a file of its own directory by its name alone (relative to
    its working directory, which its chroot makes ``/``: the same file before and after the
    jail, so it can reopen it to write, as a merge does), anything else as given (opened at
    its start, before the jail)."""
    p = Path(path)
    return p.name if p.parent == vm_dir else str(p)


def disk_args(nodes: Sequence[tuple[str, str]], machine: str = "microvm", vm_dir: Path | None = None) -> list[str]:
    """The ``-blockdev`` graph of the sandbox's disk: ``nodes`` are (file, format) base first,
    the last one the guest writes (node ``d<n-1>``); each qcow2 node's backing is the node
    before it, never the name its header records (a checkpoint's delta was written on
    another host).  The device is ``lb-upper``.  A lone qcow2 node (a record of an older
    layerbox) opens its backing chain from its header."""
    argv: list[str] = []
    last = len(nodes) - 1
    for i, (path, fmt) in enumerate(nodes):
        ro = "on" if i < last else "off"
        name = qemu_path(path, vm_dir) if vm_dir is not None else path
        node = f"driver={fmt},node-name=d{i},read-only={ro},file.driver=file,file.filename={_q(name)}"
        if fmt == "qcow2" and i > 0:
            node += f",backing=d{i - 1}"
        if i == last:
            node += ",discard=unmap"
        argv += ["-blockdev", node]
    return argv + ["-device", f"{_device(machine, 'blk')},drive=d{last},serial=lb-upper"]


def chain_image_opts(nodes: Sequence[tuple[str, str]]) -> str:
    """``qemu-img --image-opts`` for the disk ``nodes`` (base first) as one image, each
    backing given explicitly (see :func:`disk_args`)."""
    opts: list[str] = []
    prefix = ""
    for path, fmt in reversed(nodes):
        opts += [f"{prefix}driver={fmt}", f"{prefix}file.driver=file", f"{prefix}file.filename={_q(path)}"]
        prefix += "backing."
    return ",".join(opts)


def command_line(hv: Hypervisor, assets: vmassets.Assets, shape: Shape, layers: Sequence[tuple[str, str]],
                 disk_nodes: Sequence[tuple[str, str]], memory_file: Path | None, *, template: bool,
                 hostname: str, vm_dir: Path, jail: tuple[int, int], memory_offset: int = 0) -> list[str]:
    """QEMU's argv, relative to the VM's directory ``vm_dir`` (its sockets are made there).

    The VMM opens every file and device as root, then (``-run-with``) chroots to ``vm_dir``
    and becomes ``jail`` (uid, gid): a host uid of its own that owns nothing but the VM's
    writable overlays, so a guest that took QEMU over reaches the VM's directory only, as a
    nobody.  What it opens later comes as fds (:meth:`Qmp.fdset`).  RAM: a
    template's is ``memory_file`` (share=on: a save leaves it there); a sandbox's is a private,
    read-only mapping of its template's file, so its writes are its own and the file stays;
    without a ``memory_file`` (a VM restored from its own memory image) it is anonymous."""
    append = ["console=ttyS0", "quiet", "panic=-1", f"lb.layers={len(layers)}", f"lb.hostname={hostname}"]
    if hv.tsc_khz:
        append.append(f"tsc_early_khz={hv.tsc_khz}")
    if memory_file is None:
        mem = f"memory-backend-ram,id=mem,size={shape.memory}"
    else:
        mem = f"memory-backend-file,id=mem,size={shape.memory},mem-path={_q(memory_file)}"
        mem += ",share=on" if template else ",share=off,readonly=on,rom=off"
        if memory_offset:
            mem += f",offset={memory_offset}"
    machine = shape.machine
    if machine == "microvm":
        board = "microvm,x-option-roms=off,pit=off,pic=off,rtc=on,isa-serial=on,memory-backend=mem"
    elif machine == "q35":  # SeaBIOS and its linuxboot ROM from QEMU's own data dir (after -L)
        board = "q35,memory-backend=mem,vmport=off,smbus=off,sata=off,usb=off"
    else:
        raise VmError(f"machine {machine!r} is neither microvm nor q35")
    argv = [hv.qemu, "-L", str(assets.firmware), "-M", board,
            "-accel", f"tcg,tb-size={TCG_TB_MIB}" if hv.accel == "tcg" else "kvm",
            "-cpu", "max" if hv.accel == "tcg" else "host",
            "-m", f"{shape.memory >> 20}M", "-smp", str(shape.vcpus), "-object", mem,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            # QEMU's seccomp filter: no exec, no setuid, no obsolete or scheduler syscalls for a
            # VMM a guest may have taken over (saves go to a file, not through an exec'd cat)
            # (set*id stays allowed: the jail below is QEMU's own setuid; once done, it has no way back)
            "-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny",
            "-run-with", f"user={jail[0]}:{jail[1]},chroot={_q(vm_dir)}",
            "-serial", "file:console.log", "-qmp", "unix:qmp.sock,server=on,wait=off"]
    if template or machine != "microvm":
        argv += ["-kernel", str(assets.kernel), "-initrd", str(assets.initrd), "-append", " ".join(append)]
    # else a restore: the guest's kernel is in the RAM it loads; reading 14 MB of bzImage and the
    # initrd for nothing took ~15 ms of every create (q35 keeps them: its linuxboot option ROM is a
    # RAM block of the saved state, which a restore without -kernel would lack)
    for i, (meta, blob) in enumerate(layers):
        for kind, path in (("meta", meta), ("blob", blob)):
            argv += ["-drive", f"id={kind}{i},file={path},format=raw,if=none,readonly=on,cache=writeback",
                     "-device", f"{_device(machine, 'blk')},drive={kind}{i},serial=lb-{kind}-{i}"]
    argv += disk_args(disk_nodes, machine, vm_dir)  # after the layers' devices, before the NIC: the slots a save records
    # the NIC: the tap of the namespace the VMM runs in (sandbox.isolation.network, VM_TAP); its MAC is the
    # same in every VM, each alone on its own link; on PCI without a boot ROM (the kernel is given)
    argv += ["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
             "-device", f"{_device(machine, 'net')},netdev=net0,mac=52:54:00:6c:62:02"
             + (",romfile=" if machine == "q35" else ""),
             "-device", f"{_device(machine, 'serial')},max_ports=2",
             "-chardev", "socket,id=agent,path=agent.sock,server=on,wait=off",
             "-device", "virtserialport,chardev=agent,name=lb.agent",
             # free-page reporting off: QEMU 10 refuses to discard pages of a read-only file mapping
             # ("Discarding RAM with readonly files is not supported"), which is what a sandbox's RAM
             # over its template is, so every report would fail (docs/FORMAT.md Part 5)
             "-device", f"{_device(machine, 'balloon')},free-page-reporting=off"]
    return argv


# -- the guest's console ---------------------------------------------------------------------------------
# What a guest that cannot go on prints (the console is ``quiet``: only errors and worse): the
# kernel's panic (PID 1 died, memory deadlocked) and the init's LB-FAIL (it then powers off).
CONSOLE_FAILURES = ("Kernel panic - not syncing", "LB-FAIL ")
_STACK_LINE = re.compile(r"^\[\s*[0-9.]+\]\s+(?:[A-Z0-9]{2,3}:|\?|</?[A-Z]+>|[\w.]+\+0x|Call Trace|Code:|Hardware name|"
                         r"Kernel Offset|CPU: \d|Workqueue)")


def console_failure(path: Path) -> str | None:
    """The guest's failure in its console ``path`` (its last 64 KiB): each failure line, then the
    console's last lines that are not a panic's register or stack dump; None when it has none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (64 << 10)))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    failures = [ln.strip() for ln in lines if any(m in ln for m in CONSOLE_FAILURES)]
    if not failures:
        return None
    last = [ln.strip() for ln in lines if ln.strip() and not _STACK_LINE.match(ln.strip())][-6:]
    said = failures[:3] + [ln for ln in last if ln not in failures[:3]]
    return " | ".join(said)[:1500]


# -- the VMM process ------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


# What the VMM's process does before it becomes QEMU: join the sandbox's cgroups (a shell writes
# its own pid, then execs) and network namespace (nsenter).  Not a preexec_fn: that makes
# subprocess fork the whole manager (~10 ms of a create) instead of vfork'ing it; the two small
# execs cost ~2 ms.  The pid stays the same through each exec, and so does its start time.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _entering(argv: Sequence[str], procs_files: Sequence[Path], netns: Path | None) -> list[str]:
    out = list(argv)
    if procs_files:
        out = ["/bin/sh", "-c", _JOIN, "sh", *map(str, procs_files), "--", *out]
    if netns is not None:
        out = ["nsenter", f"--net={netns}", "--", *out]
    return out


@dataclass
class Vmm:
    """One running QEMU: its pid (with its start time, the identity check) and its directory."""
    dir: Path
    pid: int
    start: int

    @classmethod
    def spawn(cls, vm_dir: Path, argv: list[str], cgroup_procs: Sequence[Path] = (), *,
              netns: Path | None = None) -> Vmm:
        log_file = open(vm_dir / "vmm.log", "ab")
        try:
            proc = subprocess.Popen(_entering(argv, cgroup_procs, netns), cwd=vm_dir, stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=log_file, start_new_session=True, close_fds=True)
        except FileNotFoundError as exc:
            raise HostUnsupported(f"{exc.filename} is missing (apt-get install util-linux qemu-system-x86)") from None
        finally:
            log_file.close()
        st = proc_stat(proc.pid)
        vmm = cls(vm_dir, proc.pid, st[1] if st else 0)
        vmm._popen = proc  # type: ignore[attr-defined]  # reaped by whoever made it
        return vmm

    def alive(self) -> bool:
        st = proc_stat(self.pid)
        return st is not None and st[1] == self.start

    def log_tail(self) -> str:
        out = []
        for name in ("vmm.log", "console.log"):
            with contextlib.suppress(OSError):
                text = (self.dir / name).read_bytes()[-600:].decode(errors="replace").strip()
                if name == "console.log":
                    text = console_failure(self.dir / name) or text
                if text:
                    out.append(f"{name}: {text}")
        return "; ".join(out) or "(no output)"

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.reap()

    def reap(self, timeout: float = 10.0) -> None:
        popen = getattr(self, "_popen", None)
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return  # this process's child, reaped
            except ChildProcessError:  # another's child: its parent reaps it
                if not self.alive():
                    return
            time.sleep(0.01)

    def qmp(self, timeout: float = 30.0) -> Qmp:
        try:
            return Qmp(self.dir / "qmp.sock", timeout, self.alive)
        except AgentError as exc:
            raise VmError(f"VMM {self.pid}: no monitor ({exc}); {self.log_tail()}") from None

    def wait_status(self, qmp: Qmp, want: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = 0.001  # a restore's device state loads in ~5 ms: a coarse first poll was most of it again
        while True:
            status = qmp.execute("query-status")["status"]
            if status == want:
                return
            if time.monotonic() > deadline:
                raise VmError(f"VMM {self.pid}: status {status!r}, not {want!r} after {timeout:g} s; "
                              f"{self.log_tail()}")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # (a whole memory image takes seconds: not a query a millisecond)

    def save(self, state_file: Path, *, mapped_ram: bool = False, qmp: Qmp | None = None,
             switchover: Callable[[], None] | None = None, durable: bool = True) -> float:
        """Write the guest's state and leave it stopped; the seconds it was stopped.

        By default the device state only, with ``x-ignore-shared``: a ``share=on`` memory file
        keeps the RAM (a template), a private mapping's pages go into the stream.  With
        ``mapped_ram``, every RAM page that is not zero at its own offset in the file
        (QEMU's ``mapped-ram``: a page-aligned image of the RAM, zero pages holes, so
        chunks of unchanged RAM dedup against its template's) and then the device state.

        Without ``switchover`` the guest is stopped first.  With it (mapped-ram only) the
        RAM is copied while the guest runs (pages it dirties meanwhile are written again at
        their offsets) and QEMU stops it only for the last pass (``pause-before-switchover``):
        ``switchover()`` is called in that stop, before the device state is written, for what
        must be taken at the same instant (the disk's switch to a new overlay).  The guest
        stays stopped (``postmigrate``) either way; ``cont`` runs it on.  ``durable``: fsync'd
        before it is renamed into place (a file that is uploaded and deleted needs not be)."""
        t = time.perf_counter()
        live = switchover is not None
        with contextlib.ExitStack() as stack:
            if qmp is None:
                qmp = self.qmp()
                stack.callback(qmp.close)
            if not live:
                qmp.execute("stop")
            qmp.execute("migrate-set-capabilities", capabilities=[
                *_capabilities(mapped_ram), {"capability": "pause-before-switchover", "state": live}])
            tmp = state_file.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)  # mapped-ram writes at offsets: never over an old file's pages
            out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            stack.callback(os.close, out_fd)
            qmp.execute("migrate", uri=f"file:{stack.enter_context(qmp.fdset(out_fd))}")
            deadline = time.monotonic() + SAVE_TIMEOUT
            while True:
                info = qmp.execute("query-migrate")
                if info.get("status") == "completed":
                    break
                if info.get("status") == "pre-switchover" and switchover is not None:
                    t = time.perf_counter()  # the guest is stopped from here on
                    switchover()
                    switchover = None
                    qmp.execute("migrate-continue", state="pre-switchover")
                    continue
                if info.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
                    if live:
                        with contextlib.suppress(VmError, OSError):
                            qmp.execute("migrate_cancel")
                    raise VmError(f"VMM {self.pid}: save {info.get('status')}: {info.get('error-desc', '')}")
                time.sleep(0.002)
            if durable:
                os.fsync(out_fd)
        os.replace(tmp, state_file)
        return time.perf_counter() - t

    def restore(self, state_file: Path, *, mapped_ram: bool = False) -> None:
        """Load ``state_file`` (a :meth:`save` of the same ``mapped_ram``) into a VMM started with
        ``-incoming defer`` and run it."""
        qmp = self.qmp()
        fd = os.open(state_file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            qmp.execute("migrate-set-capabilities", capabilities=_capabilities(mapped_ram))
            with qmp.fdset(fd) as name:
                qmp.execute("migrate-incoming", uri=f"file:{name}")
                self.wait_status(qmp, "paused", BOOT_TIMEOUT)
            qmp.execute("cont")
        finally:
            os.close(fd)
            qmp.close()

    def quit(self) -> None:
        with contextlib.suppress(VmError, OSError, AgentError):
            qmp = self.qmp(timeout=5.0)
            try:
                qmp.execute("quit")
            finally:
                qmp.close()
        self.reap(5.0)
        self.kill()


# -- mapped-ram images ---------------------------------------------------------------------------------
# QEMU 10's mapped-ram file (docs/devel/migration/mapped-ram.rst in its source; docs/FORMAT.md
# Part 5): the stream header, then per RAM block a record with a bitmap of the pages present
# and the pages at fixed offsets, then the rest of the stream (device state) after the last
# block's pages.  Big-endian but for the bitmap (host-endian unsigned longs: bit i of byte i>>3).
QEVM_MAGIC = 0x5145564D
RAM_SAVE_FLAG_MEM_SIZE = 0x4
MAX_RAM_BLOCKS = 256


@dataclass(frozen=True)
class RamBlock:
    idstr: str
    used_length: int
    page_size: int
    bitmap_offset: int
    pages_offset: int

    @property
    def bitmap_size(self) -> int:
        return -(-(self.used_length // self.page_size) // 64) * 8


class _Reader:
    def __init__(self, f: Any, what: str) -> None:
        self.f, self.what = f, what

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise VmError(f"{self.what}: ends at offset {self.f.tell()} inside a {n}-byte field")
        return data

    def u8(self) -> int:
        return self.take(1)[0]

    def be32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def be64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def name(self) -> str:
        return self.take(self.u8()).decode("ascii", "replace")


def mapped_ram_blocks(path: Path) -> list[RamBlock]:
    """The RAM blocks of the mapped-ram image ``path`` (a memory checkpoint's ``vmstate.bin``),
    read from its header only.  A layout this parser does not know (a device section before
    RAM, an unknown configuration subsection) is a VmError: the caller loads the image whole."""
    with open(path, "rb") as f:
        r = _Reader(f, f"mapped-ram image {path}")
        if r.be32() != QEVM_MAGIC or r.be32() != 3:
            raise VmError(f"{path}: not a QEMU migration stream of version 3")
        if r.u8() != 0x07:  # QEMU_VM_CONFIGURATION
            raise VmError(f"{path}: no configuration section")
        r.take(r.be32())  # the machine type
        while (kind := r.u8()) == 0x05:  # configuration subsections
            sub = r.name()
            r.be32()
            if sub == "configuration/target-page-bits":
                r.be32()
            elif sub == "configuration/capabilities":
                for _ in range(r.be32()):
                    r.name()
            elif sub == "configuration/uuid":
                r.take(16)
            else:
                raise VmError(f"{path}: configuration subsection {sub!r} is unknown here")
        if kind != 0x01:  # QEMU_VM_SECTION_START, of "ram" (a device section first: not parsed)
            raise VmError(f"{path}: section type {kind:#x} before RAM")
        r.be32()
        if r.name() != "ram":
            raise VmError(f"{path}: the first section is not RAM")
        r.be32()
        r.be32()
        word = r.be64()
        if not word & RAM_SAVE_FLAG_MEM_SIZE:
            raise VmError(f"{path}: no RAM size record")
        total, seen = word & ~0xFFF, 0
        blocks: list[RamBlock] = []
        while seen < total and len(blocks) < MAX_RAM_BLOCKS:
            idstr, used = r.name(), r.be64()
            version, page_size, bitmap_offset, pages_offset = r.be32(), r.be64(), r.be64(), r.be64()
            if version != 1 or page_size <= 0 or page_size & (page_size - 1) or pages_offset % page_size:
                raise VmError(f"{path}: RAM block {idstr!r} has a mapped-ram header QEMU would refuse")
            blocks.append(RamBlock(idstr, used, page_size, bitmap_offset, pages_offset))
            seen += used
            f.seek(pages_offset + used)
        if seen != total:
            raise VmError(f"{path}: RAM blocks of {seen} bytes, the stream says {total}")
        return blocks


def _bit_runs(bitmap: bytes, pages: int, value: bool) -> Iterator[tuple[int, int]]:
    """(first page, count) of every run of pages whose bit is ``value`` (bit ``i & 7`` of byte
    ``i >> 3``, as QEMU's mapped-ram bitmap has them).

    A 512 MiB guest has 131,072 pages: whole bytes of one value (the common case: RAM a guest
    never touched, or all of it) are taken at once, bits only in mixed bytes."""
    same, other = (0xFF, 0x00) if value else (0x00, 0xFF)
    start = None
    full_bytes = pages >> 3
    i = 0
    while i < full_bytes:
        byte = bitmap[i]
        if byte == same:
            if start is None:
                start = i << 3
        elif byte == other:
            if start is not None:
                yield start, (i << 3) - start
                start = None
        else:
            for bit in range(8):
                page = (i << 3) | bit
                if bool(byte >> bit & 1) == value:
                    if start is None:
                        start = page
                elif start is not None:
                    yield start, page - start
                    start = None
        i += 1
    for page in range(full_bytes << 3, pages):  # the last, partial byte
        if bool(bitmap[page >> 3] >> (page & 7) & 1) == value:
            if start is None:
                start = page
        elif start is not None:
            yield start, page - start
            start = None
    if start is not None:
        yield start, pages - start


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def exact_ram_image(path: Path) -> None:
    """Make every RAM block's page region of ``path`` the exact RAM: a hole where the bitmap
    says no page (a live save leaves a page written in one pass and zero in a later one in
    place, its bit cleared), so the file can be mapped as the guest's memory."""
    blocks = mapped_ram_blocks(path)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        for b in blocks:
            pages = b.used_length // b.page_size
            bitmap = os.pread(fd, b.bitmap_size, b.bitmap_offset)
            for first, count in _bit_runs(bitmap, pages, False):
                if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                   ctypes.c_long(b.pages_offset + first * b.page_size),
                                   ctypes.c_long(count * b.page_size)) != 0:
                    err = ctypes.get_errno()
                    raise VmError(f"{path}: punching the free pages of {b.idstr}: {os.strerror(err)}")
    finally:
        os.close(fd)


def device_state_of(image: Path, out: Path, block: str = "mem") -> RamBlock:
    """A copy of the mapped-ram ``image`` in ``out`` without RAM block ``block``'s pages: its
    bitmap all clear and its page region a hole, so a load takes every other block and the
    device state from it and leaves ``block`` as the memory backend maps it (``image`` itself,
    at the block's ``pages_offset``: fetched page by page as the guest touches it).  Reads only
    the header, the other blocks and the stream's tail of ``image``.  Returns the block."""
    blocks = mapped_ram_blocks(image)
    mem = next((b for b in blocks if b.idstr == block), None)
    if mem is None:
        raise VmError(f"{image}: no RAM block {block!r} (it has {[b.idstr for b in blocks]})")
    size = os.stat(image).st_size
    fd_in = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
    fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for lo, hi in ((0, mem.pages_offset), (mem.pages_offset + mem.used_length, size)):
            pos = lo
            while pos < hi:
                data = os.pread(fd_in, min(1 << 20, hi - pos), pos)
                if not data:
                    raise VmError(f"{image}: ends at {pos}, before {hi}")
                if data.count(0) != len(data):  # zeros stay a hole
                    os.pwrite(fd_out, data, pos)
                pos += len(data)
        os.pwrite(fd_out, b"\0" * mem.bitmap_size, mem.bitmap_offset)
        os.ftruncate(fd_out, size)
    finally:
        os.close(fd_in)
        os.close(fd_out)
    return mem


def _capabilities(mapped_ram: bool) -> list[dict[str, Any]]:
    # both, every time: a VMM keeps capabilities between migrations, and loading refuses a
    # stream whose capabilities differ from its own (mapped-ram with x-ignore-shared does
    # not load at all: "region has bad alignment")
    return [{"capability": "x-ignore-shared", "state": not mapped_ram},
            {"capability": "mapped-ram", "state": mapped_ram}]


def connect_agent(vmm: Vmm, timeout: float = BOOT_TIMEOUT) -> AgentConnection:
    """The guest's agent, once it answers the connection's HELLO (sent again each second until it
    does: a booting guest answers when its agent opens the port, and a slow one may answer a
    later one first).  A VMM that exits meanwhile, or a guest whose console says it failed (a
    kernel panic, PID 1 dead: :func:`console_failure`), is an error at once that quotes its
    console; the caller stops the VMM."""
    deadline = time.monotonic() + timeout
    conn = AgentConnection(vmm.dir / "agent.sock", timeout=timeout)
    while True:
        try:
            conn.hello(timeout=min(1.0, max(0.05, deadline - time.monotonic())))
            return conn
        except AgentError:
            failed = console_failure(vmm.dir / "console.log")
            if failed or conn.closed or not vmm.alive() or time.monotonic() > deadline:
                conn.close()
                why = ("failed" if failed else "exited" if not vmm.alive()
                       else f"closed its agent's connection ({conn.closed})" if conn.closed
                       else f"did not answer in {timeout:g} s")
                raise VmError(f"guest of VMM {vmm.pid} {why}; {vmm.log_tail()}") from None


# -- templates -------------------------------------------------------------------------------------------
def cpu_flags() -> str:
    """The host CPU's flags, digested: under KVM (``-cpu host``) a saved state loads only where they match."""
    with contextlib.suppress(OSError):
        m = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
        if m:
            return blake3.blake3(" ".join(sorted(m[1].split())).encode()).hexdigest()[:16]
    return ""


def template_key(hv: Hypervisor, assets: vmassets.Assets, layers: Sequence[str], shape: Shape, *,
                 mounted: bool = False) -> str:
    """What a saved template depends on, digested: it is shared through the store, so every
    host whose VMM would load its state differently has a key of its own.  The QEMU version
    and accelerator (a device state loads into the same VMM only); the TSC rate the guest
    calibrated at boot (under TCG the guest reads the host's TSC: another rate would run its
    clock fast or slow); under KVM the host CPU's flags (``-cpu host``).  ``mounted``: the
    template whose guest has its own disk mounted (:func:`ensure_template`)."""
    h = blake3.blake3(TEMPLATE_SCHEMA.encode())
    h.update(json.dumps({"assets": assets.key, "layers": list(layers), "shape": shape.to_json(),
                         "qemu": list(hv.version), "accel": hv.accel, "tsc_khz": hv.tsc_khz,
                         "cpu": cpu_flags() if hv.accel == "kvm" else "",
                         **({"disk": "mounted"} if mounted else {})}, sort_keys=True).encode())
    return h.hexdigest()[:32]


def load_template(path: Path, key: str) -> Template | None:
    """The complete template in ``path`` (its ``template.json`` of this schema and key), else None."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((path / "template.json").read_text())
        if isinstance(doc, dict) and doc.get("schema") == TEMPLATE_SCHEMA and doc.get("key") == key:
            return Template(key, path, doc)
    return None


@dataclass(frozen=True)
class Template:
    key: str
    dir: Path
    doc: dict[str, Any]

    @property
    def memory(self) -> Path:
        return self.dir / "memory"

    @property
    def state(self) -> Path:
        return self.dir / "state.bin"

    @property
    def disk(self) -> Path:
        """The disk the template's guest has: a sparse placeholder of the disk's size it never
        mounted, or (:attr:`mounted`) its own ext4, mounted, which new sandboxes' disks stand on."""
        return self.dir / "disk.raw"

    @property
    def mounted(self) -> bool:
        return self.doc.get("disk") == "mounted"


def make_ext4(path: Path, size: int) -> None:
    """A sparse ext4 image of ``size`` bytes, the overlay's ``upper/`` and ``work/`` in it already
    (the guest's MOUNT then writes nothing): the guest's writable disk."""
    with open(path, "wb") as f:
        f.truncate(size)
    with tempfile.TemporaryDirectory(dir=path.parent) as tree:
        for d in ("upper", "work"):
            os.mkdir(os.path.join(tree, d), 0o755)
        try:
            subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal" if size < (64 << 20) else "has_journal",
                            "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "-L", "lb-upper",
                            "-d", tree, str(path)], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            raise VmError(f"mkfs.ext4 {path}: {exc.stderr.strip()}") from None


def template_lock(root: Path, key: str) -> contextlib.AbstractContextManager[int]:
    """Held while this host boots, mounts or removes the template ``key``."""
    return flocked(root / f"{key}.lock")


def ensure_template(root: Path, hv: Hypervisor, assets: vmassets.Assets, layers: Sequence[tuple[str, str]],
                    layer_digests: Sequence[str], shape: Shape,
                    netns: Callable[[str], contextlib.AbstractContextManager[Path]],
                    jail: Callable[[str], contextlib.AbstractContextManager[tuple[int, int]]], *,
                    mounted: bool = False) -> tuple[Template, list[Template]]:
    """The template of these layers and shape on this host, booted and saved now if missing.
    ``netns(name)`` gives an isolated network namespace with the VM's tap for the boot,
    ``jail(name)`` the uid and gid its VMM runs as (the image's kernel may be the tenant's).
    Returns it and the templates this call made (none when it was there).

    Each comes in two kinds, both saved from one boot when neither is here.  ``mounted``:
    the guest has mounted a disk of its own (an empty ext4, ``disk.raw``) and its root, and
    new sandboxes' disks are overlays over that very file.  Under TCG the mount is ~100 ms
    of a restore (the guest's ext4 and overlayfs code translated afresh by each VMM); a
    restored guest then only reseeds its RNG.  A checkpoint brings a disk of its own, and a
    guest must never hold a mount of a disk other than the one it has: its restores use
    the kind saved before the mount.  One boot: saved unmounted, its memory file copied,
    run on, mounted, saved again."""
    keys = {m: template_key(hv, assets, layer_digests, shape, mounted=m) for m in (False, True)}
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    # one boot makes both kinds: both locks, always in this order
    with template_lock(root, keys[False]), template_lock(root, keys[True]):
        found = load_template(root / keys[mounted], keys[mounted])
        if found is not None:
            return found, []
        missing = {m: k for m, k in keys.items() if load_template(root / k, k) is None}
        made = _boot_templates(root, hv, assets, layers, layer_digests, shape, netns, jail, missing)
        return next(t for t in made if t.mounted == mounted), made


WARM_COMMANDS = (["/bin/true"], ["/bin/sh", "-c", "true"])


def _warm(conn: AgentConnection) -> None:
    """Run a first command or two in a mounted template before its save: the guest's page cache
    then holds the loader, libc and a shell, and its dentry cache their paths, so a restored
    guest's first command reads none of them through the disks (first exec under TCG ~120 ->
    ~75 ms).  The image's own binaries, as any command of its sandboxes runs them; an image
    without them is warmed less, never refused."""
    for argv in WARM_COMMANDS:
        try:
            proc = conn.exec(list(argv), env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, cwd="/", uid=0, gid=0)
        except (AgentError, OSError) as exc:
            log.info("template warm-up %s: %s", argv, exc)
            continue
        try:
            proc.wait(30)
        except TimeoutError:  # (nothing of it may go on into the save)
            proc.kill()
            proc.wait(30)


def _boot_templates(root: Path, hv: Hypervisor, assets: vmassets.Assets, layers: Sequence[tuple[str, str]],
                    layer_digests: Sequence[str], shape: Shape,
                    netns: Callable[[str], contextlib.AbstractContextManager[Path]],
                    jail: Callable[[str], contextlib.AbstractContextManager[tuple[int, int]]],
                    keys: dict[bool, str]) -> list[Template]:
    """Boot once and save the templates ``keys`` (mounted -> key) asks for (see :func:`ensure_template`)."""
    works = {m: root / f".{k}.tmp" for m, k in keys.items()}
    for m, k in keys.items():
        shutil.rmtree(root / k, ignore_errors=True)  # a half-made one (a crash while booting it)
        shutil.rmtree(works[m], ignore_errors=True)
        works[m].mkdir(mode=0o711)  # the VMM's chroot: it may traverse it, not list or change it
    work = works[True] if True in works else works[False]  # the booted VM's own files
    t = time.perf_counter()
    for w in works.values():
        for name, size in (("disk.raw", shape.disk), ("memory", shape.memory)):
            with open(w / name, "wb") as f:
                f.truncate(size)
    if True in works:
        make_ext4(works[True] / "disk.raw", shape.disk)
    saved: dict[bool, float] = {}
    try:
        with netns(f"lb-t{keys[min(keys)][:10]}") as ns, jail(f"template-{keys[min(keys)][:16]}") as ids:
            argv = command_line(hv, assets, shape, layers, [(str(work / "disk.raw"), "raw")], work / "memory",
                                template=True, hostname="sandbox", vm_dir=work, jail=ids)
            vmm = Vmm.spawn(work, argv, netns=ns)
            try:
                connect_agent(vmm).close()  # layers mounted
                booted = time.perf_counter() - t
                if False in works:
                    saved[False] = vmm.save(works[False] / "state.bin")
                    if work is not works[False]:  # the guest runs on in its memory file: a copy stays
                        subprocess.run(["cp", "--sparse=always", str(work / "memory"), str(works[False] / "memory")],
                                       check=True, capture_output=True)
                        qmp = vmm.qmp()
                        try:
                            qmp.execute("cont")
                        finally:
                            qmp.close()
                if True in works:
                    conn = connect_agent(vmm)
                    try:  # (written through before the save: the file is what the guest saw)
                        conn.mount()
                        _warm(conn)
                        conn.sync()
                    finally:
                        conn.close()
                    saved[True] = vmm.save(works[True] / "state.bin")
            finally:
                vmm.quit()
    except BaseException:
        for w in works.values():
            shutil.rmtree(w, ignore_errors=True)  # a boot that failed (its error quotes the console)
        raise
    made = []
    for m, k in keys.items():
        doc = {"schema": TEMPLATE_SCHEMA, "key": k, "assets": assets.key, "layers": list(layer_digests),
               "shape": shape.to_json(), "accel": hv.accel, "qemu": ".".join(map(str, hv.version)),
               "tsc_khz": hv.tsc_khz, "boot_seconds": round(booted, 3), "save_seconds": round(saved[m], 3),
               "created": round(time.time(), 3), "disk": "mounted" if m else "placeholder"}
        (works[m] / "template.json").write_text(json.dumps(doc, indent=1) + "\n")
        for name in ("disk.raw", "memory"):  # what every sandbox of it shares: never written again
            (works[m] / name).chmod(0o400)
        os.rename(works[m], root / k)
        made.append(Template(k, root / k, doc))
    return made


def pristine_disk(root: Path, size: int) -> Path:
    """This host's empty ext4 of ``size`` bytes (made once, then read-only): every new
    sandbox's disk is a qcow2 overlay over it."""
    path = root / f"ext4-{size}.raw"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with flocked(root / f"ext4-{size}.lock"):
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            make_ext4(tmp, size)
            tmp.chmod(0o400)
            os.rename(tmp, path)
    return path


def sandbox_disk(backing: str, backing_format: str, path: Path, size: int, owner: tuple[int, int]) -> None:
    """The sandbox's disk: a qcow2 overlay (its writes only) over ``backing`` (a raw ext4 image, or
    the top of a checkpoint's chain), not opened here: QEMU is given the chain (:func:`disk_args`).
    It belongs to ``owner``, the VMM's jail (a merge reopens it to write after the jail).

    An empty overlay is a header naming its backing, and nothing else: the bytes ``qemu-img``
    made for the same backing and size are written again (a process less, ~9 ms of a
    create) unless the backing is one of this VM's own files (a checkpoint's chain)."""
    # the backing as the VMM names it (qemu_path): QEMU then calls the overlay by its plain
    # name, not a json: one, which is how a merge finds it (query-named-block-nodes)
    name = qemu_path(backing, path.parent)
    key = (name, backing_format, size)
    shared = not Path(backing).is_relative_to(path.parent)
    with _OVERLAYS_LOCK:
        image = _OVERLAYS.get(key) if shared else None
    if image is None:
        try:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", backing_format, "-b", name,
                            str(path), str(size)], check=True, capture_output=True, text=True)
        except FileNotFoundError:
            raise HostUnsupported("qemu-img is not installed (apt-get install qemu-utils)") from None
        except subprocess.CalledProcessError as exc:
            raise VmError(f"qemu-img create {path}: {exc.stderr.strip()}") from None
        if shared and path.stat().st_size <= MAX_EMPTY_OVERLAY:
            with _OVERLAYS_LOCK:
                _OVERLAYS[key] = path.read_bytes()
                while len(_OVERLAYS) > OVERLAYS_KEPT:
                    del _OVERLAYS[next(iter(_OVERLAYS))]
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(image)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    os.chown(path, *owner)
    path.chmod(0o600)


def start_from_template(vm_dir: Path, hv: Hypervisor, assets: vmassets.Assets, template: Template | None,
                        layers: Sequence[tuple[str, str]], shape: Shape, state_file: Path,
                        disk_nodes: Sequence[tuple[str, str]], cgroup_procs: Sequence[Path] = (), *,
                        netns: Path, jail: tuple[int, int], guest_net: tuple[str, int, str] | None = None,
                        mapped_ram: bool = False, memory: tuple[Path, int] | None = None
                        ) -> tuple[Vmm, AgentConnection]:
    """A VMM restored from ``state_file`` (the template's, or this sandbox's own saved state;
    with ``template`` None and ``mapped_ram``, a memory image of its own: its RAM anonymous,
    or with ``memory`` (file, offset) a private mapping of that file's page region, which
    ``state_file`` then leaves out: :func:`device_state_of`), in the network namespace
    ``netns``; ``guest_net`` (address, prefix length, gateway) for eth0."""
    memory_file, offset = (template.memory, 0) if template is not None else memory or (None, 0)
    argv = command_line(hv, assets, shape, layers, disk_nodes, memory_file, template=False, hostname="sandbox",
                        vm_dir=vm_dir, jail=jail, memory_offset=offset) + ["-incoming", "defer", "-S"]
    vmm = Vmm.spawn(vm_dir, argv, cgroup_procs, netns=netns)
    try:
        vmm.restore(state_file, mapped_ram=mapped_ram)
        conn = connect_agent(vmm)
        try:
            conn.mount()  # the sandbox's own disk (a resumed guest has it mounted already)
            if guest_net is not None:
                conn.net(*guest_net)
        except BaseException:
            conn.close()
            raise
        return vmm, conn
    except BaseException:
        vmm.kill()
        raise


__all__ = ["MIN_GUEST_MEMORY", "MIN_MEMORY", "Hypervisor", "Qmp", "Shape", "Template", "VmError", "Vmm",
           "chain_image_opts", "command_line", "connect_agent", "console_failure", "cpu_flags", "device_state_of", "disk_args", "exact_ram_image", "mapped_ram_blocks",
           "qemu_path", "ensure_template", "hypervisor", "load_template", "pristine_disk", "sandbox_disk", "shape_of",
           "start_from_template", "template_key", "template_lock"]
