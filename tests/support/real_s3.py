"""The real S3 that the S3 suites run on besides moto: Ceph RGW, or one the environment names.

Moto implements S3's conditional writes its own way (not atomically, and with
other answers than RGW or AWS give), so every S3 suite runs twice: on moto
and on this real server.  Which server that is:

- by default a single-node Ceph RGW (tests/support/rgw.py), booted once per
  session.  ``boot_in_background()`` (called by tests/conftest.py when
  collection found a test marked ``real_s3``) starts the boot in a thread,
  so its seconds (3 on an idle host, more under load) overlap the first
  tests, and the ``real_s3`` fixture waits for it;
- ``LAYERBOX_TEST_S3_ENDPOINT`` (with ``LAYERBOX_TEST_S3_ACCESS_KEY`` and
  ``LAYERBOX_TEST_S3_SECRET_KEY``; optional ``LAYERBOX_TEST_S3_REGION`` and
  ``LAYERBOX_TEST_S3_BUCKET_PREFIX``) names any other S3 (AWS, MinIO, an
  RGW started by hand) instead; then nothing boots, and the buckets the run
  made are emptied and deleted at its end.  See tests/README.md.

``REAL_S3`` is the ``pytest.param`` to add to an S3 parametrization (marked
``real_s3``; its id is ``rgw``, or ``s3env`` when the environment names the
server); ``real_s3`` is the session fixture; ``use_s3_account`` points boto3
(in this process and its children) at one server for one test.

When the RGW cannot start, its tests fail with the daemons' logs.  When Ceph
is not installed they are skipped, except under CI (``CI=true``), where they
fail: a green CI run has used a real S3.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.support import rgw
from tests.support.env import in_ci

ENDPOINT_VAR = "LAYERBOX_TEST_S3_ENDPOINT"
ACCESS_KEY_VAR = "LAYERBOX_TEST_S3_ACCESS_KEY"
SECRET_KEY_VAR = "LAYERBOX_TEST_S3_SECRET_KEY"
REGION_VAR = "LAYERBOX_TEST_S3_REGION"
BUCKET_PREFIX_VAR = "LAYERBOX_TEST_S3_BUCKET_PREFIX"
MARK = "real_s3"

REAL_S3_ID = "s3env" if os.environ.get(ENDPOINT_VAR) else "rgw"
REAL_S3 = pytest.param("real", marks=getattr(pytest.mark, MARK), id=REAL_S3_ID)

# Settings that could point boto3 at a real account or another endpoint than the test's.
AWS_LEAKS = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
             "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ROLE_ARN",
             "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
             "AWS_CONTAINER_CREDENTIALS_FULL_URI")


class S3Server(Protocol):
    """What the S3 tests need of a server: moto's MotoServer, RgwCluster and ExternalS3 all are one."""

    name: str
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    atomic_conditional_writes: bool  # do concurrent conditional writes have exactly one winner?

    def client(self, **config: Any) -> Any: ...

    def new_bucket(self, name: str | None = None) -> str: ...


def use_s3_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, access_key: str, secret_key: str,
                   region: str, endpoint: str | None = None) -> None:
    """For one test: these credentials (and endpoint) only, and no AWS configuration files."""
    for name in AWS_LEAKS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", region)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    if endpoint is not None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


def use_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server: S3Server) -> None:
    """``use_s3_account`` with ``server``'s keys and endpoint."""
    use_s3_account(monkeypatch, tmp_path, server.access_key, server.secret_key, server.region,
                   server.endpoint)


@dataclass
class ExternalS3:
    """The S3 that ``LAYERBOX_TEST_S3_*`` names; buckets made here are removed by ``cleanup``."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    bucket_prefix: str = "layerbox-test-"
    name = REAL_S3_ID
    atomic_conditional_writes = True  # AWS S3 and MinIO promise it
    made: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ExternalS3:
        missing = [v for v in (ACCESS_KEY_VAR, SECRET_KEY_VAR) if not environ.get(v)]
        if missing:
            raise pytest.UsageError(f"{ENDPOINT_VAR} is set but {' and '.join(missing)} not "
                                    f"(see tests/README.md)")
        prefix = environ.get(BUCKET_PREFIX_VAR) or "layerbox-test-"
        if len(prefix) > 40:
            raise pytest.UsageError(f"{BUCKET_PREFIX_VAR}={prefix!r}: at most 40 characters "
                                    "(bucket names are at most 63)")
        return cls(environ[ENDPOINT_VAR], environ[ACCESS_KEY_VAR], environ[SECRET_KEY_VAR],
                   environ.get(REGION_VAR) or "us-east-1", prefix)

    def client(self, **config: Any) -> Any:
        return rgw.s3_client(self.endpoint, self.access_key, self.secret_key, self.region,
                             attempts=3, **config)

    def new_bucket(self, name: str | None = None) -> str:
        bucket = name or f"{self.bucket_prefix}{uuid.uuid4().hex[:20]}"
        client = self.client()
        try:
            if self.region == "us-east-1":
                client.create_bucket(Bucket=bucket)
            else:
                client.create_bucket(Bucket=bucket,
                                     CreateBucketConfiguration={"LocationConstraint": self.region})
        finally:
            client.close()
        self.made.append(bucket)
        return bucket

    def cleanup(self) -> list[str]:
        """Empty and delete every bucket this run made; returns what could not be removed."""
        from botocore.exceptions import BotoCoreError, ClientError

        problems = []
        client = self.client()
        try:
            for bucket in self.made:
                try:
                    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
                        for upload in page.get("Uploads", []):
                            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                                          UploadId=upload["UploadId"])
                    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                        if keys:
                            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
                    client.delete_bucket(Bucket=bucket)
                except (BotoCoreError, ClientError) as exc:
                    problems.append(f"{bucket}: {exc}")
        finally:
            client.close()
        self.made.clear()
        return problems


def require_ceph(missing: Callable[[], list[str]] = rgw.missing) -> None:
    """Skip the calling test unless Ceph is installed; fail instead when CI=true."""
    absent = missing()
    if absent:
        reason = f"Ceph RGW is not installed ({', '.join(absent)} missing): {rgw.install_hint()}"
        if in_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)


class _Session:
    """The one real S3 of this test session: booted at most once, stopped at its end."""

    def __init__(self, missing: Callable[[], list[str]] = rgw.missing) -> None:
        self._missing = missing  # which Ceph programs are not installed
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._cluster: rgw.RgwCluster | None = None
        self._error: BaseException | None = None
        self._external: ExternalS3 | None = None
        self._timings: dict[str, float] = {}

    def boot_in_background(self) -> None:
        """Begin booting the RGW now (no-op if it began, is external, or Ceph is missing)."""
        if os.environ.get(ENDPOINT_VAR) or self._missing():
            return
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._boot, name="rgw-boot", daemon=True)
            self._thread.start()

    def _boot(self) -> None:
        try:
            cluster = rgw.RgwCluster.create("pytest")
            with self._lock:
                self._cluster = cluster
            cluster.boot()
        except BaseException as exc:  # kept, and raised in every test that asks for the server
            self._error = exc

    def server(self) -> S3Server:
        """The server, waiting for the boot; fails (or skips) the calling test when there is none."""
        if os.environ.get(ENDPOINT_VAR):
            if self._external is None:
                self._external = ExternalS3.from_env()
            return self._external
        require_ceph(self._missing)
        self.boot_in_background()
        assert self._thread is not None
        self._thread.join(rgw.BOOT_TIMEOUT + 60)
        if self._thread.is_alive():
            pytest.fail(f"the Ceph RGW boot thread still runs after {rgw.BOOT_TIMEOUT + 60:.0f} s",
                        pytrace=False)
        if self._error is not None:
            pytest.fail(str(self._error), pytrace=False)
        assert self._cluster is not None
        return self._cluster

    @property
    def boot_timings(self) -> dict[str, float]:
        return dict(self._cluster.timings if self._cluster is not None else self._timings)

    def shutdown(self) -> list[str]:
        """Stop the cluster (also mid-boot) or clean the external buckets; returns problems."""
        problems: list[str] = []
        with self._lock:
            cluster, self._cluster = self._cluster, None
            thread = self._thread
        if cluster is not None:
            self._timings = dict(cluster.timings)
            cluster.stop()
        if thread is not None:
            thread.join(30)
        if self._external is not None:
            problems += self._external.cleanup()
        return problems


_session = _Session()
boot_in_background = _session.boot_in_background
shutdown = _session.shutdown


def boot_timings() -> dict[str, float]:
    """Seconds since the boot began at which each step was done (empty before or without a boot)."""
    return _session.boot_timings


def is_real_s3(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARK) is not None


@pytest.fixture(scope="session")
def real_s3() -> Iterator[S3Server]:
    """The session's real S3 (see the module docstring); stopped or cleaned at the session's end."""
    try:
        yield _session.server()
    finally:
        problems = shutdown()
        if problems:
            pytest.fail("buckets left on the external S3:\n" + "\n".join(problems), pytrace=False)
