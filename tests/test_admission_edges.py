"""Admission on each edge: real services, real crun (placement across edges: tests/test_fleet.py).

Three ``python -m sandbox.edge`` processes on 127.0.0.1 share one file store
holding the fixture image.  ``a`` and ``b`` admit up to four sandboxes each;
``c`` is configured with ``--max-sandboxes 0`` so that it refuses every create.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lazyfetch import kmount
from sandbox.host.admission import (
    Admission,
    AdmissionConfig,
    CapacityExceeded,
    Demand,
    GiB,
    MiB,
    score,
)
from sandbox.sdk import AsyncSandbox
from tests.support.edges import EdgeProcess
from tests.support.edges import http as edge_http
from tests.support.sandboxes import REF

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

TOKEN = "placement-token-0123456789"
OPS_TOKEN = "placement-ops-token-0123456789"
TOKENS = {"projects": {"p": {"tokens": [TOKEN], "max_sandboxes": 10},
                       "ops": {"tokens": [OPS_TOKEN], "max_sandboxes": 0, "admin": True}}}
HUGE = 1 << 45  # 32 TiB: within the edges' --max-memory, far beyond any host's MemAvailable


def http(method: str, url: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    return edge_http(method, url, body, token=TOKEN)


@pytest.fixture(scope="module")
def cluster(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EdgeProcess]]:
    root = tmp_path_factory.mktemp("placement")
    store = store_url  # one store with the fixture image, shared by the three edges
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    # a small memory reserve: other test runs share this host, and a rejection here must be deliberate
    common = ("--memory-reserve", "256M", "--disk-reserve", "256M", "--max-memory", "64T", "--max-pids", str(1 << 22))
    edges = {"a": EdgeProcess("a", root, store, tokens, "--max-sandboxes", "4", *common, token=TOKEN),
             "b": EdgeProcess("b", root, store, tokens, "--max-sandboxes", "4", *common, token=TOKEN),
             "c": EdgeProcess("c", root, store, tokens, "--max-sandboxes", "0", *common, token=TOKEN)}
    try:
        for e in edges.values():
            e.start()
        yield edges
    finally:
        for e in edges.values():
            e.stop()
        problems = [p for e in edges.values() for p in e.clean_up()]
        assert not problems, problems


@pytest.fixture
def edges(cluster: dict[str, EdgeProcess]) -> Iterator[dict[str, EdgeProcess]]:
    """Every edge up (a test may have killed one); every sandbox a test leaves is destroyed, then fails it."""
    for e in cluster.values():
        if not e.alive():
            e.start()  # its reconcile cleans up what the killed process left
    leftovers: dict[str, list[str]] = {}
    try:
        yield cluster
    finally:
        for e in cluster.values():
            if not e.alive():
                continue
            ids = e.sandboxes()
            for sid in ids:
                http("DELETE", f"{e.url}/v1/sandboxes/{sid}")
            if ids:
                leftovers[e.name] = ids
            assert e.sandboxes() == []
    assert leftovers == {}, "the test left sandboxes behind"


# -- one edge ----------------------------------------------------------------------------------------
def test_load_report_shape_and_it_follows_creates(edges: dict[str, EdgeProcess]) -> None:
    a = edges["a"]
    status, _, report = http("GET", f"{a.url}/v1/load")
    assert status == 200
    assert report["edge"] == "a"
    assert report["accepting"] is True
    assert report["short"] == []
    assert report["sandboxes"] == {"live": 0, "in_flight": 0, "max": 4, "free": 4}
    assert report["memory"]["reserve"] == 256 * MiB
    assert 0 < report["memory"]["free"] == report["memory"]["available"] - 256 * MiB
    assert report["pids"]["tasks"] > 0
    assert report["pids"]["free"] > 0
    assert 0 < report["disk"]["free"] <= report["disk"]["total"]
    assert report["load"]["cpus"] >= 1
    assert report["load"]["avg1"] >= 0
    assert report["score"] == score(report) > 0
    req = urllib.request.Request(f"{a.url}/v1/load")  # no token: the report is not public
    with pytest.raises(urllib.error.HTTPError) as unauth:
        urllib.request.urlopen(req, timeout=10)
    assert unauth.value.code == 401

    async def with_one() -> dict[str, Any]:
        async with await AsyncSandbox.create(REF, url=a.url, token=TOKEN):
            return http("GET", f"{a.url}/v1/load")[2]

    during = asyncio.run(with_one())
    assert during["sandboxes"] == {"live": 1, "in_flight": 0, "max": 4, "free": 3}
    assert during["score"] == score(during)
    after = http("GET", f"{a.url}/v1/load")[2]
    assert after["sandboxes"]["live"] == 0


def metrics(url: str) -> str:
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {OPS_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(r.read().decode())


def rejections(url: str) -> dict[str, float]:
    text = metrics(url)
    prefix = 'layerbox_admission_rejections_total{resource="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_admission_rejects_for_real_and_creates_nothing(edges: dict[str, EdgeProcess]) -> None:
    a, c = edges["a"], edges["c"]
    before = rejections(a.url)
    # more memory than this host has: MemAvailable is real, so the edge must refuse
    status, headers, body = http("POST", f"{a.url}/v1/sandboxes", {"image": REF, "memory": HUGE})
    assert status == 503, body
    err = body["error"]
    assert (err["code"], err["retryable"], err["resources"]) == ("capacity", True, ["memory"])
    assert "needs 32768 GiB memory" in err["message"]
    assert "after the 256 MiB host reserve" in err["message"]
    assert int(headers["Retry-After"]) >= 1

    status, _, body = http("POST", f"{a.url}/v1/sandboxes", {"image": REF, "pids": 1 << 22})
    assert status == 503, body
    assert body["error"]["resources"] == ["pids"]
    assert f"needs {1 << 22} pids" in body["error"]["message"]

    status, _, body = http("POST", f"{c.url}/v1/sandboxes", {"image": REF})
    assert status == 503, body
    assert body["error"]["resources"] == ["sandboxes"]
    assert "needs 1 sandbox slot, 0 of 0 free" in body["error"]["message"]
    assert http("GET", f"{c.url}/v1/load")[2]["accepting"] is False

    # nothing was started: no sandbox, no box directory, nothing mounted
    for e in (a, c):
        assert e.sandboxes() == []
        boxes = e.data_dir / "sandbox" / "boxes"
        assert not boxes.exists() or list(boxes.iterdir()) == []
        assert kmount.mounts_under(boxes) == []
    after = rejections(a.url)
    assert {r: after[r] - before[r] for r in after} == {"sandboxes": 0, "memory": 1, "pids": 1, "disk": 0}
    assert 'layerbox_admission_free{resource="sandboxes"} 4.0' in metrics(a.url)


def test_creates_in_flight_hold_their_reservation(tmp_path: Path) -> None:
    adm = Admission(AdmissionConfig(edge_id="t", max_sandboxes=1, memory_reserve=0, disk_reserve=0),
                    disk_path=tmp_path, boxes=tmp_path / "boxes")
    with adm.reserve(Demand(memory=1 * GiB)):
        held = adm.report()
        assert held["sandboxes"]["in_flight"] == 1
        assert held["memory"]["in_flight"] == 1 * GiB
        assert held["accepting"] is False
        assert held["short"] == ["sandboxes"]
        assert held["memory"]["free"] == max(held["memory"]["available"] - 1 * GiB, 0)
        with pytest.raises(CapacityExceeded, match=r"0 of 1 free \(0 live, 1 create in flight\)") as exc:
            with adm.reserve(Demand()):
                pass
        assert exc.value.resources == ("sandboxes",)
    after = adm.report()
    assert after["sandboxes"]["in_flight"] == 0
    assert after["memory"]["in_flight"] == 0
    assert after["accepting"] is True
