"""Host state is root's alone: another local user can neither hold a lock nor read a table.

An flock needs nothing but an fd, and a read-only one will do: a lock file another user can
open is a lock that user can hold, and every create waits behind it (a 0644
``leases.json.lock`` held by uid 65534 once made a create take the 14 s of the hold).  So
every lock and state file is 0600, in directories others cannot list; the directories on the
way to a user-namespaced sandbox's rootfs keep the search bit its uids need, nothing more.

The data dir here starts as an older layerbox left it (0755 directories, 0644 locks and
tables); one create with a job, a user namespace and a network later, every one of them is
tight, and a process running as ``nobody`` is refused each file and each listing.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.sandboxes import REF, run

from layerstore.hoststate import HostTable, closed_dir, flocked, open_private
from sandbox.host.manager import Sandbox, SandboxManager

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun", "cmd:ip", "cmd:nft")]

NOBODY = 65534
LOOSE_FILE, LOOSE_DIR = 0o644, 0o755
JOB = "files-job"


def as_nobody(paths: list[Path], dirs: list[Path], traversable: list[Path]) -> dict[str, list[str]]:
    """What uid/gid 65534 (no groups) could do: the ``paths`` it opened (read-only, enough for an
    flock), the ``dirs`` it listed, and which of the ``traversable`` directories it could stat."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions past this block
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            stated = allowed(os.stat, traversable)
            out = {"opened": allowed(lambda p: os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK)), paths),
                   "listed": allowed(os.listdir, dirs),
                   "stat_failed": [str(d) for d in traversable if str(d) not in stated]}
            os.write(wfd, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return dict(json.loads(data))


def allowed(attempt: Callable[[Path], object], paths: list[Path]) -> list[str]:
    """The ``paths`` that ``attempt`` was not refused (EACCES) on."""
    done = []
    for path in paths:
        try:
            attempt(path)
        except PermissionError:
            continue
        done.append(str(path))
    return done


def loosen(data: Path) -> None:
    """The data dir as a layerbox before private host state left it."""
    data.chmod(LOOSE_DIR)
    for d in ("state", "blobcache", "sandbox", "sandbox/boxes", "sandbox/receipts", "sandbox/runtime", "net",
              "net/netns"):
        (data / d).mkdir(mode=LOOSE_DIR, exist_ok=True)
        (data / d).chmod(LOOSE_DIR)
    for f in ("lazyfetch.lock", "lazyfetch.start.lock", "state/lock", "blobcache/lock", "sandbox/userns.json.lock",
              "sandbox/leases.json.lock", "net/net.lock"):
        (data / f).touch()
        (data / f).chmod(LOOSE_FILE)
    # a table as the older layerbox wrote it: readable by all
    (data / "net/net.json").write_text('{"format":"layerbox.net","version":1,"subnet":"10.99.0.0/16","sandboxes":{}}')
    (data / "net/net.json").chmod(LOOSE_FILE)


def host_files(mgr: SandboxManager, box: Sandbox) -> tuple[list[Path], list[Path]]:
    """Every lock and state file of the data dir, and the directories that hold them."""
    data, root = mgr.data_dir, mgr.root
    dirs = [data / "state", data / "blobcache", root / "receipts", root / "runtime", root / "run", root / "run" / "crun",
            root / "run" / "bundles", data / "net", data / "net/netns",
            root / "leases", root / "leases" / "_host"]
    files = [data / "lazyfetch.lock", data / "lazyfetch.start.lock", data / "state/lock", data / "state/mounts.json",
             data / "blobcache/lock", root / "run.lock", root / "userns.json", root / "userns.json.lock", data / "net/net.lock",
             data / "net/net.json", box.dir / "state.json", root / "receipts" / f"{box.id}.jsonl",
             root / "leases" / "_host" / f"{JOB}.json", root / "leases" / "_host" / "lock"]
    return files, dirs


@pytest.fixture
def loose_manager(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxManager]:
    data = tmp_path_factory.mktemp("loose")
    loosen(data)
    # pytest's temp root is 0700: a user-namespaced sandbox's uids must traverse it (as in
    # test_sandbox_userns), and the test's nobody must reach the data dir to try its files
    base = tmp_path_factory.getbasetemp()
    modes = {d: stat.S_IMODE(d.stat().st_mode) for d in (base.parent, base)}
    for d, mode in modes.items():
        d.chmod(mode | 0o001)
    mgr = SandboxManager(data, store_url)
    try:
        yield mgr
    finally:
        mgr.close()
        for d, mode in modes.items():
            d.chmod(mode)


def test_nobody_can_hold_a_lock_or_read_a_table(loose_manager: SandboxManager) -> None:
    mgr = loose_manager
    box = run(mgr.create(REF, userns=True, network=[], job=JOB))
    try:
        files, dirs = host_files(mgr, box)
        modes = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
        assert {p: m for p, m in modes.items() if m != oct(0o600)} == {}
        assert not (mgr.root / "leases.json.lock").exists()  # the old table's lock went with it
        loose = {str(d): oct(stat.S_IMODE(d.stat().st_mode)) for d in [*dirs, mgr.root, mgr.boxes, box.dir]
                 if d.stat().st_mode & 0o066}
        assert loose == {}
        # the way down to the user-namespaced sandbox stays searchable: its uids must reach the rootfs
        # (the data dir itself is the operator's, left as it is: what it holds directly is 0600)
        way = [mgr.root, mgr.boxes, box.dir]
        seen = as_nobody(files, [*dirs, *way], [box.dir / "rootfs"])
        assert seen == {"opened": [], "listed": [], "stat_failed": []}
        assert box.exec("echo ok").stdout == b"ok\n"
    finally:
        box.destroy()


def test_open_private_and_closed_dir_tighten_what_an_older_layerbox_left(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o777)
    d.chmod(0o757)
    assert stat.S_IMODE(closed_dir(d).stat().st_mode) == 0o711  # search bits stay, read and write go
    made = closed_dir(tmp_path / "a" / "b" / "c")
    assert [stat.S_IMODE(p.stat().st_mode) for p in (made.parent.parent, made.parent, made)] == [0o700] * 3
    lock = d / "lock"
    lock.touch()
    lock.chmod(0o644)
    with flocked(lock):
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    (d / "link").symlink_to(lock)
    with pytest.raises(OSError, match="Too many levels of symbolic links") as refused:
        open_private(d / "link")
    assert refused.value.errno == errno.ELOOP
    table = HostTable(d / "t.json", "layerbox.test", 1)
    (d / "t.json").write_text('{"format":"layerbox.test","version":1,"n":1}')
    (d / "t.json").chmod(0o644)
    assert table.read() == {"n": 1}  # a reader tightens it too
    assert stat.S_IMODE((d / "t.json").stat().st_mode) == 0o600
