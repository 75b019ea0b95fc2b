"""The stock ``e2b`` SDK's files API against a layerbox edge: envd's ``filesystem.Filesystem``
service and ``/files`` (sandbox/edge/e2b/files.py), sync and async, on containers.

One edge and one sandbox serve most tests (each works in a directory of its own); the hostile
cases use raw HTTP where the SDK would not send what they need.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import hashlib
import io
import json
import os
import socket
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request
from e2b import (
    AsyncSandbox,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
)
from e2b.sandbox.signature import get_signature
from support.e2b import BETA, TEMPLATE, E2bEdge, e2b_edge
from support.env import unavailable
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

from sandbox.edge.e2b import files as e2b_files
from sandbox.edge.e2b.base import E2bContext

pytestmark = pytest.mark.root
ENVD = "49983"


@pytest.fixture(scope="module")
def served(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b"), store_url) as edge:
        yield edge


@pytest.fixture(scope="module")
def sbx(served: E2bEdge) -> Iterator[Sandbox]:
    box = Sandbox.create(TEMPLATE, timeout=600)
    try:
        yield box
    finally:
        box.kill()


@pytest.fixture
def home(sbx: Sandbox) -> Iterator[str]:
    """A fresh directory of the test's own under the user's home (relative, as SDK users write)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    yield name
    sbx.files.remove(f"/home/user/{name}", user="root")


def envd(served: E2bEdge, sbx: Sandbox, method: str, path: str, **kw: object) -> httpx.Response:
    """A raw request to the sandbox's envd, as a proxy in front of the edge would send it."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": ENVD, **kw.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.request(method, served.url + path, headers=headers, timeout=60, **kw)  # type: ignore[arg-type]


def sh(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, user="root").stdout


# -- the everyday calls -----------------------------------------------------------------------------------
def test_write_and_read_text_and_bytes_as_the_user_in_its_home(sbx: Sandbox, home: str) -> None:
    info = sbx.files.write(f"{home}/hello.txt", "hej då\n")
    assert (info.name, info.type, info.path) == ("hello.txt", FileType.FILE, f"/home/user/{home}/hello.txt")
    assert sbx.files.read(f"{home}/hello.txt") == "hej då\n"
    blob = bytes(range(256)) * 100
    sbx.files.write(f"~/{home}/blob.bin", blob)
    assert sbx.files.read(f"/home/user/{home}/blob.bin", format="bytes") == bytearray(blob)
    assert sh(sbx, f"stat -c '%U:%G %a' /home/user/{home} /home/user/{home}/blob.bin") == "user:user 755\nuser:user 644\n"
    entry = sbx.files.get_info(f"{home}/hello.txt")
    assert (entry.size, entry.mode, entry.permissions, entry.owner, entry.group) == (
        len("hej då\n".encode()), 0o644, "-rw-r--r--", "user", "user")
    assert entry.modified_time.tzinfo is not None
    sbx.files.write(".bashrc", "# the template's file, in a lower layer: copied up, still the user's\n")
    assert sh(sbx, "stat -c %U:%G /home/user/.bashrc; cat /home/user/.bashrc") == \
        "user:user\n# the template's file, in a lower layer: copied up, still the user's\n"
    assert sbx.files.get_info("/").name == "/"
    assert abs(entry.modified_time.timestamp() - time.time()) < 3600


def test_root_writes_as_root_and_the_user_cannot_write_where_its_uid_could_not(sbx: Sandbox, home: str) -> None:
    sbx.files.write(f"/home/user/{home}/mine", "root's", user="root")
    assert sh(sbx, f"stat -c %U:%G /home/user/{home}/mine") == "root:root\n"
    assert sbx.files.get_info(f"/home/user/{home}/mine").owner == "root"
    with pytest.raises(SandboxException, match="403|ermission"):
        sbx.files.write("/etc/not-the-users", "x")
    with pytest.raises(SandboxException, match="ermission"):
        sbx.files.make_dir("/root/not-the-users")
    with pytest.raises(SandboxException, match="403|ermission"):
        sbx.files.read("/root/.bashrc")  # /root is 0700
    with pytest.raises(SandboxException, match="ermission"):
        sbx.files.remove("/etc/hostname")
    with pytest.raises(SandboxException, match="ermission"):
        sbx.files.rename("/etc/hostname", f"/home/user/{home}/stolen")
    assert sh(sbx, "ls /etc/not-the-users /root/not-the-users 2>&1 | grep -c 'No such'") == "2\n"
    assert sh(sbx, "test -f /etc/hostname && echo kept") == "kept\n"


def test_an_account_the_sandbox_changes_is_used_as_changed(sbx: Sandbox, home: str) -> None:
    """The edge remembers each account it read, and checks its passwd and group at every use: an
    edit by the sandbox (a new uid, a new group) holds for the very next call."""
    sbx.files.write("/tmp/acct-before", "x")
    sh(sbx, "cp /etc/passwd /tmp/passwd.orig && cp /etc/group /tmp/group.orig && mkdir -m 0770 /tmp/crew-only && "
            "groupadd -g 4242 crew && chgrp crew /tmp/crew-only && sed -i 's/^user:x:1000:/user:x:1042:/' /etc/passwd")
    try:
        with pytest.raises(SandboxException, match="ermission"):  # not yet in the group
            sbx.files.write("/tmp/crew-only/in", "x")
        sbx.files.write("/tmp/acct-after", "x")
        assert sh(sbx, "stat -c %u /tmp/acct-before /tmp/acct-after") == "1000\n1042\n"
        sh(sbx, "sed -i 's/^crew:x:4242:$/crew:x:4242:user/' /etc/group")
        sbx.files.write("/tmp/crew-only/in", "x")
        assert sh(sbx, "stat -c %u:%G /tmp/crew-only/in") == "1042:user\n"  # (its primary group)
    finally:
        sh(sbx, "cp /tmp/passwd.orig /etc/passwd && cp /tmp/group.orig /etc/group && "
                "rm -rf /tmp/crew-only /tmp/acct-before /tmp/acct-after")
    sbx.files.write("/tmp/acct-back", "x")
    assert sh(sbx, "stat -c %u /tmp/acct-back; rm /tmp/acct-back") == "1000\n"


def test_several_files_at_once_then_listed_by_depth(sbx: Sandbox, home: str) -> None:
    written = sbx.files.write_files([{"path": f"{home}/a.txt", "data": "a"},
                                     {"path": f"{home}/sub/b.txt", "data": b"bb"},
                                     {"path": f"{home}/sub/deeper/c.txt", "data": io.BytesIO(b"ccc")}])
    assert [w.path for w in written] == [f"/home/user/{home}/{p}" for p in ("a.txt", "sub/b.txt", "sub/deeper/c.txt")]
    assert [(e.name, e.type) for e in sbx.files.list(home)] == [("a.txt", FileType.FILE), ("sub", FileType.DIR)]
    deep = sbx.files.list(home, depth=3)
    assert [e.path.removeprefix(f"/home/user/{home}/") for e in deep] == [
        "a.txt", "sub", "sub/b.txt", "sub/deeper", "sub/deeper/c.txt"]
    assert {e.name: e.size for e in deep if e.type == FileType.FILE} == {"a.txt": 1, "b.txt": 2, "c.txt": 3}
    assert all((e.owner, e.group) == ("user", "user") for e in deep)
    assert next(e for e in deep if e.name == "deeper").permissions == "drwxr-xr-x"


def test_several_files_at_once_keep_their_absolute_paths(sbx: Sandbox, home: str) -> None:
    """A multipart part's file name is its path as given, leading slash and all (envd's
    FileNameWithPath): /tmp/x is written to /tmp/x, not under the home directory."""
    where = f"/tmp/abs-{uuid.uuid4().hex[:8]}"
    written = sbx.files.write_files([{"path": f"{where}/a.txt", "data": "a"}, {"path": f"{home}/rel.txt", "data": "r"}])
    assert [w.path for w in written] == [f"{where}/a.txt", f"/home/user/{home}/rel.txt"]
    assert sh(sbx, f"cat {where}/a.txt; rm -r {where}") == "a"
    assert not sbx.files.exists(f"tmp/{where.removeprefix('/tmp/')}/a.txt")


def test_a_file_on_another_mount_is_read_inside_the_sandbox_as_the_account(sbx: Sandbox) -> None:
    """/proc and /sys are the sandbox's own mounts, which the host's view of its root does not
    reach; envd reads them, so a download of one is read inside the sandbox, as the account.
    The attack: what the account may not read there stays unreadable (nothing is read as the host)."""
    boot = sh(sbx, "cat /proc/sys/kernel/random/boot_id")
    assert sbx.files.read("/proc/sys/kernel/random/boot_id") == boot
    assert sbx.files.read("/proc/self/status").count("Uid:\t1000\t") == 1  # read by the account's process
    assert sbx.files.read("/proc/self/status", user="root").count("Uid:\t0\t") == 1
    with pytest.raises(SandboxException, match="ermission denied"):
        sbx.files.read("/proc/1/environ")  # the sandbox's init, root's: not the account's to read
    with pytest.raises(NotFoundException, match="/proc/no-such-entry"):
        sbx.files.read("/proc/no-such-entry")


def test_exists_make_dir_rename_remove(sbx: Sandbox, home: str) -> None:
    assert sbx.files.make_dir(f"{home}/x/y") is True
    assert sbx.files.make_dir(f"{home}/x/y") is False
    assert sbx.files.exists(f"{home}/x/y")
    assert not sbx.files.exists(f"{home}/nope")
    sbx.files.write(f"{home}/x/y/f", "moved")
    moved = sbx.files.rename(f"{home}/x/y/f", f"{home}/z/g")
    assert (moved.name, moved.path, moved.type) == ("g", f"/home/user/{home}/z/g", FileType.FILE)
    assert sbx.files.read(f"{home}/z/g") == "moved"
    assert not sbx.files.exists(f"{home}/x/y/f")
    sbx.files.remove(f"{home}/x")
    sbx.files.remove(f"{home}/x")  # envd's remove is rm -rf: nothing there is no error
    assert not sbx.files.exists(f"{home}/x")
    assert sh(sbx, f"stat -c %U /home/user/{home}/z") == "user\n"


def test_a_symlink_is_described_with_its_resolved_target(sbx: Sandbox, home: str) -> None:
    sbx.files.write(f"{home}/target.txt", "t")
    sbx.commands.run(f"ln -s target.txt /home/user/{home}/link", user="user")
    info = sbx.files.get_info(f"{home}/link")
    assert (info.type, info.symlink_target, info.permissions) == (
        FileType.SYMLINK, f"/home/user/{home}/target.txt", "Lrwxrwxrwx")
    assert info.mode == 0o644  # the target's, as envd reports
    assert sbx.files.read(f"{home}/link") == "t"


def test_metadata_travels_as_user_e2b_attributes(sbx: Sandbox, home: str) -> None:
    info = sbx.files.write(f"{home}/m.txt", "m", metadata={"Owner": "alice", "run": "r1"})
    if info.metadata is None:  # a kernel feature: CI fails here rather than skip
        unavailable("the sandbox's upper filesystem keeps no user.* attributes here")
    assert info.metadata == {"owner": "alice", "run": "r1"}
    assert sbx.files.get_info(f"{home}/m.txt").metadata == {"owner": "alice", "run": "r1"}
    sbx.files.write(f"{home}/m.txt", "again", metadata={"run": "r2"})
    assert sbx.files.list(home)[0].metadata == {"run": "r2"}


def test_errors_the_sdk_maps(sbx: Sandbox, home: str) -> None:
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{home}/missing")
    with pytest.raises(NotFoundException):
        sbx.files.get_info(f"{home}/missing")
    with pytest.raises(NotFoundException):
        sbx.files.list(f"{home}/missing")
    sbx.files.write(f"{home}/file", "f")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        sbx.files.list(f"{home}/file")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sbx.files.read(home)
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        sbx.files.make_dir(f"{home}/file")
    with pytest.raises(InvalidArgumentException, match="another user's home"):
        sbx.files.get_info("~root/x")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        sbx.files.watch_dir(f"{home}/file")
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir(f"{home}/missing")


# -- watching ---------------------------------------------------------------------------------------------
def test_a_polled_watcher_sees_create_write_and_remove(sbx: Sandbox, home: str) -> None:
    sbx.files.make_dir(f"{home}/w/nested")
    handle = sbx.files.watch_dir(f"{home}/w", include_entry=True)
    try:
        sbx.files.write(f"{home}/w/f.txt", "one")
        seen = [(e.type, e.name) for e in handle.get_new_events()]
        assert seen == [(kind, "f.txt") for kind in (  # envd's sequence: create, chown, write
            FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE)]
        sbx.files.write(f"{home}/w/f.txt", "two")
        events = handle.get_new_events()
        write = next(e for e in events if e.type == FilesystemEventType.WRITE)
        assert write.entry is not None
        assert write.entry.path == f"/home/user/{home}/w/f.txt"
        sbx.commands.run(f"rm /home/user/{home}/w/f.txt; touch /home/user/{home}/w/nested/ignored")
        assert [(e.type, e.name) for e in handle.get_new_events()] == [(FilesystemEventType.REMOVE, "f.txt")]
    finally:
        handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


def test_a_recursive_watcher_follows_new_directories(sbx: Sandbox, home: str) -> None:
    sbx.files.make_dir(f"{home}/r/a")
    handle = sbx.files.watch_dir(f"{home}/r", recursive=True)
    try:
        sbx.files.write(f"{home}/r/a/f", "x")
        sbx.commands.run(f"mkdir -p /home/user/{home}/r/b/c && echo hi > /home/user/{home}/r/b/c/g")
        sbx.files.write(f"{home}/r/b/c/h", "y")
        seen = {(e.type, e.name) for e in handle.get_new_events()}
        for created in ("a/f", "b", "b/c", "b/c/g", "b/c/h"):
            assert (FilesystemEventType.CREATE, created) in seen
        assert (FilesystemEventType.WRITE, "b/c/h") in seen
    finally:
        handle.stop()


def test_a_watcher_nobody_reads_keeps_a_bounded_backlog(sbx: Sandbox, home: str) -> None:
    sbx.files.make_dir(home)
    handle = sbx.files.watch_dir(home)
    try:
        sbx.commands.run(f"cd /home/user/{home} && for i in $(seq 6000); do : > f$i; done", timeout=120)
        kept = len(handle.get_new_events())  # what was kept before the watcher gave up
        with pytest.raises(RateLimitException, match="4096 events unread"):
            handle.get_new_events()
    finally:
        handle.stop()
    assert kept == 4096


def test_a_watcher_ends_with_its_sandbox(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=60)
    try:
        handle = box.files.watch_dir("/tmp")
        box.files.write("/tmp/x", "x")
        assert FilesystemEventType.CREATE in {e.type for e in handle.get_new_events()}
    finally:
        box.kill()
    with pytest.raises(SandboxException):
        handle.get_new_events()


def test_watchers_are_bounded_per_sandbox(sbx: Sandbox, home: str) -> None:
    sbx.files.make_dir(home)
    handles = []
    try:
        for _ in range(16):
            handles.append(sbx.files.watch_dir(home))
        with pytest.raises(SandboxException, match="watchers"):
            sbx.files.watch_dir(home)
    finally:
        for h in handles:
            h.stop()
    sbx.files.watch_dir(home).stop()  # stopped ones are given back


def test_the_async_client_reads_writes_and_streams_watch_events(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    async def scenario() -> list[tuple[FilesystemEventType, str]]:
        box = await AsyncSandbox.connect(sbx.sandbox_id)
        await box.files.make_dir(home)
        got: list[tuple[FilesystemEventType, str]] = []
        done = asyncio.Event()

        def on_event(e: object) -> None:
            got.append((e.type, e.name))  # type: ignore[attr-defined]
            if (FilesystemEventType.REMOVE, "a.txt") in got:
                done.set()

        handle = await box.files.watch_dir(home, on_event, timeout=60)
        await box.files.write(f"{home}/a.txt", b"async bytes")
        assert await box.files.read(f"{home}/a.txt", format="bytes") == bytearray(b"async bytes")
        assert [e.name for e in await box.files.list(home)] == ["a.txt"]
        await box.files.remove(f"{home}/a.txt")
        await asyncio.wait_for(done.wait(), 30)
        await handle.stop()
        return got

    got = asyncio.run(scenario())
    assert got[0] == (FilesystemEventType.CREATE, "a.txt")
    assert (FilesystemEventType.WRITE, "a.txt") in got
    assert got[-1] == (FilesystemEventType.REMOVE, "a.txt")


# -- transfers --------------------------------------------------------------------------------------------
def peak_rss(served: E2bEdge) -> int:
    """The edge process's peak resident memory so far (VmHWM), bytes."""
    assert served.edge.proc is not None
    status = Path(f"/proc/{served.edge.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) << 10


def test_a_50_mb_upload_streams_both_ways(served: E2bEdge, sbx: Sandbox, home: str, tmp_path: Path) -> None:
    src = tmp_path / "big"
    with open(src, "wb") as f:
        for i in range(50):
            f.write(hashlib.sha256(str(i).encode()).digest() * (1 << 15))
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    before = peak_rss(served)
    with open(src, "rb") as f:
        sbx.files.write(f"{home}/big", f)  # a file object: octet-stream, streamed
    got = hashlib.sha256()
    with sbx.files.read(f"{home}/big", format="stream") as stream:
        for chunk in stream:
            got.update(chunk)
    assert got.hexdigest() == want
    assert peak_rss(served) - before < 32 << 20  # streamed through: a buffered copy would be 50 MiB
    assert sh(sbx, f"sha256sum /home/user/{home}/big").split()[0] == want
    sbx.files.write(f"{home}/gz", b"squeezed " * 1000, gzip=True)
    assert sbx.files.read(f"{home}/gz", format="bytes", gzip=True) == bytearray(b"squeezed " * 1000)


def test_a_download_is_compressed_only_when_asked(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    sbx.files.write(f"{home}/z", "zip " * 1000)
    token = {"X-Access-Token": sbx._envd_access_token or ""}
    for accept, encoded in (("gzip", True), ("gzip;q=0.5, identity", True), ("gzip;q=0", False), ("identity", False),
                            ("gzip, deflate", False), ("br, gzip;q=0.5", False)):  # a library's default list
        r = envd(served, sbx, "GET", "/files", params={"path": f"{home}/z"}, headers={**token, "Accept-Encoding": accept})
        assert r.status_code == 200
        assert (r.headers.get("Content-Encoding") == "gzip") is encoded, accept
        assert r.text == "zip " * 1000  # (httpx decodes gzip)


def test_a_download_serves_ranges_and_its_length(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    sbx.files.write(f"{home}/r", bytes(range(256)) * 64)
    token = {"X-Access-Token": sbx._envd_access_token or ""}
    whole = envd(served, sbx, "GET", "/files", params={"path": f"{home}/r"}, headers=token)
    assert whole.status_code == 200
    assert whole.headers["Content-Length"] == str(256 * 64)
    part = envd(served, sbx, "GET", "/files", params={"path": f"{home}/r"}, headers={**token, "Range": "bytes=2-5"})
    assert part.status_code == 206
    assert part.content == bytes([2, 3, 4, 5])
    past = envd(served, sbx, "GET", "/files", params={"path": f"{home}/r"},
                headers={**token, "Range": f"bytes={256 * 64}-"})
    assert past.status_code == 416


def test_signed_urls_read_and_write_and_refuse_the_rest(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    sbx.files.write(f"{home}/s.txt", "signed")

    def get(url: str) -> httpx.Response:  # the URL's query, sent where E2B_SANDBOX_URL points (no token)
        return envd(served, sbx, "GET", "/files?" + urllib.parse.urlsplit(url).query)

    assert get(sbx.download_url(f"{home}/s.txt")).text == "signed"
    assert get(sbx.download_url(f"{home}/s.txt", user="user", use_signature_expiration=60)).text == "signed"
    expired = get(sbx.download_url(f"{home}/s.txt", user="user", use_signature_expiration=-120))
    assert expired.status_code == 401
    assert "expired" in expired.json()["message"]
    forged = sbx.download_url(f"{home}/s.txt").replace("signature=v1_", "signature=v1_A")
    assert get(forged).status_code == 401
    other = get_signature(f"{home}/s.txt", "read", None, "not-this-sandboxs-token")
    assert envd(served, sbx, "GET", "/files", params={"path": f"{home}/s.txt", "signature": other["signature"]}
                ).status_code == 401
    write_url = sbx.download_url(f"{home}/s.txt")  # signed for read: not a write
    assert envd(served, sbx, "POST", "/files?" + urllib.parse.urlsplit(write_url).query,
                files={"file": ("x", b"no")}).status_code == 401
    assert envd(served, sbx, "GET", "/files", params={"path": f"{home}/s.txt"}).status_code == 401
    up = sbx.upload_url(f"{home}/up.txt")
    r = envd(served, sbx, "POST", "/files?" + urllib.parse.urlsplit(up).query, files={"file": ("up.txt", b"posted")})
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "up.txt", "type": "file", "path": f"/home/user/{home}/up.txt"}]
    assert sbx.files.read(f"{home}/up.txt") == "posted"
    assert sh(sbx, f"stat -c %U /home/user/{home}/up.txt") == "user\n"


def test_signed_urls_as_the_sdk_gives_them_name_no_sandbox_and_still_reach_theirs(served: E2bEdge, sbx: Sandbox,
                                                                                    home: str) -> None:
    """With E2B_SANDBOX_URL the SDK's URLs are ``<url>/files?path=..&signature=..``: no sandbox in
    them, fetched by a client with no header at all (a browser, curl)."""
    other = Sandbox.create(TEMPLATE, timeout=60)
    try:
        for box in (sbx, other):
            box.files.write(f"/tmp/{home}-whose", box.sandbox_id)
        for box in (sbx, other):
            url = box.download_url(f"/tmp/{home}-whose", use_signature_expiration=60)
            assert url.startswith(served.url + "/files?")
            got = httpx.get(url, timeout=60)
            assert (got.status_code, got.text) == (200, box.sandbox_id)
        up = other.upload_url(f"/tmp/{home}-posted")
        r = httpx.post(up, files={"file": ("p", b"posted")}, timeout=60)
        assert r.status_code == 200, r.text
        assert other.files.read(f"/tmp/{home}-posted") == "posted"
        assert not sbx.files.exists(f"/tmp/{home}-posted")
        # the attack: forged, reused for another operation, expired, unsigned, malformed; all 401, none reaches a file
        read_url = sbx.download_url(f"/tmp/{home}-whose")
        refused = [httpx.get(read_url.replace("signature=v1_", "signature=v1_A")[:-1], timeout=60),
                   httpx.post(read_url, files={"file": ("x", b"overwritten")}, timeout=60),
                   httpx.get(sbx.download_url(f"/tmp/{home}-whose", use_signature_expiration=-120), timeout=60),
                   httpx.get(f"{served.url}/files?path=/tmp/{home}-whose", timeout=60),
                   httpx.get(f"{served.url}/files?path=/tmp/{home}-whose&signature=v1_..", timeout=60)]
        assert [r.status_code for r in refused] == [401] * 5, [r.text for r in refused]
        assert all(r.json()["code"] == 401 for r in refused)  # E2B's error body
        assert sbx.files.read(f"/tmp/{home}-whose") == sbx.sandbox_id
        gone_url = other.download_url(f"/tmp/{home}-whose")
    finally:
        other.kill()
    assert httpx.get(gone_url, timeout=60).status_code == 401  # its sandbox's token signs for nothing now


def test_a_flood_of_forged_unnamed_urls_is_bounded_and_the_genuine_one_still_finds_its_sandbox() -> None:
    """The signer search of a URL that names no sandbox, on an edge holding 20,000 sandboxes (its
    manager stands in for them: no test host holds that many), flooded with 60 forged URLs at once:
    at most MAX_SEARCH_WAITING of them wait for the search, the rest are 429 at once; the genuine
    URL, signed by the e2b SDK's own code for the last sandbox, finds it once the flood is over."""
    ids = [f"i{n:015x}" for n in range(20_000)]
    ctx = SimpleNamespace(manager=SimpleNamespace(ids=lambda: ids))
    searcher = e2b_files.Files(E2bContext(ctx, b"a secret of the test"))  # type: ignore[arg-type]
    path, last = "/home/user/report.txt", ids[-1]
    genuine = get_signature(path, "read", "user", searcher.e2b.keys.access_token(last), 60)

    def request(signature: str, expiration: int | None = None) -> Any:
        query = {"path": path, "username": "user", "signature": signature,
                 **({"signature_expiration": str(expiration)} if expiration else {})}
        return make_mocked_request("GET", "/files?" + urllib.parse.urlencode(query))

    async def flood() -> tuple[list[Any], str]:
        forged = [searcher.signer(request("v1_" + f"{n:043d}")) for n in range(60)]
        outcomes = await asyncio.gather(*forged, return_exceptions=True)
        return outcomes, await searcher.signer(request(genuine["signature"], genuine["expiration"]))

    outcomes, found = asyncio.run(flood())
    statuses = [getattr(o, "status", None) for o in outcomes]
    assert set(statuses) == {401, 429}, outcomes
    assert statuses.count(401) <= e2b_files.MAX_SEARCH_WAITING  # the searched ones: no token signed them
    assert "retry" in str(next(o for o in outcomes if getattr(o, "status", None) == 429))
    assert found == last


# -- hostile ----------------------------------------------------------------------------------------------
def test_paths_never_leave_the_sandbox(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    marker = f"layerbox-escape-{uuid.uuid4().hex[:8]}"
    sbx.files.write(f"../../../../../../tmp/{marker}", "inside", user="root")
    assert sh(sbx, f"cat /tmp/{marker}") == "inside"
    assert not os.path.exists(f"/tmp/{marker}")
    sbx.commands.run(f"mkdir -p /home/user/{home} && ln -s /etc /home/user/{home}/etc && ln -s / /home/user/{home}/top",
                     user="user")
    sbx.files.write(f"/home/user/{home}/etc/{marker}", "still inside", user="root")
    assert sh(sbx, f"cat /etc/{marker}") == "still inside"
    assert not os.path.exists(f"/etc/{marker}")
    for through in (f"/home/user/{home}/top/etc/{marker}", f"{home}/../../../../../../etc/{marker}"):
        assert sbx.files.read(through, user="root") == "still inside"  # the sandbox's /etc, by both ways
    assert sbx.files.get_info(f"{home}/etc").symlink_target == "/etc"
    # another mount: not crossed from the host; read inside the sandbox, its own /proc as its root sees it
    inside = sbx.files.read(f"/home/user/{home}/top/proc/1/environ", user="root", format="bytes")
    assert inside == base64.b64decode(sbx.commands.run("base64 -w0 /proc/1/environ", user="root").stdout)
    assert inside != Path(f"/proc/{served.edge.proc.pid}/environ").read_bytes()  # never the edge's own
    sbx.files.remove(f"/tmp/{marker}", user="root")
    sbx.files.remove(f"/etc/{marker}", user="root")


def test_another_sandboxs_token_or_project_gets_nothing(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    sbx.files.write(f"{home}/private", "alpha's")
    other = Sandbox.create(TEMPLATE, timeout=60)
    try:
        theirs = {"X-Access-Token": other._envd_access_token or ""}
        r = envd(served, sbx, "GET", "/files", params={"path": f"{home}/private"}, headers=theirs)
        assert r.status_code == 502
        assert "not found" in r.text
        r = envd(served, sbx, "POST", "/filesystem.Filesystem/Stat", headers={**theirs, "Content-Type": "application/json"},
                 content=json.dumps({"path": f"{home}/private"}))
        assert r.status_code != 200
        assert "alpha" not in r.text
        beta = {"X-API-Key": BETA}
        r = envd(served, sbx, "GET", "/files", params={"path": f"{home}/private"}, headers=beta)
        assert r.status_code == 502
        assert "alpha's" not in r.text
        up = other.upload_url(f"/home/user/{home}/private")  # signed for the other sandbox
        r = envd(served, sbx, "POST", "/files?" + urllib.parse.urlsplit(up).query, files={"file": ("p", b"mine")})
        assert r.status_code == 401
        assert sbx.files.read(f"{home}/private") == "alpha's"
    finally:
        other.kill()


def test_an_oversized_connect_message_is_refused(served: E2bEdge, sbx: Sandbox) -> None:
    token = {"X-Access-Token": sbx._envd_access_token or "", "Content-Type": "application/json"}
    r = envd(served, sbx, "POST", "/filesystem.Filesystem/Stat", headers=token,
             content=json.dumps({"path": "a" * (128 << 10)}))
    assert r.status_code in (400, 413, 429)
    assert "resource_exhausted" in r.text.lower()
    r = envd(served, sbx, "POST", "/filesystem.Filesystem/Stat", headers=token, content=json.dumps({"path": "/etc"}))
    assert r.status_code == 200
    assert r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"


def open_fds(served: E2bEdge) -> set[str]:
    """What the edge process's descriptors point at."""
    assert served.edge.proc is not None
    fds = Path(f"/proc/{served.edge.proc.pid}/fd")
    out = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            out.add(os.readlink(fd))
    return out


def test_an_upload_its_client_abandons_leaves_no_descriptor_open(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    """The edge opens the file while the body arrives and writes each piece while it reads the
    next: a client that goes away in the middle leaves no descriptor of the sandbox's file behind
    (one held open would pin it, one closed under a write could land bytes in another file)."""
    sbx.files.write(f"{home}/cut", b"o" * (3 << 20))  # an old file: the open truncates it
    url = urllib.parse.urlsplit(served.url)
    boundary = "cut" + uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{home}/cut\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    piece = b"n" * (1 << 20)

    def holding() -> bool:
        return any(f.endswith(f"/{home}/cut") for f in open_fds(served))

    def until(cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)

    for sent in (0, 1, 3):  # MiB of the body before the client goes: as the file opens, a write, later
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall((f"POST /files HTTP/1.1\r\nHost: {url.netloc}\r\nE2b-Sandbox-Id: {sbx.sandbox_id}\r\n"
                          f"E2b-Sandbox-Port: {ENVD}\r\nX-Access-Token: {sbx._envd_access_token}\r\n"
                          f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                          f"Content-Length: {len(head) + (8 << 20)}\r\n\r\n").encode() + head)
            for _ in range(sent):
                conn.sendall(piece)
            until(holding)  # the edge has the file open
            assert holding()
        until(lambda: not holding())
        assert not holding(), f"the edge still holds the file after its client left ({sent} MiB sent)"
    written = sbx.files.read(f"{home}/cut", format="bytes")
    assert set(written) <= {ord("n")}  # truncated, then only what the last client sent
    sbx.files.write(f"{home}/cut", b"whole")  # and the edge still takes an upload of that file
    assert sbx.files.read(f"{home}/cut") == "whole"


def test_a_chunked_upload_of_tiny_and_odd_pieces_lands_whole(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    """``Transfer-Encoding: chunked`` bodies, octet-stream and multipart, in HTTP chunks of 1 byte to
    300 KiB (a delimiter cut across chunks, thousands of chunks in one write's batch): the edge
    takes the connection's pieces as they come and writes every byte once, in order."""
    url = urllib.parse.urlsplit(served.url)
    data = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(70_000))  # 2.24 MB
    boundary = "chunky" + uuid.uuid4().hex
    multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{home}/mp\"\r\n\r\n"
                 ).encode() + data + f"\r\n--{boundary}--\r\n".encode()
    sizes = [1] * 3000 + [7, 300 << 10, 13, 64 << 10, 2, 1 << 20]  # then the rest in 99 KiB chunks

    def chunked(body: bytes) -> bytes:
        out, at = [], 0
        for n in [*sizes, *[99 << 10] * (len(body) // (99 << 10) + 1)]:
            piece = body[at : at + n]
            if not piece:
                break
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
            at += n
        return b"".join(out) + b"0\r\n\r\n"

    for query, kind, body in ((f"?path={home}/oct", "application/octet-stream", data),
                              ("", f"multipart/form-data; boundary={boundary}", multipart)):
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall((f"POST /files{query} HTTP/1.1\r\nHost: {url.netloc}\r\nE2b-Sandbox-Id: {sbx.sandbox_id}\r\n"
                          f"E2b-Sandbox-Port: {ENVD}\r\nX-Access-Token: {sbx._envd_access_token}\r\n"
                          f"Content-Type: {kind}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                          ).encode() + chunked(body))
            answer = b""
            while piece := conn.recv(1 << 16):
                answer += piece
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    for name in ("oct", "mp"):
        assert hashlib.sha256(sbx.files.read(f"{home}/{name}", format="bytes")).digest() == hashlib.sha256(data).digest()


def test_an_upload_batch_gathers_small_pieces_into_few_buffers_in_order() -> None:
    """What one write takes of a body: about a MiB, every byte once and in order, in a bounded number
    of buffers whatever the client's chunking (a byte per HTTP chunk is the hostile case: the gather
    must not re-join what it already holds each time it grows)."""
    small, big = e2b_files.SMALL_PIECE, e2b_files.CHUNK
    shapes = [[1] * 200_000, [7, small, 1, small - 1, 3, 3 * small, 2] * 9, [big + 5], [small // 2] * 40 + [1]]
    for sizes in shapes:
        body = os.urandom(sum(sizes))
        at = 0
        delivered = []
        for n in sizes:
            delivered.append(body[at:at + n])
            at += n
        queue = iter(delivered)

        async def read(_: int, queue: Any = queue) -> bytes:
            return next(queue, b"")

        async def batches(read: Any = read) -> list[list[bytes]]:
            out = []
            while batch := await e2b_files._piece(read):
                out.append(batch)
            return out

        got = asyncio.run(batches())
        assert b"".join(b"".join(batch) for batch in got) == body
        for batch in got[:-1]:
            assert sum(map(len, batch)) >= big  # a batch is a MiB or more, but the last
        assert max(len(batch) for batch in got) <= 2 * (big // small) + 1, [len(b) for b in got]


def test_a_bad_upload_is_refused_by_field(served: E2bEdge, sbx: Sandbox, home: str) -> None:
    token = {"X-Access-Token": sbx._envd_access_token or ""}
    r = envd(served, sbx, "POST", "/files", headers={**token, "Content-Type": "application/octet-stream"},
             content=b"x")
    assert r.status_code == 400
    assert "path" in r.json()["message"]
    r = envd(served, sbx, "POST", "/files", params={"path": f"{home}/t"}, headers={**token, "Content-Type": "text/plain"},
             content=b"x")
    assert r.status_code == 400
    assert "Content-Type" in r.json()["message"]
    r = envd(served, sbx, "POST", "/files", headers=token,
             files=[("file", (f"{home}/same", b"1")), ("file", (f"{home}/same", b"2"))])
    assert r.status_code == 400
    assert "same path" in r.json()["message"]
    r = envd(served, sbx, "POST", "/files", params={"path": f"{home}/z", "username": "no body"}, headers=token,
             files={"file": ("z", b"1")})
    assert r.status_code == 400
    assert "username" in r.json()["message"]
    r = envd(served, sbx, "POST", "/files", params={"path": f"{home}/gz"},
             headers={**token, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
             content=gzip.compress(b"unzipped"))
    assert r.status_code == 200
    assert sbx.files.read(f"{home}/gz") == "unzipped"
