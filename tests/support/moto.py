"""A real S3 server for tests: moto's ``moto_server`` on 127.0.0.1.

``moto_fixture(scope)`` makes a fixture that starts one server (port picked
by binding port 0), waits until it answers HTTP (with a deadline, failing
with its log), yields a :class:`MotoServer` and kills it in teardown however
the tests ended.  ``aws_test_env`` points boto3 at fake credentials only, so
no test can reach a real account; ``new_bucket`` makes a fresh bucket.

    moto = moto_fixture("session")          # in a test module (or conftest)

    def test_x(moto: MotoServer, aws_test_env: None) -> None:
        bucket = moto.new_bucket()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from layerstore.store import Store
from tests.support.real_s3 import REAL_S3, S3Server, use_s3_account, use_server

MOTO_SERVER = Path(sys.executable).with_name("moto_server")
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}



def free_port() -> int:
    """A port nobody listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class MotoServer:
    """One ``moto_server`` process; ``endpoint`` is its http://127.0.0.1:PORT URL.

    An :class:`~tests.support.real_s3.S3Server`, like the real servers the S3 suites also run on.
    """

    name = "moto"
    access_key = FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"]
    secret_key = FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    region = FAKE_CREDENTIALS["AWS_DEFAULT_REGION"]
    atomic_conditional_writes = False  # see MOTO_RACE in tests/test_backend_conformance.py

    def __init__(self, env: Mapping[str, str] | None = None, *, ready_timeout: float = 30.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        server_env = {**os.environ, **FAKE_CREDENTIALS, **(env or {})}
        self.proc = subprocess.Popen(
            [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=server_env, start_new_session=True,
        )
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        probe = f"{self.endpoint}/moto-api/data.json"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(probe, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer {probe} within {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()[-20_000:].decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def client(self, **config: Any) -> Any:
        """A plain boto3 S3 client on this server with the fake credentials."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
            config=Config(retries={"total_max_attempts": 1}, **config),
        )

    def new_bucket(self, name: str | None = None) -> str:
        bucket = name or f"test-{uuid.uuid4().hex[:20]}"
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        finally:
            client.close()
        return bucket


def moto_fixture(scope: Any = "session", env: Mapping[str, str] | None = None
                 ) -> Callable[..., Iterator[MotoServer]]:
    """A pytest fixture running one moto server for ``scope``; assign it to a module name."""

    @pytest.fixture(scope=scope)
    def moto_server() -> Iterator[MotoServer]:
        server = MotoServer(env)
        try:
            yield server
        finally:
            server.stop()

    return moto_server


@pytest.fixture
def aws_test_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials and no AWS configuration files, for one test."""
    use_s3_account(monkeypatch, tmp_path, MotoServer.access_key, MotoServer.secret_key,
                   MotoServer.region)


@pytest.fixture(params=["file", "moto", REAL_S3], name="store_url")
def file_and_s3_store_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``store_url`` for modules that run each test on a file store, on moto S3 and on the real S3
    (tests/support/real_s3.py; import this, and define ``moto = moto_fixture(...)`` in the module).
    Subprocesses see the endpoint and keys too."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    server: S3Server = request.getfixturevalue("moto" if request.param == "moto" else "real_s3")
    use_server(monkeypatch, tmp_path, server)
    return f"s3://{server.new_bucket()}/layerbox"


@pytest_asyncio.fixture(name="store")
async def opened_store(store_url: str, tmp_path: Path) -> AsyncIterator[Store]:
    """``store``: a Store on ``store_url`` with its host cache in ``tmp_path/host1``, closed after the test."""
    s = await Store.open(store_url, tmp_path / "host1")
    try:
        yield s
    finally:
        await s.close()
