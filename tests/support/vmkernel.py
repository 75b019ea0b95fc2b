"""A real kernel inside an image, for ``isolation="vm", kernel="image"``: Debian's newest cloud
kernel package (bookworm-backports' when it has one), unpacked as its package would install
it on a merged-/usr system: ``/boot/vmlinuz-<version>``, the ``/vmlinuz`` link, and
``/usr/lib/modules/<version>`` with depmod's ``modules.dep``.  Kept per host under
``/var/cache/layerbox/test-kernels`` (a download of ~34 MB, from the package registry)."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

CACHE = Path(os.environ.get("LAYERBOX_TEST_KERNELS", "/var/cache/layerbox/test-kernels"))
META = "linux-image-cloud-amd64"


def _newest_package() -> str:
    """The versioned image package of the metapackage's highest version in any suite."""
    out = subprocess.run(["apt-cache", "show", META], capture_output=True, text=True, check=True).stdout
    best: tuple[tuple[int, ...], str] | None = None
    for stanza in out.split("\n\n"):
        version = re.search(r"^Version: (\S+)", stanza, re.M)
        dep = re.search(r"^Depends: (linux-image-\S+)", stanza, re.M)
        if version and dep:
            key = tuple(int(x) for x in re.findall(r"\d+", version[1])[:3])
            if best is None or key > best[0]:
                best = (key, dep[1])
    assert best is not None, f"apt-cache show {META}: no version with a Depends"
    return best[1]


def kernel_tree() -> tuple[Path, str]:
    """The unpacked tree (read-only use) and its kernel version."""
    package = _newest_package()
    root = CACHE / package
    done = root / "tree"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            subprocess.run(["apt-get", "download", "-q", package], cwd=root, check=True, capture_output=True)
            (deb,) = root.glob("*.deb")
            work = root / "work"
            subprocess.run(["dpkg-deb", "-x", str(deb), str(work)], check=True)
            (version,) = os.listdir(work / "lib/modules")
            subprocess.run(["depmod", "-b", str(work), version], check=True)  # what its postinst does
            (work / "usr/lib").mkdir(parents=True, exist_ok=True)
            os.rename(work / "lib/modules", work / "usr/lib/modules")
            shutil.rmtree(work / "lib")
            shutil.rmtree(work / "usr/share", ignore_errors=True)
            os.symlink(f"boot/vmlinuz-{version}", work / "vmlinuz")
            deb.unlink()
            os.rename(work, done)
    (version,) = os.listdir(done / "usr/lib/modules")
    return done, version
