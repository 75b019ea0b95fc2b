"""Conditional writes on the real S3 (Ceph RGW, or the one LAYERBOX_TEST_S3_ENDPOINT names):
what `layerbox store check` reports, and refs moved by two hosts at once.

RGW 16.2 refuses If-Match with the ETag quoted as it returns it and ignores If-None-Match
when a multipart upload completes (shared/notes/ceph-rgw-recipe.md); moto does neither, so
these run on the real server, where the difference is.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converters.publish import publish
from layerstore.backends.s3 import S3Backend
from layerstore.store import Store
from tests.support.real_s3 import S3Server, use_server

pytestmark = pytest.mark.real_s3

ROOT = Path(__file__).resolve().parent.parent


def test_store_check_says_what_the_server_does(real_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    use_server(monkeypatch, tmp_path, real_s3)
    bucket = real_s3.new_bucket()
    run = subprocess.run([sys.executable, "-m", "tools.cli", "store", "check", "--json",
                          "--store", f"s3://{bucket}/lb", "--data-dir", str(tmp_path / "d")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert run.returncode == 0, run.stderr  # nothing unsupported that refs need
    doc = json.loads(run.stdout)
    assert doc["if_none_match"] is True
    assert doc["if_match_spelling"] in ("quoted", "bare")
    assert doc["stale_quoted_refused"] is True
    assert doc["stale_bare_refused"] is True
    if real_s3.name == "rgw":  # what Ceph RGW 16.2 does, as measured by hand (the recipe)
        assert (doc["if_match_quoted"], doc["if_match_bare"], doc["if_match_spelling"]) == (False, True, "bare")
        assert doc["missing_if_match"] == "412"
        assert doc["multipart_if_none_match"] is False
        assert any("CompleteMultipartUpload ignores" in p for p in doc["problems"])

    async def left() -> list[str]:
        async with S3Backend(bucket, "lb", endpoint_url=real_s3.endpoint) as backend:
            return [info.key async for info in backend.list("")]

    assert [k for k in asyncio.run(left()) if k.startswith("probes/")] == []  # the probe removed its objects


def test_two_hosts_move_refs_at_once_and_every_winner_is_in_history(real_s3: S3Server,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Two data dirs (two hosts) publish, re-publish and tag the same names at once: every write
    lands, the ref ends on one of them, and every other one is in its history exactly once (on
    RGW before the If-Match fix, the second publish failed with "too much contention")."""
    use_server(monkeypatch, tmp_path, real_s3)
    url = f"s3://{real_s3.new_bucket()}/lb"
    rounds = 6

    async def host(name: str) -> list[str]:
        wrote = []
        async with await Store.open(url, tmp_path / name) as store:
            for i in range(rounds):
                if i < 2:  # a real publish (convert, upload, move the ref), twice onto one name
                    src = tmp_path / f"{name}-src-{i}"
                    src.mkdir()
                    (src / "file").write_text(f"{name} round {i}\n")
                    (tmp_path / f"{name}-work").mkdir(exist_ok=True)
                    d = (await publish(store, str(src), "t/py:v1", work_dir=tmp_path / f"{name}-work")).digest
                else:  # then the ref moves alone, as fast as the server takes it, between real images
                    d = wrote[i % 2]
                    await store.set_ref("t/py:v1", d, "image")
                wrote.append(d)
                await store.tag("t/py:v1", "t/py:stable")  # `layerbox tag` onto an existing name
        return wrote

    async def scenario() -> None:
        a, b = await asyncio.gather(host("host-a"), host("host-b"))
        async with await Store.open(url, tmp_path / "reader") as store:
            final = await store.read_ref("t/py:v1")
            seen = [final.digest] + [h["digest"] for h in final.history]
            assert sorted(seen) == sorted(a + b)  # each write once: none lost, none doubled
            assert len(set(a[:2] + b[:2])) == 4  # four different images were published
            stable = await store.read_ref("t/py:stable")
            assert stable.digest in a + b

    asyncio.run(scenario())
