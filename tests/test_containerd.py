"""The containerd snapshotter against real containerd (Debian 12's 1.6 and Debian's 2.x build),
runc, Debian's docker-registry on 127.0.0.1, and the kernel's EROFS and overlayfs.

* An image the store already holds (published with ``layerbox publish``): containerd 2.x pulls
  it without one layer blob from the registry (its log is read) and runs it, fetching only the
  chunks the container reads.  Two containers share the layer mounts; the snapshotter killed -9
  and restarted leaves running containers reading and new ones starting; ``ctr snapshots``,
  ``ctr image rm`` and a containerd restart behave.
* An image the store lacks: containerd 1.6 applies its tars as with any snapshotter; the
  snapshotter converts each committed layer and publishes it, and a second host's containerd
  then pulls it from the store alone, reading the same bytes.
* The API without containerd: each RPC's rules and errors, keys that look like paths, labels
  too large, and a restart after a crash that left a directory and a hold no snapshot names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from converters.publish import chain_ref
from lazyfetch import kmount
from lazyfetch.mounts import HostMounts
from tests.support.containerd import (
    CONTAINERD2,
    Containerd,
    Snapshotter,
    require_containerd,
    require_containerd2,
    short_dir,
)
from tests.support.hosts import publish_sync, resolve_sync
from tests.support.registry import fixture_archive, push, require_tools, running_registry

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay"), pytest.mark.slow]

PUBLISH_TIMEOUT = 300.0
CALC_TESTS = "python3 -m unittest discover -s /workspace/calc/tests"


def _fixture_files() -> dict[str, Any]:
    """The fixture python image's manifest digests and the top layer's /etc/motd, read from the
    archive with tarfile (not through layerbox)."""
    with tarfile.open(fixture_archive()) as tar:
        names = {n.removeprefix("./"): n for n in tar.getnames()}

        def member(name: str) -> bytes:
            f = tar.extractfile(names[name])
            assert f is not None
            return f.read()

        def blob(digest: str) -> bytes:
            return member(f"blobs/sha256/{digest.split(':')[1]}")
        index = json.loads(member("index.json"))
        desc = next(m for m in index["manifests"]
                    if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == "python")
        manifest = json.loads(blob(desc["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
    diff_ids = config["rootfs"]["diff_ids"]
    chains = [diff_ids[0]]
    for d in diff_ids[1:]:
        chains.append("sha256:" + hashlib.sha256(f"{chains[-1]} {d}".encode()).hexdigest())
    return {"layers": [x["digest"] for x in manifest["layers"]], "config": manifest["config"]["digest"],
            "chains": chains, "diff_ids": diff_ids}


@pytest.fixture(scope="module")
def fixture_image() -> dict[str, Any]:
    return _fixture_files()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_tools()
    with running_registry(tmp_path_factory.mktemp("containerd-registry")) as reg:
        push(f"oci-archive:{fixture_archive()}:python", f"{reg.host}/fixture/python:latest")
        yield reg


def _blob_gets(registry: Any, since: int) -> list[str]:
    """Digests of the blobs the registry served after byte ``since`` of its log."""
    return [r.digest for r in registry.blob_gets(since)]


class Node:
    """One containerd host: a data dir (lazyfetch), a snapshotter, a containerd."""

    def __init__(self, base: Path, store: str, *, v2: bool) -> None:
        self.base = base
        base.mkdir()
        self.data_dir = base / "data"
        self.store = store
        self.sn = Snapshotter(base, store, self.data_dir)
        self.containerd = Containerd(base, self.sn.socket, bin_dir=CONTAINERD2 if v2 else None)

    def start(self) -> Node:
        self.sn.start()
        self.containerd.start()
        return self

    def ctr(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.containerd.ctr(*args, **kw)

    def pull(self, image: str) -> None:
        self.ctr("image", "pull", "--plain-http", "--snapshotter", "layerbox", image)

    def run(self, image: str, name: str, *cmd: str, detach: bool = False) -> str:
        args = ["run", "--snapshotter", "layerbox", *(["-d"] if detach else ["--rm"]), image, name, *cmd]
        return self.ctr(*args).stdout

    def stats(self) -> dict[str, Any]:
        return dict(HostMounts(self.data_dir).client.request("GET", "/stats"))

    def teardown(self) -> list[str]:
        problems = self.containerd.teardown()
        self.sn.stop()
        host = HostMounts(self.data_dir)
        if (self.data_dir / "state").exists():
            host.umount_all(stop_daemon=True)
        left = kmount.mounts_under(self.base)
        problems += [f"left mounted: {mp}" for mp in left]
        for mp in left:
            kmount.umount(mp, lazy=True, missing_ok=True)
        return problems


@pytest.fixture
def nodes() -> Iterator[Any]:
    made: list[Node] = []
    with short_dir("lbc-") as base:
        store = f"file://{base}/store"

        def make(name: str, *, v2: bool = True, store_url: str | None = None) -> Node:
            node = Node(base / name, store_url or store, v2=v2)
            made.append(node)
            return node

        make.store = store  # type: ignore[attr-defined]
        make.base = base  # type: ignore[attr-defined]
        try:
            yield make
        finally:
            problems = [p for n in reversed(made) for p in n.teardown()]
            assert not problems, problems


def _overlay_lowers(pid: int) -> list[str]:
    """The lower directories of the overlay that is process ``pid``'s root."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/" and " - overlay " in line:
            opts = line.split(" - overlay ", 1)[1].split()[1]
            m = re.search(r"lowerdir=([^,]*)", opts)
            assert m, opts
            return m.group(1).split(":")
    raise AssertionError(f"no overlay root in /proc/{pid}/mountinfo")


def _task_pid(node: Node, name: str) -> int:
    out = node.ctr("tasks", "ls").stdout.splitlines()
    for line in out[1:]:
        cols = line.split()
        if cols[0] == name:
            return int(cols[1])
    raise AssertionError(f"no task {name}: {out}")


def test_a_stored_image_pulls_without_layer_blobs_and_runs_lazily(
        nodes: Any, registry: Any, fixture_image: dict[str, Any]) -> None:
    require_containerd()
    require_containerd2()
    image = f"{registry.host}/fixture/python:latest"
    node = nodes("a")
    publish_sync(node.store, node.base / "publisher", f"oci-archive:{fixture_archive()}:python", "fixture/python")
    # the store's OCI index names each chain of the image, as containerd computes them
    top = resolve_sync(node.store, node.base / "publisher", chain_ref(fixture_image["chains"][-1]))
    assert [x.source["chain_id"] for x in top.layers] == fixture_image["chains"]

    node.start()
    mark = registry.log_path.stat().st_size
    node.pull(image)
    served = _blob_gets(registry, mark)
    assert fixture_image["config"] in served  # the log is read right: the config blob was served
    assert not set(served) & set(fixture_image["layers"]), f"layer blobs came from the registry: {served}"

    # the container reads the image's files right: the fixture's own test suite passes in it
    out = node.run(image, "calc", "sh", "-c", f"cat /etc/motd && {CALC_TESTS} 2>&1 | tail -1")
    assert "layerbox fixture" in out, out
    assert out.rstrip().endswith("OK"), out
    stats = node.stats()
    fetched, stored = stats["bytes_fetched_uncompressed"], sum(x.blob_size for x in top.layers)
    assert 0 < fetched < stored / 2, (fetched, stored)

    # two containers on the image share the layer mounts: the same lower directories
    node.run(image, "one", "sleep", "600", detach=True)
    node.run(image, "two", "sleep", "600", detach=True)
    lowers_one, lowers_two = _overlay_lowers(_task_pid(node, "one")), _overlay_lowers(_task_pid(node, "two"))
    assert lowers_one == lowers_two
    assert len(lowers_one) == 3
    assert all(x.startswith(str(node.data_dir / "layers")) for x in lowers_one), lowers_one

    # the snapshotter killed -9: a running container keeps reading files it never read before,
    # and once it is back new containers start
    node.sn.kill()
    read = node.ctr("tasks", "exec", "--exec-id", "r1", "one", "sh", "-c",
                    "sha256sum /usr/bin/python3.11 | cut -c1-64").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", read), read
    node.sn.start()
    node.containerd.wait_snapshotter()
    again = node.run(image, "three", "sh", "-c", "sha256sum /usr/bin/python3.11 | cut -c1-64").strip()
    assert again == read

    # ctr's snapshot commands: the three layers are committed and sized, an active one per task
    listing = node.ctr("snapshots", "--snapshotter", "layerbox", "ls").stdout
    for chain in fixture_image["chains"]:
        assert re.search(rf"^{chain}\s.*Committed", listing, re.M), listing
    usage = node.ctr("snapshots", "--snapshotter", "layerbox", "usage", fixture_image["chains"][0]).stdout
    assert re.search(r"\d+(\.\d+)? ?[KMG]i?B", usage), usage
    # an active snapshot made and removed with ctr, as on overlayfs; a committed layer with
    # children is refused
    node.ctr("snapshots", "--snapshotter", "layerbox", "prepare", "scratch", fixture_image["chains"][-1])
    assert re.search(r"^scratch\s.*Active", node.ctr("snapshots", "--snapshotter", "layerbox", "ls").stdout, re.M)
    node.ctr("snapshots", "--snapshotter", "layerbox", "rm", "scratch")
    assert "scratch" not in node.ctr("snapshots", "--snapshotter", "layerbox", "ls").stdout
    refused = node.ctr("snapshots", "--snapshotter", "layerbox", "rm", fixture_image["chains"][0], check=False)
    assert refused.returncode != 0
    info = json.loads(node.ctr("snapshots", "--snapshotter", "layerbox", "info", fixture_image["chains"][0]).stdout)
    assert info["Labels"]["containerd.io/snapshot/layerbox.layer"].startswith("blake3:"), info

    # containerd restarted: its tasks are gone but its snapshots and image stay usable
    for name in ("one", "two"):
        node.ctr("tasks", "kill", "-s", "SIGKILL", name)
        node.ctr("tasks", "rm", "-f", name, check=False)
        node.ctr("containers", "rm", name)
    node.containerd.stop()
    node.containerd.start()
    assert node.run(image, "four", "cat", "/etc/motd").strip().startswith("layerbox fixture")

    # ctr image rm + gc: containerd removes the committed snapshots, and their layers are released
    node.ctr("image", "rm", "--sync", image)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not node.ctr("snapshots", "--snapshotter", "layerbox", "ls").stdout.strip().splitlines()[1:]:
            break
        time.sleep(0.5)
    assert not node.ctr("snapshots", "--snapshotter", "layerbox", "ls").stdout.strip().splitlines()[1:]
    assert not kmount.mounts_under(node.data_dir / "layers")


def test_an_image_the_store_lacks_unpacks_then_is_published_for_the_next_host(
        nodes: Any, registry: Any, fixture_image: dict[str, Any]) -> None:
    require_containerd()
    require_containerd2()
    image = f"{registry.host}/fixture/python:latest"
    first = nodes("first", v2=False).start()  # Debian 12's containerd 1.6: ctr fetches, then unpacks
    first.pull(image)
    out = first.run(image, "calc", "sh", "-c", f"cat /etc/motd && {CALC_TESTS} 2>&1 | tail -1")
    assert out.rstrip().endswith("OK"), out
    top = chain_ref(fixture_image["chains"][-1])
    deadline = time.monotonic() + PUBLISH_TIMEOUT
    found = None
    while found is None and time.monotonic() < deadline:
        try:
            found = resolve_sync(first.store, first.base / "reader", top)
        except LookupError:
            time.sleep(0.5)
    assert found is not None, f"not published in {PUBLISH_TIMEOUT} s:\n{first.sn.log_tail()}"
    assert [x.source["chain_id"] for x in found.layers] == fixture_image["chains"]

    second = nodes("second").start()
    mark = registry.log_path.stat().st_size
    second.pull(image)
    served = _blob_gets(registry, mark)
    assert fixture_image["config"] in served
    assert not set(served) & set(fixture_image["layers"]), served
    # the published layers hold the same tree containerd unpacked: whiteouts, owners, setuid,
    # hard links, a symlink, the test suite
    check = ("stat -c '%u %a %h' /workspace/calc/calc.py /workspace/calc/calc_hardlink.py; "
             "readlink /workspace/calc/calc_symlink.py; ls /usr/share/doc | wc -l; "
             "find /workspace -perm -4000 | wc -l; sha256sum /etc/motd")
    assert second.run(image, "c2", "sh", "-c", check) == first.run(image, "c1", "sh", "-c", check)


# -- the API itself ---------------------------------------------------------------------------


@contextlib.contextmanager
def _snapshotter_api(*extra: str) -> Iterator[Any]:
    """A snapshotter process on an empty store, and a gRPC stub to it; nothing left after."""
    from snapshots.containerd.grpcapi import rpc

    with short_dir("lbs-") as base:
        sn = Snapshotter(base, f"file://{base}/store", base / "data", extra=extra)
        sn.start()
        channel = grpc.insecure_channel(f"unix://{sn.socket}")
        try:
            yield sn, rpc.SnapshotsStub(channel)
        except BaseException:
            print(sn.log_tail())
            raise
        finally:
            channel.close()
            sn.stop()
            if (base / "data" / "state").exists():
                HostMounts(base / "data").umount_all(stop_daemon=True)
            assert not kmount.mounts_under(base)


@pytest.fixture
def api() -> Iterator[Any]:
    with _snapshotter_api() as made:
        yield made


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code()  # type: ignore[no-any-return]


def test_each_rpc_keeps_containerds_rules(api: Any) -> None:
    from snapshots.containerd.grpcapi import pb

    sn, stub = api
    m = stub.Prepare(pb.PrepareSnapshotRequest(key="ns/1/base", labels={"a": "1"})).mounts
    assert [(x.type, list(x.options)) for x in m] == [("bind", ["rbind", "rw"])]
    Path(m[0].source, "hello").write_text("base layer")
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="ns/1/base"))) == grpc.StatusCode.ALREADY_EXISTS
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="ns/2/x", parent="ns/1/base"))) \
        == grpc.StatusCode.INVALID_ARGUMENT  # the parent is not committed
    stub.Commit(pb.CommitSnapshotRequest(name="ns/3/layer1", key="ns/1/base", labels={"b": "2"}))
    assert _code(lambda: stub.Stat(pb.StatSnapshotRequest(key="ns/1/base"))) == grpc.StatusCode.NOT_FOUND
    info = stub.Stat(pb.StatSnapshotRequest(key="ns/3/layer1")).info
    assert (info.kind, dict(info.labels)) == (pb.COMMITTED, {"a": "1", "b": "2"})
    assert stub.Usage(pb.UsageRequest(key="ns/3/layer1")).inodes == 1

    active = stub.Prepare(pb.PrepareSnapshotRequest(key="ns/4/rw", parent="ns/3/layer1")).mounts
    assert active[0].type == "overlay"
    opts = dict(o.split("=", 1) for o in active[0].options if "=" in o)
    assert opts["lowerdir"] == m[0].source
    view = stub.View(pb.ViewSnapshotRequest(key="ns/5/ro", parent="ns/3/layer1")).mounts
    assert [(x.type, x.source, list(x.options)) for x in view] == [("bind", m[0].source, ["rbind", "ro"])]
    assert stub.Mounts(pb.MountsRequest(key="ns/4/rw")).mounts == active
    assert _code(lambda: stub.Mounts(pb.MountsRequest(key="ns/3/layer1"))) == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(lambda: stub.Remove(pb.RemoveSnapshotRequest(key="ns/3/layer1"))) \
        == grpc.StatusCode.FAILED_PRECONDITION  # it has children

    # Update: labels only; a label path sets or removes one
    req = pb.UpdateSnapshotRequest(info=pb.Info(name="ns/3/layer1", labels={"b": "3"}))
    req.update_mask.paths.extend(["labels.b", "labels.a"])
    assert dict(stub.Update(req).info.labels) == {"b": "3"}
    bad = pb.UpdateSnapshotRequest(info=pb.Info(name="ns/3/layer1", parent="other"))
    bad.update_mask.paths.append("parent")
    assert _code(lambda: stub.Update(bad)) == grpc.StatusCode.INVALID_ARGUMENT

    # List with containerd's filters (the one its metadata store sends, and an OR of two)
    def names(*filters: str) -> set[str]:
        return {i.name for r in stub.List(pb.ListSnapshotsRequest(filters=list(filters))) for i in r.info}
    assert names() == {"ns/3/layer1", "ns/4/rw", "ns/5/ro"}
    assert names('labels."b"==3,kind==committed') == {"ns/3/layer1"}
    assert names('parent=="ns/3/layer1"') == {"ns/4/rw", "ns/5/ro"}
    assert names("kind==view", "name~=rw$") == {"ns/4/rw", "ns/5/ro"}
    assert _code(lambda: names("labels.")) == grpc.StatusCode.INVALID_ARGUMENT

    for key in ("ns/4/rw", "ns/5/ro", "ns/3/layer1"):
        stub.Remove(pb.RemoveSnapshotRequest(key=key))
    assert names() == set()
    assert sorted(os.listdir(sn.root / "snapshots")) == []


def test_keys_are_never_paths_and_requests_are_bounded(api: Any) -> None:
    from snapshots.containerd.grpcapi import pb

    sn, stub = api
    outside = sn.root.parent / "escaped"
    for key in ("../../escaped", "/etc/passwd", "ns/1/../../../escaped"):
        mounts = stub.Prepare(pb.PrepareSnapshotRequest(key=key)).mounts
        assert Path(mounts[0].source).parent.parent == sn.root / "snapshots"
    assert not outside.exists()
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key=""))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="k" * 5000))) == grpc.StatusCode.INVALID_ARGUMENT
    huge = {f"l{i}": "v" * 1000 for i in range(100)}
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="big", labels=huge))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    # a target label naming no chain of the store's index is the ordinary path, not an error
    mounts = stub.Prepare(pb.PrepareSnapshotRequest(
        key="ns/9/extract-1 sha256:" + "0" * 64, labels={"containerd.io/snapshot.ref": "sha256:" + "0" * 64}))
    assert mounts.mounts[0].type == "bind"
    # and one that is not a chain id at all is only a label
    stub.Prepare(pb.PrepareSnapshotRequest(key="odd", labels={"containerd.io/snapshot.ref": "../../x"}))
    assert oct(os.stat(sn.socket).st_mode & 0o777) == "0o600"


def _mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_the_snapshotter_changes_no_directory_it_did_not_make() -> None:
    """`--socket /tmp/x.sock` once left /tmp 0700.  A directory that exists (a shared 1777 one for the
    socket, a root someone made 0755) keeps its mode; what the snapshotter makes is its own, 0700,
    and what it keeps is private in itself (0700 directories, a 0600 database, a 0600 socket)."""
    with short_dir("lbs-") as base:
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        given = base / "given-root"
        given.mkdir()
        given.chmod(0o755)
        made_sock, made_root = base / "new" / "run" / "sn.sock", base / "made-root"
        try:
            for sock, root in ((shared / "sn.sock", given), (made_sock, made_root)):
                sn = Snapshotter(base, f"file://{base}/store", base / "data")
                sn.socket, sn.root = sock, root
                sn.start()
                try:
                    assert _mode(sn.socket) == 0o600
                    assert (_mode(root / "snapshots"), _mode(root / "metadata.db")) == (0o700, 0o600)
                finally:
                    sn.stop()
            assert (_mode(shared), _mode(given)) == (0o1777, 0o755)
            assert [_mode(d) for d in (made_sock.parent.parent, made_sock.parent, made_root)] == [0o700] * 3
        finally:
            if (base / "data" / "state").exists():
                HostMounts(base / "data").umount_all(stop_daemon=True)


def test_a_restart_removes_what_a_crash_left(api: Any) -> None:
    from snapshots.containerd.grpcapi import pb

    sn, stub = api
    stub.Prepare(pb.PrepareSnapshotRequest(key="keep"))
    sn.kill()
    # what a crash between a directory and its row leaves (the row's transaction never committed)
    orphan = sn.root / "snapshots" / "999"
    (orphan / "fs").mkdir(parents=True)
    (sn.root / "removed" / "5-dead").mkdir(parents=True)
    sn.start()
    assert not orphan.exists()
    assert not (sn.root / "removed").exists()
    assert stub.Stat(pb.StatSnapshotRequest(key="keep")).info.kind == pb.ACTIVE


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_cri_layer_digest_counts_only_when_its_diff_id_gives_the_chain(
        api: Any, fixture_image: dict[str, Any]) -> None:
    """The CRI plugin names a layer's blob digest; the same blob over another parent is another
    chain.  The snapshotter takes the store's layer only if its diff id over the parent it is
    given yields the target chain id (computed here with hashlib), never on the label's word."""
    from snapshots.containerd.grpcapi import pb

    sn, stub = api
    publish_sync(sn.store, sn.root.parent / "pub", f"oci-archive:{fixture_archive()}:python", "fixture/python")
    python_layer = fixture_image["layers"][1]
    found = resolve_sync(sn.store, sn.root.parent / "pub", chain_ref(fixture_image["chains"][1]))
    diff_id = fixture_image["diff_ids"][1]  # from the image config, read with tarfile
    # a parent that is not the fixture's base: a local layer with a chain id of its own
    other = "sha256:" + hashlib.sha256(b"another base").hexdigest()
    stub.Prepare(pb.PrepareSnapshotRequest(key=f"ns/1/extract-1 {other}", labels={
        "containerd.io/snapshot.ref": other}))
    stub.Commit(pb.CommitSnapshotRequest(name=f"ns/2/{other}", key=f"ns/1/extract-1 {other}"))
    target = "sha256:" + hashlib.sha256(f"{other} {diff_id}".encode()).hexdigest()
    labels = {"containerd.io/snapshot.ref": target, "containerd.io/snapshot/cri.layer-digest": python_layer}

    # a chain the digest does not give (the label lies about the layer): the ordinary path
    wrong = "sha256:" + hashlib.sha256(b"not this layer").hexdigest()
    mounts = stub.Prepare(pb.PrepareSnapshotRequest(key=f"ns/3/extract-2 {wrong}", parent=f"ns/2/{other}",
                                                    labels={**labels, "containerd.io/snapshot.ref": wrong})).mounts
    assert mounts[0].type == "overlay"
    # the right one: answered from the store
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(
        key=f"ns/4/extract-3 {target}", parent=f"ns/2/{other}", labels=labels))) == grpc.StatusCode.ALREADY_EXISTS
    info = stub.Stat(pb.StatSnapshotRequest(key=target)).info
    assert info.kind == pb.COMMITTED
    assert info.parent == f"ns/2/{other}"
    assert info.labels["containerd.io/snapshot/layerbox.layer"] == found.layers[-1].digest
    view = stub.View(pb.ViewSnapshotRequest(key="ns/5/view", parent=target)).mounts
    lowers = dict(o.split("=", 1) for o in view[0].options if "=" in o)["lowerdir"].split(":")
    assert Path(lowers[0], "usr/bin/python3.11").is_file()  # python's layer, lazily mounted
    for key in ("ns/5/view", target, f"ns/3/extract-2 {wrong}", f"ns/2/{other}"):
        stub.Remove(pb.RemoveSnapshotRequest(key=key))
    assert not kmount.mounts_under(sn.data_dir / "layers")


def test_from_registry_converts_the_image_cri_names_instead_of_unpacking(
        registry: Any, fixture_image: dict[str, Any]) -> None:
    """``--from-registry``: the first layer containerd's CRI plugin prepares (its labels name the
    image and the layer blob) makes the snapshotter stream the image from the registry into the
    store; every layer is then answered from the store.  A label naming an image that is not
    there, or is no image reference at all, leaves containerd's own path."""
    from snapshots.containerd.grpcapi import pb

    image = f"{registry.host}/fixture/python:latest"
    with _snapshotter_api("--from-registry") as (_, stub):
        for ref in (f"{registry.host}/fixture/absent:latest", "../../etc/passwd"):
            labels = {"containerd.io/snapshot.ref": fixture_image["chains"][0],
                      "containerd.io/snapshot/cri.image-ref": ref,
                      "containerd.io/snapshot/cri.layer-digest": fixture_image["layers"][0]}
            key = f"ns/{len(ref)}/extract-1 {fixture_image['chains'][0]}"
            assert stub.Prepare(pb.PrepareSnapshotRequest(key=key, labels=labels)).mounts[0].type == "bind"
            stub.Remove(pb.RemoveSnapshotRequest(key=key))
        mark = registry.log_path.stat().st_size
        parent = ""
        for i, (chain, layer) in enumerate(zip(fixture_image["chains"], fixture_image["layers"], strict=True)):
            labels = {"containerd.io/snapshot.ref": chain, "containerd.io/snapshot/cri.image-ref": image,
                      "containerd.io/snapshot/cri.layer-digest": layer}
            assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(
                key=f"ns/{10 + i}/extract-{i} {chain}", parent=parent, labels=labels))) \
                == grpc.StatusCode.ALREADY_EXISTS  # noqa: B023 - called at once
            parent = chain
        # each layer blob came from the registry once, into the converter
        served = _blob_gets(registry, mark)
        assert sorted(x for x in served if x in fixture_image["layers"]) == sorted(fixture_image["layers"])
        view = stub.View(pb.ViewSnapshotRequest(key="v", parent=parent)).mounts
        assert view[0].type == "overlay"
        lowers = dict(o.split("=", 1) for o in view[0].options if "=" in o)["lowerdir"].split(":")
        assert Path(lowers[0], "etc/motd").read_text().startswith("layerbox fixture")
