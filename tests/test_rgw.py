"""The RGW harness itself (tests/support/rgw.py): loopback only, real keys, leftovers reaped,
and what this RGW answers to conditional writes (the facts of shared/notes/ceph-rgw-recipe.md).

What the S3 suites do on it is in test_backend_conformance.py, test_store.py,
test_store_safety.py, test_lazyfetch.py and test_snapshots.py (the ``rgw``
parameter of their S3 tests).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from layerstore.backends.s3 import S3Backend
from tests.support import real_s3 as real_s3_support
from tests.support import rgw
from tests.support.proc import run
from tests.support.real_s3 import S3Server, require_ceph, use_server

REPO = Path(__file__).resolve().parents[1]

SLEEPER = "import time; time.sleep(600)"


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


class Daemons:
    """Stand-in daemons: sleeping processes whose command line names a cluster directory."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, directory: Path, name: str | None, *, pid_file: bool = True) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER, "-c", f"{directory}/ceph.conf"],
                                start_new_session=True)
        self.procs.append(proc)
        if pid_file and name is not None:
            (directory / "pids").mkdir(parents=True, exist_ok=True)
            record = {"pid": proc.pid, "start": _start_time(proc.pid), "argv": proc.args}
            (directory / "pids" / f"{name}.json").write_text(json.dumps(record))
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    made = Daemons()
    try:
        yield made
    finally:
        made.kill_all()


def _cluster_dir(root: Path, name: str, owner: dict | None) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    if owner is not None:
        (directory / "owner.json").write_text(json.dumps(owner))
    return directory


def _dead_owner() -> dict:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
    owner = {"kind": "pytest", "pid": proc.pid, "start": _start_time(proc.pid)}
    proc.kill()
    proc.wait()
    return owner


def _exited(proc: subprocess.Popen[bytes], timeout: float = 10) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_a_killed_runs_leftovers_are_reaped_and_live_clusters_kept(tmp_path: Path, daemons: Daemons) -> None:
    root = tmp_path / "layerbox-rgw"
    me = {"kind": "pytest", "pid": os.getpid(), "start": _start_time(os.getpid())}
    stale = _cluster_dir(root, "pytest-1-dead", _dead_owner())
    stale_mon = daemons.start(stale, "mon.a")
    stale_osd = daemons.start(stale, "osd.0", pid_file=False)  # killed before its pid file was written
    (stale / "log").mkdir()
    (stale / "log" / "osd.0.log").write_text("memstore data and logs")
    live = _cluster_dir(root, "pytest-2-live", me)
    live_mon = daemons.start(live, "mon.a")
    manual = _cluster_dir(root, rgw.MANUAL, {"kind": rgw.MANUAL, "pid": 1, "start": -1})
    manual_rgw = daemons.start(manual, "client.rgw.a")
    gone_manual = _cluster_dir(tmp_path / "other-root", rgw.MANUAL, {"kind": rgw.MANUAL})
    daemons.start(gone_manual, "mon.a").kill()  # a manual cluster whose daemons died (a reboot)
    abandoned = _cluster_dir(root, "pytest-3-half-made", None)
    os.utime(abandoned, (time.time() - 3600,) * 2)
    being_made = _cluster_dir(root, "pytest-4-being-made", None)
    unrelated = subprocess.Popen([sys.executable, "-c", SLEEPER, str(root)], start_new_session=True)
    daemons.procs.append(unrelated)

    removed = rgw.reap_stale(root)
    assert sorted(removed) == sorted([stale, abandoned])
    assert _exited(stale_mon) == -signal.SIGKILL
    assert _exited(stale_osd) == -signal.SIGKILL
    assert not stale.exists()
    assert not abandoned.exists()
    assert live.is_dir()
    assert being_made.is_dir()
    assert manual.is_dir()
    assert _exited(live_mon, 0.2) is None
    assert _exited(manual_rgw, 0.2) is None
    assert _exited(unrelated, 0.2) is None  # names the root, not a cluster directory in it

    # A manual cluster is replaced only on request; one whose daemons all died goes anyway.
    assert rgw.reap_stale(root, also=(rgw.MANUAL,)) == [manual]
    assert _exited(manual_rgw) == -signal.SIGKILL
    assert rgw.reap_stale(tmp_path / "other-root") == [gone_manual]
    assert sorted(p.name for p in root.iterdir()) == ["pytest-2-live", "pytest-4-being-made"]
    assert _exited(live_mon, 0.2) is None


def test_a_pid_file_of_a_reused_pid_kills_nothing(tmp_path: Path, daemons: Daemons) -> None:
    root = tmp_path / "layerbox-rgw"
    stale = _cluster_dir(root, "pytest-1-dead", _dead_owner())
    other = daemons.start(tmp_path / "elsewhere", None)  # someone else's process ...
    record = {"pid": other.pid, "start": _start_time(other.pid) + 1, "argv": []}  # ... now under our pid
    (stale / "pids").mkdir()
    (stale / "pids" / "mon.a.json").write_text(json.dumps(record))
    assert rgw.reap_stale(root) == [stale]
    assert _exited(other, 0.2) is None


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _bound_addresses() -> dict[str, str]:
    """inode -> local address of every listening TCP and bound UDP socket (IPv4 and IPv6)."""
    out = {}
    for table, wanted in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != wanted:
                    continue
                host, port = local.split(":")
                if len(host) == 8:
                    address = ".".join(str(b) for b in reversed(bytes.fromhex(host)))
                else:
                    address = f"[{host}]"
                out[inode] = f"{address}:{int(port, 16)}"
    return out


def _listening(pids: Iterable[int]) -> dict[int, list[str]]:
    bound = _bound_addresses()
    return {pid: sorted(bound[i] for i in _socket_inodes(pid) if i in bound) for pid in pids}


def _booted_rgw(server: S3Server) -> rgw.RgwCluster:
    if not isinstance(server, rgw.RgwCluster):
        pytest.skip("LAYERBOX_TEST_S3_ENDPOINT names the real S3: no RGW was booted")
    return server


@pytest.mark.real_s3
def test_every_daemon_listens_on_127_0_0_1_only(real_s3: S3Server) -> None:
    cluster = _booted_rgw(real_s3)
    pids = cluster.pids()
    assert sorted(pids) == ["client.rgw.a", "mgr.x", "mon.a", "osd.0"]
    listening = _listening(pids.values())
    by_name = {name: listening[pid] for name, pid in pids.items()}
    for name, addresses in by_name.items():
        assert addresses, f"{name} listens nowhere: {by_name}"
        assert all(a.startswith("127.0.0.1:") for a in addresses), by_name
    assert f"127.0.0.1:{cluster.endpoint.rsplit(':', 1)[1]}" in by_name["client.rgw.a"]
    assert str(cluster.dir).startswith(str(rgw.STATE_ROOT) + "/")


@pytest.mark.real_s3
def test_the_gateway_checks_keys(real_s3: S3Server) -> None:
    cluster = _booted_rgw(real_s3)
    bucket = cluster.new_bucket()
    good = cluster.client()
    bad = rgw.s3_client(cluster.endpoint, cluster.access_key, "not-the-secret")
    try:
        good.put_object(Bucket=bucket, Key="k", Body=b"v")
        assert good.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
        with pytest.raises(ClientError) as caught:
            bad.get_object(Bucket=bucket, Key="k")
        assert caught.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    finally:
        good.close()
        bad.close()


def test_a_daemon_that_dies_fails_the_boot_with_its_log() -> None:
    require_ceph()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = rgw.RgwCluster.create()
        try:
            started = time.monotonic()
            with pytest.raises(rgw.RgwStartError) as caught:
                cluster.boot(ports={"mon_v2": port})
            assert time.monotonic() - started < 30
        finally:
            cluster.stop()
    message = str(caught.value)
    assert "mon.a exited with status 1" in message
    assert f"{cluster.dir}/log/mon.a.log" in message
    assert f"unable to bind to v2:127.0.0.1:{port}" in message  # the daemon's own words
    assert "Address already in use" in message
    assert not cluster.dir.exists()
    assert rgw._processes_in(cluster.dir) == []


@pytest.mark.parametrize("ci", ["true", ""])
def test_without_ceph_the_rgw_tests_fail_under_ci_and_are_skipped_elsewhere(
        ci: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(real_s3_support.ENDPOINT_VAR, raising=False)
    monkeypatch.setenv("CI", ci)
    session = real_s3_support._Session(missing=lambda: ["radosgw (package radosgw)"])
    session.boot_in_background()  # nothing to boot
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match=r"radosgw \(package radosgw\) missing.*apt-get install"):
        session.server()
    assert session.shutdown() == []


def test_an_endpoint_without_keys_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match="LAYERBOX_TEST_S3_SECRET_KEY"):
        real_s3_support.ExternalS3.from_env({real_s3_support.ENDPOINT_VAR: "http://127.0.0.1:9",
                                             real_s3_support.ACCESS_KEY_VAR: "AK"})


@pytest.mark.real_s3
def test_the_suites_run_on_the_s3_the_environment_names(real_s3: S3Server) -> None:
    """LAYERBOX_TEST_S3_* (here naming this run's RGW): no boot, the keys used, buckets removed."""
    cluster = _booted_rgw(real_s3)
    client = cluster.client()
    try:
        before = {b["Name"] for b in client.list_buckets()["Buckets"]}
        clusters_before = sorted(rgw.STATE_ROOT.iterdir())
        env = {**os.environ, "CI": "true", "LAYERBOX_TEST_S3_ENDPOINT": cluster.endpoint,
               "LAYERBOX_TEST_S3_ACCESS_KEY": cluster.access_key,
               "LAYERBOX_TEST_S3_SECRET_KEY": cluster.secret_key,
               "LAYERBOX_TEST_S3_BUCKET_PREFIX": "from-env-"}
        result = run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                      "tests/test_backend_conformance.py", "-k",
                      "TestS3Backend and s3env and (test_put_if_absent or test_put_conditional)"],
                     timeout=300, cwd=REPO, env=env, check=False)
        out = result.stdout.decode()
        assert result.returncode == 0, out + result.stderr.decode()
        assert re.search(r"^3 passed, \d+ deselected", out, re.MULTILINE), out
        for name in ("test_put_if_absent", "test_put_if_absent_concurrent", "test_put_conditional"):
            assert f"PASSED tests/test_backend_conformance.py::TestS3Backend::{name}[s3env]" in out, out
        assert "[moto]" not in out  # -k picked only the s3env ones: the id says which server
        access_log = (cluster.dir / "log" / "client.rgw.a.log").read_text(errors="replace")
        # the run's buckets were made here, by this cluster's user
        assert re.search(r'layerbox-test \[[^]]+\] "PUT /from-env-[0-9a-f]{20} HTTP', access_log)
        assert {b["Name"] for b in client.list_buckets()["Buckets"]} == before  # cleaned up
        assert sorted(rgw.STATE_ROOT.iterdir()) == clusters_before  # nothing booted
    finally:
        client.close()


@pytest.mark.real_s3
@pytest.mark.asyncio
async def test_the_probe_finds_what_the_recipe_says_rgw_16_does(
        real_s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cluster = _booted_rgw(real_s3)
    use_server(monkeypatch, tmp_path, cluster)
    backend = S3Backend(cluster.new_bucket(), "check", endpoint_url=cluster.endpoint)
    async with backend:
        support = await backend.probe_conditional_writes()
        assert [info.key async for info in backend.list("")] == []  # the probe leaves nothing
    assert support.if_none_match
    assert not support.if_match_quoted  # 412 for the ETag exactly as RGW returned it
    assert support.if_match_bare
    assert support.stale_quoted_refused
    assert support.stale_bare_refused
    assert support.missing_if_match == "412"  # moto: 404
    assert not support.multipart_if_none_match  # CompleteMultipartUpload overwrites
    assert not support.multipart_etag  # and answers ETag ''
    assert support.spelling == "bare"
