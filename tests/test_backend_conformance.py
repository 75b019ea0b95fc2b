"""The Backend contract (layerstore/backend.py), checked against every backend.

One suite, :class:`BackendContract`, runs against ``PosixBackend`` on a temp
directory, ``S3Backend`` on a real moto server and on a real S3 (a Ceph RGW
booted for the session, or ``LAYERBOX_TEST_S3_ENDPOINT``: tests/README.md),
and both as ``open_backend`` builds them (retry and limit wrappers; the S3 one
finds its endpoint through ``AWS_ENDPOINT_URL_S3``).  Hypothesis state
machines compare POSIX and S3 (both servers) with an in-memory dict.  Then
the faults: S3 errors, stalls and resets from a real proxy in front of moto,
refused credentials from moto itself, a missing bucket (both servers), a full
filesystem (a 1 MiB tmpfs), a writer killed mid-put, a store this user may not
write; and the wrappers' own behaviour, where ``FaultyBackend`` injects what no
real service produces on cue.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import multiprocessing
import os
import signal
import stat
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from layerstore.backend import (
    Backend,
    BackendError,
    CredentialsError,
    InvalidKey,
    ObjectNotFound,
    PreconditionFailed,
    TransientError,
)
from layerstore.backends import InvalidStoreURL, open_backend
from layerstore.backends.posix import PermissionDenied, PosixBackend, StoreFull
from layerstore.backends.s3 import NoSuchBucket, S3Backend
from layerstore.backends.wrappers import (
    FaultyBackend,
    LimitedBackend,
    RetriesExhausted,
    RetryingBackend,
)
from tests.support import moto as moto_support
from tests.support import s3proxy
from tests.support.env import require
from tests.support.moto import MotoServer, free_port
from tests.support.proc import run
from tests.support.real_s3 import REAL_S3, S3Server, use_s3_account
from tests.support.s3proxy import Fault, FaultProxy

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
BIG = 80 * MiB  # above S3Backend's 64 MiB multipart threshold: 5 parts of 16 MiB

# Fixtures from tests/support (names bound here so that pytest finds them).
moto_server = moto_support.moto_fixture("session")
aws_test_env = moto_support.aws_test_env
fault_proxy = s3proxy.fault_proxy

MOTO_RACE = ("moto checks If-None-Match/If-Match and then writes without a lock "
             "(moto/s3/responses.py put_object), so concurrent conditional writes can both win")


@pytest.fixture(scope="module")
def big_data() -> bytes:
    return os.urandom(BIG)


@pytest.fixture(params=["moto", REAL_S3])
def s3_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """Each S3 test on moto and on the real S3, with that server's keys in the environment."""
    server: S3Server = request.getfixturevalue("moto_server" if request.param == "moto" else "real_s3")
    # no endpoint in the environment: each test gives it, or sets AWS_ENDPOINT_URL_S3 to test that
    use_s3_account(monkeypatch, tmp_path, server.access_key, server.secret_key, server.region)
    return server


@pytest.fixture
def atomic_conditional_writes() -> bool:
    """Does the server make conditional writes atomic under concurrency?  (S3 classes override.)"""
    return True


async def _keys(backend: Backend, prefix: str = "") -> list[str]:
    return [info.key async for info in backend.list(prefix)]


async def _increment(backend: Backend, key: str) -> int:
    """Add one to the counter at ``key`` by compare-and-swap; returns the conflicts seen."""
    conflicts = 0
    while True:
        info = await backend.head(key)  # the etag first, then the data (see the contract)
        assert info is not None
        value = int(await backend.get(key))
        try:
            await backend.put_conditional(key, str(value + 1).encode(), info.etag)
            return conflicts
        except PreconditionFailed:
            conflicts += 1


# ---------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------
class BackendContract:
    """What every Backend promises; subclasses provide a fresh, empty ``backend``."""

    pytestmark = pytest.mark.asyncio

    def _needs_atomic_server(self, request: pytest.FixtureRequest) -> None:
        if not request.getfixturevalue("atomic_conditional_writes"):  # moto's are not
            request.applymarker(pytest.mark.xfail(reason=MOTO_RACE, strict=False))

    async def test_get_whole_and_ranges(self, backend: Backend) -> None:
        data = bytes(range(256)) * 40
        await backend.put("obj/a", data)
        assert await backend.get("obj/a") == data
        for start, end in [(0, None), (None, 10), (5, 17), (100, None), (10230, 20000),
                           (len(data), None), (20000, None), (20000, 30000), (7, 7), (9, 3),
                           (0, 0), (0, len(data)), (len(data) - 1, None)]:
            assert await backend.get("obj/a", start, end) == data[start:end], (start, end)
        with pytest.raises(ValueError, match="negative"):
            await backend.get("obj/a", -1)

    async def test_empty_object(self, backend: Backend) -> None:
        await backend.put("empty", b"")
        assert await backend.get("empty") == b""
        assert await backend.get("empty", 0, 10) == b""
        info = await backend.head("empty")
        assert info is not None
        assert info.size == 0

    async def test_missing_key(self, backend: Backend) -> None:
        for start, end in [(None, None), (0, 10), (5, 5), (100, None)]:
            with pytest.raises(ObjectNotFound) as caught:
                await backend.get("no/such/key", start, end)
            assert "no/such/key" in str(caught.value)
            assert backend.url in str(caught.value)
            assert isinstance(caught.value, FileNotFoundError)
        assert await backend.head("no/such/key") is None

    async def test_put_overwrites_atomically(self, backend: Backend) -> None:
        versions = [bytes([65 + i]) * (2 * MiB + i) for i in range(3)]
        await backend.put("atomic", versions[0])
        torn: list[int] = []

        async def write() -> None:
            for i in range(12):
                await backend.put("atomic", versions[i % 3])

        async def read() -> None:
            for _ in range(12):
                try:
                    data = await backend.get("atomic")
                except TransientError:
                    # the contract allows a retryable failure (moto answers 500 now and
                    # then while it replaces an object); it forbids only partial data
                    continue
                if data not in versions:
                    torn.append(len(data))

        await asyncio.gather(write(), read(), read())
        assert torn == []

    async def test_put_if_absent(self, backend: Backend) -> None:
        assert await backend.put_if_absent("cas/x", b"first") is True
        assert await backend.put_if_absent("cas/x", b"second") is False
        assert await backend.get("cas/x") == b"first"

    async def test_put_if_absent_concurrent(self, backend: Backend, request: pytest.FixtureRequest) -> None:
        self._needs_atomic_server(request)
        for round_ in range(3):
            key = f"race/{round_}"
            results = await asyncio.gather(*(backend.put_if_absent(key, b"writer %d" % i)
                                              for i in range(20)))
            assert results.count(True) == 1, results
            assert await backend.get(key) == b"writer %d" % results.index(True)

    async def test_put_conditional(self, backend: Backend) -> None:
        first = await backend.put_conditional("ref", b"v1", None)
        with pytest.raises(PreconditionFailed, match="ref"):
            await backend.put_conditional("ref", b"v1 again", None)
        info = await backend.head("ref")
        assert info is not None
        assert info.etag == first
        second = await backend.put_conditional("ref", b"v2", first)
        assert second != first
        info = await backend.head("ref")
        assert info is not None
        assert info.etag == second
        with pytest.raises(PreconditionFailed):
            await backend.put_conditional("ref", b"stale", first)
        with pytest.raises(PreconditionFailed):
            await backend.put_conditional("no-ref", b"x", first)  # a missing object never matches
        assert await backend.get("ref") == b"v2"
        assert await backend.head("no-ref") is None

    async def test_concurrent_cas_counter(self, backend: Backend, request: pytest.FixtureRequest) -> None:
        self._needs_atomic_server(request)
        await backend.put_conditional("counter", b"0", None)
        conflicts = await asyncio.gather(*(_increment(backend, "counter") for _ in range(20)))
        assert await backend.get("counter") == b"20"
        assert sum(conflicts) > 0  # they did race

    async def test_list_order_and_prefixes(self, backend: Backend) -> None:
        keys = ["a-b", "a/x", "a/y/z", "a0", "ab", "b", "a.c", "a=1", "A", "a/y-", "a:t", "a@v"]
        for i, key in enumerate(keys):
            await backend.put(key, b"x" * i)
        assert await _keys(backend) == sorted(keys)
        assert await _keys(backend, "a") == sorted(k for k in keys if k.startswith("a"))
        assert await _keys(backend, "a/") == ["a/x", "a/y-", "a/y/z"]
        assert await _keys(backend, "a/y") == ["a/y-", "a/y/z"]
        assert await _keys(backend, "a/y/") == ["a/y/z"]
        assert await _keys(backend, "zzz") == []
        assert await _keys(backend, "no/such/dir/") == []
        async for info in backend.list():
            assert info.size == keys.index(info.key)
            assert info == await backend.head(info.key)
        with pytest.raises(InvalidKey):
            await _keys(backend, "a//")

    async def test_delete(self, backend: Backend) -> None:
        await backend.put("d/1", b"x")
        await backend.put("d/2", b"y")
        await backend.delete("d/1")
        assert await backend.head("d/1") is None
        with pytest.raises(ObjectNotFound):
            await backend.get("d/1")
        await backend.delete("d/1")  # idempotent
        await backend.delete("never/was")
        assert await _keys(backend) == ["d/2"]
        assert await backend.put_if_absent("d/1", b"again") is True

    async def test_invalid_keys_refused(self, backend: Backend) -> None:
        bad = ["", "/a", "a/", "a//b", "../x", "a/../b", ".hidden", "a/.tmp-0123456789abcdef",
               "a b", "é", "a\x00b", "x" * 1001, "a\\b"]
        for key in bad:
            with pytest.raises(InvalidKey):
                await backend.put(key, b"x")
            with pytest.raises(InvalidKey):
                await backend.put_if_absent(key, b"x")
            with pytest.raises(InvalidKey):
                await backend.put_conditional(key, b"x", None)
            with pytest.raises(InvalidKey):
                await backend.get(key)
            with pytest.raises(InvalidKey):
                await backend.head(key)
            with pytest.raises(InvalidKey):
                await backend.delete(key)
        assert await _keys(backend) == []

    async def test_large_object(self, backend: Backend, big_data: bytes) -> None:
        await backend.put("big/object", big_data)
        info = await backend.head("big/object")
        assert info is not None
        assert info.size == BIG
        assert await backend.get("big/object") == big_data
        boundary = 16 * MiB  # an S3 part boundary
        assert await backend.get("big/object", boundary - 5, boundary + 5) == big_data[boundary - 5:boundary + 5]
        assert await backend.get("big/object", BIG - 3, BIG + 100) == big_data[-3:]
        assert await backend.put_if_absent("big/object", big_data) is False
        assert await backend.put_if_absent("big/other", big_data) is True
        assert await backend.get("big/other", 0, 10) == big_data[:10]

    async def test_etag_changes_on_overwrite(self, backend: Backend) -> None:
        await backend.put("e", b"one")
        one = await backend.head("e")
        await backend.put("e", b"two")
        two = await backend.head("e")
        assert one is not None
        assert two is not None
        assert one.etag != two.etag
        listed = [info async for info in backend.list("e")]
        assert listed == [two]
        assert abs(two.mtime - time.time()) < 300


# ---------------------------------------------------------------------------------------
# The implementations under the contract
# ---------------------------------------------------------------------------------------
def _cas_worker(url: str, key: str, increments: int) -> int:
    """One process of the multi-process compare-and-swap test (spawned: no shared state)."""

    async def main() -> int:
        async with open_backend(url) as backend:
            results = await asyncio.gather(*(_increment(backend, key) for _ in range(increments)))
            return sum(results)

    return asyncio.run(main())


class PosixExtras:
    """What only a POSIX store has to show: processes, layout, hidden files."""

    pytestmark = pytest.mark.asyncio

    async def test_cas_counter_across_processes(self, backend: Backend, store_root: Path) -> None:
        await backend.put_conditional("procs/counter", b"0", None)
        context = multiprocessing.get_context("spawn")  # fork would copy the event loop's threads
        with ProcessPoolExecutor(4, mp_context=context) as pool:
            loop = asyncio.get_running_loop()
            conflicts = await asyncio.gather(*(
                loop.run_in_executor(pool, _cas_worker, f"file://{store_root}", "procs/counter", 5)
                for _ in range(4)))
        assert await backend.get("procs/counter") == b"20"
        assert sum(conflicts) > 0  # each process's five tasks at least raced each other

    async def test_layout_and_hidden_files(self, backend: Backend, store_root: Path) -> None:
        assert _all_names(store_root.parent) == []  # the store is created on first write
        old = os.umask(0o077)
        try:
            await backend.put("docs/ab/abcdef", b"doc")
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(store_root).st_mode) == 0o755
        assert _read(store_root / "docs" / "ab" / "abcdef") == b"doc"
        etag = await backend.put_conditional("refs/r:latest", b"1", None)
        await backend.put_conditional("refs/r:latest", b"2", etag)
        await backend.put_if_absent("docs/ab/abcdef", b"doc")
        hidden = [name for name in _all_names(store_root) if "/." in "/" + name]
        assert hidden == ["refs/.r:latest.lock"]  # no temp files left, one lock file per swapped key
        assert await _keys(backend) == ["docs/ab/abcdef", "refs/r:latest"]

    async def test_key_and_subkey_conflict(self, backend: Backend) -> None:
        await backend.put("a", b"file")
        with pytest.raises(InvalidKey, match="a/b"):
            await backend.put("a/b", b"x")
        await backend.put("c/d", b"x")
        for write in (backend.put("c", b"x"), backend.put_if_absent("c", b"x"),
                      backend.put_conditional("c", b"x", None)):
            with pytest.raises(InvalidKey, match="cannot hold both"):
                await write
        assert await backend.head("c") is None
        with pytest.raises(ObjectNotFound):
            await backend.get("c")
        await backend.delete("c")  # a directory is no object: nothing to delete
        assert await backend.head("a/b") is None
        assert await _keys(backend) == ["a", "c/d"]

    async def test_etag_of_a_file_written_by_other_tools(self, backend: Backend, store_root: Path) -> None:
        await backend.put("seed", b"")
        _write(store_root / "copied", b"from rsync")  # no etag xattr
        info = await backend.head("copied")
        assert info is not None
        assert info.etag == blake3.blake3(b"from rsync").hexdigest()
        new = await backend.put_conditional("copied", b"swapped", info.etag)
        assert new == blake3.blake3(b"swapped").hexdigest()

    async def test_put_if_absent_without_hard_links(self, backend: Backend,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        # Some FUSE filesystems refuse link(2); renameat2(RENAME_NOREPLACE) takes over.
        def no_links(src: Any, dst: Any) -> None:
            raise OSError(errno.EPERM, "Operation not permitted", str(dst))

        monkeypatch.setattr(os, "link", no_links)
        assert await backend.put_if_absent("nolink/x", b"1") is True
        assert await backend.put_if_absent("nolink/x", b"2") is False
        assert await backend.get("nolink/x") == b"1"
        assert await backend.put_conditional("nolink/y", b"3", None)


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "store"


class TestPosixBackend(BackendContract, PosixExtras):
    @pytest_asyncio.fixture
    async def backend(self, store_root: Path) -> AsyncIterator[Backend]:
        async with PosixBackend(store_root) as backend:
            yield backend


class TestPosixStack(BackendContract, PosixExtras):
    @pytest_asyncio.fixture
    async def backend(self, store_root: Path) -> AsyncIterator[Backend]:
        async with open_backend(f"file://{store_root}", max_concurrency=4) as backend:
            assert isinstance(backend, RetryingBackend)
            yield backend


class S3Extras:
    pytestmark = pytest.mark.asyncio

    async def test_key_and_subkey_coexist(self, backend: Backend) -> None:
        await backend.put("a", b"1")
        await backend.put("a/b", b"2")
        assert await _keys(backend) == ["a", "a/b"]

    async def test_large_objects_are_multipart(self, backend: Backend, big_data: bytes) -> None:
        await backend.put("mp", big_data)
        info = await backend.head("mp")
        assert info is not None
        assert info.etag.endswith('-5"')


class S3Servers:
    """Runs the class on moto and on the real S3 (``s3_server``'s parameters)."""

    @pytest.fixture
    def atomic_conditional_writes(self, s3_server: S3Server) -> bool:
        return s3_server.atomic_conditional_writes


class TestS3Backend(S3Servers, BackendContract, S3Extras):
    @pytest_asyncio.fixture
    async def backend(self, s3_server: S3Server) -> AsyncIterator[Backend]:
        bucket = s3_server.new_bucket()
        async with S3Backend(bucket, "pre/fix", endpoint_url=s3_server.endpoint) as backend:
            yield backend


class TestS3Stack(S3Servers, BackendContract, S3Extras):
    @pytest_asyncio.fixture
    async def backend(self, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Backend]:
        bucket = s3_server.new_bucket()
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)  # botocore reads it
        async with open_backend(f"s3://{bucket}/stack") as backend:
            yield backend


# ---------------------------------------------------------------------------------------
# State machines against a dict
# ---------------------------------------------------------------------------------------
KEYS = ["a/x", "a/y", "a-b", "ab", "b/c/d", "b/e", "c"]
PREFIXES = ["", "a", "a/", "b/", "b/c", "c", "z"]


def _machine(open_fresh: Callable[[], Backend]) -> type[RuleBasedStateMachine]:
    class BackendMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.backend = open_fresh()
            self.model: dict[str, bytes] = {}
            self.etags: dict[str, str] = {}
            self.old_etags: list[str] = ["not-an-etag"]
            self.writes = 0

        def run(self, coro: Any) -> Any:
            return self.loop.run_until_complete(coro)

        def unique(self, data: bytes) -> bytes:
            self.writes += 1  # every write has new content, so old etags never match again
            return data + b"#%d" % self.writes

        def written(self, key: str, data: bytes) -> None:
            self.model[key] = data
            info = self.run(self.backend.head(key))
            if key in self.etags:
                self.old_etags.append(self.etags[key])
            self.etags[key] = info.etag

        @rule(key=st.sampled_from(KEYS), data=st.binary(max_size=200))
        def put(self, key: str, data: bytes) -> None:
            data = self.unique(data)
            self.run(self.backend.put(key, data))
            self.written(key, data)

        @rule(key=st.sampled_from(KEYS), data=st.binary(max_size=200))
        def put_if_absent(self, key: str, data: bytes) -> None:
            data = self.unique(data)
            wrote = self.run(self.backend.put_if_absent(key, data))
            assert wrote == (key not in self.model)
            if wrote:
                self.written(key, data)

        @rule(key=st.sampled_from(KEYS), data=st.binary(max_size=200),
              which=st.sampled_from(["current", "absent", "stale"]), pick=st.integers(0, 1000))
        def put_conditional(self, key: str, data: bytes, which: str, pick: int) -> None:
            data = self.unique(data)
            if which == "current":
                if_match = self.etags.get(key)
                succeeds = True
            elif which == "absent":
                if_match, succeeds = None, key not in self.model
            else:
                if_match, succeeds = self.old_etags[pick % len(self.old_etags)], False
            try:
                etag = self.run(self.backend.put_conditional(key, data, if_match))
            except PreconditionFailed:
                assert not succeeds
                return
            assert succeeds
            self.written(key, data)
            assert etag == self.etags[key]

        @rule(key=st.sampled_from(KEYS), start=st.none() | st.integers(0, 250),
              end=st.none() | st.integers(0, 250))
        def get(self, key: str, start: int | None, end: int | None) -> None:
            if key not in self.model:
                try:
                    self.run(self.backend.get(key, start, end))
                except ObjectNotFound:
                    return
                raise AssertionError(f"get {key!r} of a missing key returned")
            assert self.run(self.backend.get(key, start, end)) == self.model[key][start:end]

        @rule(key=st.sampled_from(KEYS))
        def head(self, key: str) -> None:
            info = self.run(self.backend.head(key))
            if key not in self.model:
                assert info is None
            else:
                assert (info.size, info.etag) == (len(self.model[key]), self.etags[key])

        @rule(key=st.sampled_from(KEYS))
        def delete(self, key: str) -> None:
            self.run(self.backend.delete(key))
            self.model.pop(key, None)
            if key in self.etags:
                self.old_etags.append(self.etags.pop(key))

        @rule(prefix=st.sampled_from(PREFIXES))
        def list(self, prefix: str) -> None:
            listed = self.run(_collect(self.backend, prefix))
            assert [(i.key, i.size, i.etag) for i in listed] == [
                (k, len(self.model[k]), self.etags[k]) for k in sorted(self.model) if k.startswith(prefix)]

        def teardown(self) -> None:
            self.run(self.backend.close())
            self.loop.close()

    return BackendMachine


async def _collect(backend: Backend, prefix: str) -> list[Any]:
    return [info async for info in backend.list(prefix)]


def test_posix_state_machine(tmp_path: Path) -> None:
    def fresh() -> Backend:
        return PosixBackend(tempfile.mkdtemp(dir=tmp_path))

    run_state_machine_as_test(_machine(fresh), settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_s3_state_machine(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()

    def fresh() -> Backend:
        return S3Backend(bucket, uuid.uuid4().hex, endpoint_url=s3_server.endpoint)

    run_state_machine_as_test(_machine(fresh), settings=settings(
        max_examples=8, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# ---------------------------------------------------------------------------------------
# open_backend
# ---------------------------------------------------------------------------------------
def _layers(backend: Backend) -> list[Backend]:
    out = [backend]
    while isinstance(out[-1], (RetryingBackend, LimitedBackend)):
        out.append(out[-1].inner)
    return out


def test_open_backend_parses_urls_and_stacks_wrappers(tmp_path: Path) -> None:
    for url in (f"file://{tmp_path}/s", f"{tmp_path}/s", f"file://localhost{tmp_path}/s",
                f"file://{tmp_path}/x/../s/"):
        layers = _layers(open_backend(url, max_concurrency=3, retries=2))
        assert [type(b) for b in layers] == [RetryingBackend, LimitedBackend, PosixBackend], url
        assert layers[-1].url == f"file://{tmp_path}/s"
        retrying, limited = layers[0], layers[1]
        assert isinstance(retrying, RetryingBackend)
        assert isinstance(limited, LimitedBackend)
        assert retrying.attempts == 3
        assert limited.max_concurrency == 3
    assert [type(b) for b in _layers(open_backend(str(tmp_path), retries=0))] == [LimitedBackend, PosixBackend]

    s3 = _layers(open_backend("s3://my-bucket/some/prefix/", s3_endpoint="http://127.0.0.1:1"))
    assert isinstance(s3[-1], S3Backend)
    assert (s3[-1].bucket, s3[-1].prefix, s3[0].url) == ("my-bucket", "some/prefix", "s3://my-bucket/some/prefix")
    assert open_backend("s3://my-bucket").url == "s3://my-bucket"
    assert s3[-1]._client is None  # nothing connects before the first call

    for bad in ("store", "http://example.com/x", "gs://bucket/x", "file:relative", "file://otherhost/x",
                "s3://Bad_Bucket/x", "s3://", "s3://bucket/a//b"):
        with pytest.raises(InvalidStoreURL) as caught:
            open_backend(bad)
        assert isinstance(caught.value, ValueError)
    with pytest.raises(InvalidStoreURL, match=r"file:///.*s3://bucket"):
        open_backend("ftp://host/x")
    with pytest.raises(InvalidStoreURL, match="credentials") as caught:
        open_backend("s3://AKIAXXX:topsecret@bucket/x")
    assert "topsecret" not in str(caught.value)


@pytest.mark.asyncio
async def test_global_aws_endpoint_url_is_honoured(moto_server: MotoServer, aws_test_env: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = moto_server.new_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    async with open_backend(f"s3://{bucket}/env") as backend:
        await backend.put("k", b"v")
        assert await backend.get("k") == b"v"


# ---------------------------------------------------------------------------------------
# S3 faults, from a real proxy and a real server
# ---------------------------------------------------------------------------------------
@pytest_asyncio.fixture
async def proxied(fault_proxy: FaultProxy, moto_server: MotoServer, aws_test_env: None
                  ) -> AsyncIterator[Backend]:
    """open_backend's S3 stack talking to moto through the fault proxy (3 retries, 1 s timeouts)."""
    bucket = moto_server.new_bucket()
    async with open_backend(f"s3://{bucket}/faults", s3_endpoint=fault_proxy.url, retries=3,
                            read_timeout=1.0, connect_timeout=1.0) as backend:
        yield backend


def _kinds(proxy: FaultProxy, method: str) -> list[str | None]:
    return [kind for _, _, kind in proxy.requests(method)]


@pytest.mark.asyncio
async def test_s3_slowdown_is_retried(proxied: Backend, fault_proxy: FaultProxy,
                                      caplog: pytest.LogCaptureFixture) -> None:
    fault_proxy.inject(Fault.error(503, "SlowDown"), 2, method="PUT")
    await proxied.put("slow/key", b"data")
    assert _kinds(fault_proxy, "PUT") == ["error", "error", None]
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2
    assert "put 'slow/key' failed (attempt 1 of 4)" in retries[0]
    assert "SlowDown" in retries[0]
    assert "attempt 2 of 4" in retries[1]
    fault_proxy.inject(Fault.error(500, "InternalError"), 1, method="GET")
    assert await proxied.get("slow/key") == b"data"
    assert _kinds(fault_proxy, "GET") == ["error", None]


@pytest.mark.asyncio
async def test_s3_persistent_errors_give_up_with_a_clear_error(proxied: Backend, fault_proxy: FaultProxy) -> None:
    await proxied.put("doomed", b"x")
    fault_proxy.inject(Fault.error(500, "InternalError"), 4, method="GET")
    with pytest.raises(TransientError) as caught:
        await proxied.get("doomed")
    error = caught.value
    assert isinstance(error, RetriesExhausted)
    assert error.attempts == 4
    message = str(error)
    assert "after 4 attempts" in message
    assert "'doomed'" in message
    assert "InternalError" in message
    assert proxied.url in message
    assert "testing" not in message
    assert _kinds(fault_proxy, "GET") == ["error"] * 4


@pytest.mark.asyncio
async def test_s3_stall_is_cut_by_the_read_timeout(proxied: Backend, fault_proxy: FaultProxy) -> None:
    await proxied.put("stall", b"patience")
    fault_proxy.inject(Fault.stall(60), 1, method="GET")
    started = time.monotonic()
    assert await proxied.get("stall") == b"patience"
    assert 0.9 < time.monotonic() - started < 10
    assert _kinds(fault_proxy, "GET") == ["stall", None]


@pytest.mark.asyncio
async def test_s3_connection_resets_are_retried(proxied: Backend, fault_proxy: FaultProxy) -> None:
    data = os.urandom(MiB)
    await proxied.put("reset", data)
    fault_proxy.inject(Fault.reset(), 1, method="GET")  # half the body, then RST
    assert await proxied.get("reset") == data
    assert _kinds(fault_proxy, "GET") == ["reset", None]
    fault_proxy.inject(Fault.reset(), 1, method="PUT")
    await proxied.put("reset2", data)
    assert await proxied.get("reset2") == data
    # The reset PUT reached the server: the retry finds the object there.  The contract
    # allows put_if_absent to report False for its own write in that case.
    fault_proxy.inject(Fault.reset(), 1, method="PUT")
    assert await proxied.put_if_absent("reset3", b"mine") is False
    assert await proxied.get("reset3") == b"mine"
    # And a retried compare-and-swap says that the change may be its own.
    fault_proxy.inject(Fault.reset(), 1, method="PUT")
    with pytest.raises(PreconditionFailed, match="may be its own write"):
        await proxied.put_conditional("reset4", b"mine", None)
    assert await proxied.get("reset4") == b"mine"


@pytest.mark.asyncio
async def test_s3_a_5xx_to_a_conditional_write_is_retried_or_a_conflict_by_what_the_object_holds(
        proxied: Backend, fault_proxy: FaultProxy) -> None:
    etag = await proxied.put_conditional("cas", b"v1", None)
    # refused before the server saw it: the object still has our ETag, so it is an error, retried
    fault_proxy.inject(Fault.error(500, "InternalError"), 1, method="PUT")
    etag = await proxied.put_conditional("cas", b"v2", etag)
    assert await proxied.get("cas") == b"v2"
    assert _kinds(fault_proxy, "PUT")[-2:] == ["error", None]
    # the write landed and then the answer was a 500 (RGW answers some race losers so): the object
    # changed, so it is a conflict, never retried blindly; the caller re-reads
    fault_proxy.inject(Fault.error_after(500, "InternalError"), 1, method="PUT")
    with pytest.raises(PreconditionFailed, match="changed since"):
        await proxied.put_conditional("cas", b"v3", etag)
    assert await proxied.get("cas") == b"v3"
    assert _kinds(fault_proxy, "PUT")[-1] == "error_after"  # one attempt: a conflict is not retried
    # a real conflict stays a conflict
    with pytest.raises(PreconditionFailed):
        await proxied.put_conditional("cas", b"v4", etag)
    assert await proxied.get("cas") == b"v3"


@pytest.mark.asyncio
async def test_a_ref_moved_under_a_5xx_lands_once(fault_proxy: FaultProxy, moto_server: MotoServer,
                                                  aws_test_env: None, tmp_path: Path) -> None:
    from layerstore.store import Store

    bucket = moto_server.new_bucket()
    url = f"s3://{bucket}/refs-5xx"
    digests = ["blake3:" + blake3.blake3(str(i).encode()).hexdigest() for i in range(3)]
    async with await Store.open(url, tmp_path / "data", s3_endpoint=fault_proxy.url) as store:
        await store.set_ref("t/py:v1", digests[0], "image")
        fault_proxy.inject(Fault.error_after(500, "InternalError"), 1, method="PUT")
        moved = await store.set_ref("t/py:v1", digests[1], "image")
        assert moved.digest == digests[1]
        state = await store.read_ref("t/py:v1")
        # our own write, recognised: the old value is in the history once, ours not at all
        assert [h["digest"] for h in state.history] == [digests[0]]
        await store.set_ref("t/py:v1", digests[2], "image")
        assert [h["digest"] for h in (await store.read_ref("t/py:v1")).history] == digests[1::-1]


@pytest.mark.asyncio
async def test_store_check_reports_what_moto_does(moto_server: MotoServer, aws_test_env: None) -> None:
    bucket = moto_server.new_bucket()
    async with S3Backend(bucket, "check", endpoint_url=moto_server.endpoint) as backend:
        support = await backend.probe_conditional_writes()
        assert support.if_none_match
        assert support.if_match_quoted
        assert support.stale_quoted_refused
        assert support.stale_bare_refused
        assert support.missing_if_match == "404"
        assert support.multipart_if_none_match
        assert support.spelling == "quoted"
        assert [info.key async for info in backend.list("")] == []  # the probe leaves nothing


@pytest.fixture(scope="module")
def moto_with_auth() -> Iterator[MotoServer]:
    """A second moto server that checks credentials (it knows no access keys at all)."""
    server = MotoServer({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_s3_refused_credentials_are_not_retried(moto_with_auth: MotoServer, aws_test_env: None) -> None:
    proxy = FaultProxy(moto_with_auth.endpoint).start()  # only to count the attempts
    try:
        async with open_backend("s3://any-bucket/p", s3_endpoint=proxy.url, retries=3) as backend:
            with pytest.raises(CredentialsError) as caught:
                await backend.get("k")
        message = str(caught.value)
        assert "InvalidAccessKeyId" in message
        assert "AWS_ACCESS_KEY_ID" in message
        assert "s3://any-bucket/p" in message
        assert "'k'" in message
        assert len(proxy.requests()) == 1
    finally:
        proxy.stop()


@pytest.mark.asyncio
async def test_s3_missing_credentials(moto_server: MotoServer, aws_test_env: None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    async with open_backend("s3://some-bucket/p", s3_endpoint=moto_server.endpoint) as backend:
        with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID"):
            await backend.head("k")


@pytest.mark.asyncio
async def test_s3_missing_bucket_is_named(s3_server: S3Server) -> None:
    async with open_backend("s3://no-such-bucket-here/p", s3_endpoint=s3_server.endpoint) as backend:
        started = time.monotonic()
        for call in (backend.get("k"), backend.head("k"), backend.put("k", b"x"), _keys(backend)):
            with pytest.raises(NoSuchBucket, match=r"bucket 'no-such-bucket-here' does not exist.*aws s3 mb"):
                await call
        assert time.monotonic() - started < 5  # not retried


@pytest.mark.asyncio
async def test_s3_unreachable_endpoint(aws_test_env: None) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    async with open_backend("s3://bucket/p", s3_endpoint=endpoint, retries=2) as backend:
        with pytest.raises(TransientError, match=r"could not connect to http://127.0.0.1:\d+.*after 3 attempts"):
            await backend.get("k")


# ---------------------------------------------------------------------------------------
# POSIX faults: a full filesystem, a killed writer, a store we may not write
# ---------------------------------------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted at teardown however the test ends."""
    require("root")
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mountpoint)], timeout=30)
    try:
        yield mountpoint
    finally:
        result = run(["umount", str(mountpoint)], timeout=30, check=False)
        if result.returncode != 0:
            run(["umount", "-l", str(mountpoint)], timeout=30)


def _all_names(root: Path) -> list[str]:
    """Every path under ``root``, hidden ones included, relative and sorted."""
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _temp_files(directory: Path) -> list[tuple[str, int]]:
    try:
        return [(n, os.stat(directory / n).st_size) for n in os.listdir(directory) if n.startswith(".tmp-")]
    except FileNotFoundError:
        return []


@pytest.mark.asyncio
async def test_posix_full_disk(tiny_fs: Path) -> None:
    async with open_backend(f"file://{tiny_fs}/store", retries=2) as backend:
        small = os.urandom(64 * 1024)
        await backend.put("keep/small", small)
        before = _all_names(tiny_fs)
        for write in (backend.put("big/one", os.urandom(2 * MiB)),
                      backend.put_if_absent("big/two", os.urandom(2 * MiB)),
                      backend.put_conditional("big/three", os.urandom(2 * MiB), None)):
            with pytest.raises(StoreFull) as caught:
                await write
            message = str(caught.value)
            assert "no space left" in message
            assert "big/" in message
            assert str(tiny_fs) in message
            assert not isinstance(caught.value, TransientError)
        assert [n for n in _all_names(tiny_fs) if ".tmp-" in n] == []
        assert [n for n in _all_names(tiny_fs) if n not in before] in ([], ["store/big"])
        assert await backend.get("keep/small") == small
        assert await _keys(backend) == ["keep/small"]
        await backend.put("keep/after", b"still works")  # space is back: nothing leaked


TORN_WRITER = textwrap.dedent("""
    import asyncio, sys
    from layerstore.backends.posix import PosixBackend
    asyncio.run(PosixBackend(sys.argv[1]).put("big/object", b"\\x01" * (256 << 20)))
""")


@pytest.mark.asyncio
async def test_posix_killed_writer_leaves_no_partial_object(store_root: Path) -> None:
    async with PosixBackend(store_root) as backend:
        await backend.put("big/object", b"old version")
        writer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TORN_WRITER, str(store_root), cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            # Wait until the temp file holds part of the data, then kill -9.
            while not any(size > 0 for _, size in _temp_files(store_root / "big")):
                assert writer.returncode is None, "the writer finished before it could be killed"
                assert time.monotonic() < deadline, "the writer never started writing"
                await asyncio.sleep(0.001)
            os.killpg(writer.pid, signal.SIGKILL)
        finally:
            if writer.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(writer.pid, signal.SIGKILL)
            await writer.wait()
        assert writer.returncode == -signal.SIGKILL
        assert await backend.get("big/object") == b"old version"
        assert await _keys(backend) == ["big/object"]
        leftovers = _temp_files(store_root / "big")
        assert len(leftovers) == 1
        assert 0 < leftovers[0][1] < 256 * MiB


PERMISSION_PROBE = textwrap.dedent("""
    import asyncio, sys
    from layerstore.backends import open_backend

    async def main():
        async with open_backend(sys.argv[1]) as backend:
            for call in (lambda: backend.put("k/x", b"x"), lambda: backend.get("k/y")):
                try:
                    await call()
                except Exception as exc:
                    print(type(exc).__name__, exc, sep="|")
    asyncio.run(main())
""")


def test_posix_permission_denied_names_the_path(tmp_path: Path) -> None:
    # Root without capabilities (no CAP_DAC_OVERRIDE) obeys file modes like any user, and
    # can still run the venv's interpreter under /root.
    require("root")
    require("cmd:setpriv")
    store = tmp_path / "store"
    (store / "k").mkdir(parents=True)
    (store / "k" / "y").write_bytes(b"secret")
    for path, mode in ((store / "k", 0o700), (store, 0o755)):
        os.chown(path, 65534, 65534)
        path.chmod(mode)
    result = run(["setpriv", "--bounding-set=-all", "--inh-caps=-all",
                  sys.executable, "-c", PERMISSION_PROBE, f"file://{store}"],
                 timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                            "PYTHONDONTWRITEBYTECODE": "1"})
    lines = result.stdout.decode().strip().splitlines()
    assert len(lines) == 2, result
    for line, path in zip(lines, (store / "k", store / "k" / "y"), strict=True):
        name, message = line.split("|", 1)
        assert name == PermissionDenied.__name__, message
        assert "permission denied" in message, message
        assert str(path) in message, message
        assert "give this user access" in message


# ---------------------------------------------------------------------------------------
# The wrappers themselves (FaultyBackend: faults no real service produces on cue)
# ---------------------------------------------------------------------------------------
@pytest_asyncio.fixture
async def faulty(store_root: Path) -> AsyncIterator[FaultyBackend]:
    async with FaultyBackend(PosixBackend(store_root)) as backend:
        yield backend  # type: ignore[misc]


@pytest.mark.asyncio
async def test_retry_backs_off_and_logs(faulty: FaultyBackend, caplog: pytest.LogCaptureFixture) -> None:
    retrying = RetryingBackend(faulty, attempts=4, base_delay=0.01)
    faulty.fail_next("put", 2)
    await retrying.put("k", b"v")
    assert faulty.calls["put"] == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "layerstore.backends.wrappers"]
    assert len(messages) == 2
    assert "put 'k' failed (attempt 1 of 4)" in messages[0]
    assert retrying._delay(1) <= 0.01
    assert retrying._delay(30) <= retrying.max_delay


@pytest.mark.asyncio
async def test_retry_gives_up_keeping_the_type(faulty: FaultyBackend) -> None:
    retrying = RetryingBackend(faulty, attempts=3, base_delay=0.001)
    faulty.fail_next("get", 5)
    with pytest.raises(RetriesExhausted) as caught:
        await retrying.get("k")
    assert isinstance(caught.value, TransientError)
    assert caught.value.retryable
    assert caught.value.attempts == 3
    assert isinstance(caught.value.last, TransientError)
    assert caught.value.__cause__ is caught.value.last
    assert faulty.calls["get"] == 3


@pytest.mark.asyncio
async def test_retry_leaves_permanent_errors_alone(faulty: FaultyBackend) -> None:
    retrying = RetryingBackend(faulty, attempts=5, base_delay=0.001)
    faulty.fail_next("get", 1, error=lambda op, key: CredentialsError(f"{op} {key}: refused"))
    with pytest.raises(CredentialsError):
        await retrying.get("k")
    with pytest.raises(ObjectNotFound):
        await retrying.get("k")
    etag = await retrying.put_conditional("r", b"1", None)
    with pytest.raises(PreconditionFailed) as caught:
        await retrying.put_conditional("r", b"2", etag + "stale")
    assert "may be its own" not in str(caught.value)
    assert faulty.calls["get"] == 2
    assert faulty.calls["put_conditional"] == 2


@pytest.mark.asyncio
async def test_retry_resumes_a_broken_listing(faulty: FaultyBackend) -> None:
    keys = [f"l/{i:02}" for i in range(10)]
    for key in keys:
        await faulty.put(key, b"x")
    retrying = RetryingBackend(faulty, attempts=3, base_delay=0.001)
    faulty.fail_next("list", 1, after_items=4)
    faulty.fail_next("list", 1, after_items=2)  # the restarted listing breaks again (before progress)
    assert await _keys(retrying, "l/") == keys
    assert faulty.calls["list"] == 3
    faulty.fail_next("list", 3)
    with pytest.raises(RetriesExhausted):
        await _keys(retrying)


@pytest.mark.asyncio
async def test_limited_backend_caps_calls_in_flight(faulty: FaultyBackend) -> None:
    await faulty.put("k", b"v")
    limited = LimitedBackend(faulty, 3)
    faulty.stall_next("get", 20, 0.02)
    assert await asyncio.gather(*(limited.get("k") for _ in range(20))) == [b"v"] * 20
    assert faulty.max_in_flight == 3
    faulty.max_in_flight = 0
    faulty.stall_next("list", 5, 0.02)
    listings = await asyncio.gather(*(_keys(limited) for _ in range(5)))
    assert listings == [["k"]] * 5
    assert faulty.max_in_flight <= 3


@pytest.mark.asyncio
async def test_faulty_backend_fails_everything_on_request(faulty: FaultyBackend) -> None:
    faulty.fail_everything = True
    with pytest.raises(TransientError, match="injected"):
        await faulty.get("k")
    with pytest.raises(BackendError):
        await _keys(faulty)
