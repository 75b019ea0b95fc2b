"""Cloud bursting with eligibility, for real: a fleet of two pools (``onprem``, one edge on the
home store; ``cloud``, one edge on a store of its own), the burst policy in the database, and
``layerbox sync`` copying only eligible images to the cloud store.

The home store holds the fixture's python image as ``img/python`` (eligible: prefix ``img/``)
and its minbase image as ``private/minbase`` (not eligible).  Each edge admits 2 sandboxes; the policy
overflows past half of home's slots.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.edges import http
from tests.support.env import require
from tests.support.hosts import publish_sync
from tests.support.sandboxes import FIXTURE, REF, store_url  # noqa: F401  (the module's store with the fixture image)
from tests.test_fleet import Fleet, layerbox

REPO = Path(__file__).resolve().parents[1]
PRIVATE = "private/minbase"


def cli(*args: str) -> Any:
    return layerbox(*args)


@pytest.fixture(scope="module")
def burst(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, dict[str, Any]]]:  # noqa: F811
    require("root")
    base = tmp_path_factory.mktemp("burst")
    cloud = f"file://{base / 'cloud-store'}"
    publish_sync(store_url, base / "pub", f"oci-archive:{FIXTURE}:minbase", PRIVATE)
    synced = cli("sync", store_url, cloud, "--eligible-only", "--eligible-prefix", "img/", "--data-dir",
                 str(base / "sync"))
    root = base / "f"
    state = layerbox("fleet", "--dir", str(root), "up", "--store", store_url, "--pools", "onprem=1,cloud=1",
                     "--pool-store", f"cloud={cloud}", "--gateways", "1", "--edge-arg=--max-sandboxes",
                     "--edge-arg=2", "--gateway-arg=--sync-back", "--gateway-arg=1")
    fleet = Fleet(root, state)
    try:
        fleet.cli("policy", "set", "--home", "onprem", "--overflow", "cloud", "--threshold", "0.5", "--wait", "2",
                  "--eligible-prefix", "img/")
        time.sleep(1.5)  # the gateway's next registry refresh reads the policy
        yield fleet, {"cloud": cloud, "home": store_url, "synced": synced, "base": base}
    finally:
        layerbox("fleet", "--dir", str(root), "down")


def where(fleet: Fleet) -> dict[str, list[str]]:
    return fleet.on_edges()


def reported(fleet: Fleet, edge: str, live: int) -> None:
    """Until ``edge``'s heartbeat says it runs ``live`` sandboxes, and the gateway has read it."""
    deadline = time.monotonic() + 30
    while fleet.edges()[edge]["load"]["sandboxes"]["live"] != live:
        assert time.monotonic() < deadline, fleet.edges()[edge]["load"]
        time.sleep(0.3)
    time.sleep(1.2)  # the gateway's next registry refresh


def test_sync_moved_only_the_eligible_image_and_a_second_sync_moves_nothing(
        burst: tuple[Fleet, dict[str, Any]]) -> None:
    _, stores = burst
    report = stores["synced"]
    statuses = {r["name"]: r["status"] for r in report["refs"]}
    assert statuses[f"{REF}:latest"] == "copied", statuses
    assert statuses[f"{PRIVATE}:latest"] == "ineligible", statuses
    assert report["bytes_moved"] > 0
    again = cli("sync", stores["home"], stores["cloud"], "--eligible-only", "--eligible-prefix", "img/",
                "--data-dir", str(stores["base"] / "sync2"))
    assert again["bytes_moved"] == 0


def test_past_the_threshold_eligible_creates_overflow_and_others_wait_then_are_refused(
        burst: tuple[Fleet, dict[str, Any]]) -> None:
    fleet, _ = burst
    g = fleet.gateways[0]
    made: list[str] = []
    try:
        reported(fleet, "edge-0", 0)
        status, _, first = http("POST", g + "/v1/sandboxes", {"image": REF}, token=fleet.token, timeout=120)
        assert status == 201, first
        made.append(first["id"])
        assert first["id"] in where(fleet)["edge-0"]  # home below the threshold
        reported(fleet, "edge-0", 1)  # the home edge's report says it is half full
        status, _, second = http("POST", g + "/v1/sandboxes", {"image": REF}, token=fleet.token, timeout=120)
        assert status == 201, second
        made.append(second["id"])
        assert second["id"] in where(fleet)["edge-1"]  # eligible and present in the cloud store: overflows
        status, _, third = http("POST", g + "/v1/sandboxes", {"image": PRIVATE}, token=fleet.token, timeout=120)
        assert status == 201, third
        made.append(third["id"])
        assert third["id"] in where(fleet)["edge-0"]  # ineligible: home, which still had room
        started = time.monotonic()
        status, _, fourth = http("POST", g + "/v1/sandboxes", {"image": PRIVATE}, token=fleet.token, timeout=120)
        waited = time.monotonic() - started
        assert status == 503, fourth
        message = fourth["error"]["message"]
        assert ("may not overflow" in message, "eligibility policy" in message, "img/" in message) == (
            True, True, True), message
        assert waited >= 2.0  # it waited the policy's bound for room at home first
        projects = {p["name"]: p for p in fleet.cli("projects")}
        assert (projects["demo"]["live"], projects["demo"]["reserved"]) == (3, 0)
    finally:
        for sid in made:
            http("DELETE", f"{g}/v1/sandboxes/{sid}", token=fleet.token)


def test_a_checkpoint_made_in_the_cloud_syncs_back_and_restores_at_home(burst: tuple[Fleet, dict[str, Any]]) -> None:
    fleet, stores = burst
    g = fleet.gateways[0]
    made: list[str] = []
    try:
        for live in (0, 1):  # the second overflows (past half of home's two slots)
            reported(fleet, "edge-0", live)
            status, _, box = http("POST", g + "/v1/sandboxes", {"image": REF}, token=fleet.token, timeout=120)
            assert status == 201, box
            made.append(box["id"])
        cloudy = made[1]
        assert cloudy in where(fleet)["edge-1"]
        status, _, out = http("POST", f"{g}/v1/sandboxes/{cloudy}/exec", {"cmd": "echo from-the-cloud > /root/c.txt"},
                              token=fleet.token, timeout=120)
        assert status == 200, out
        status, _, ckpt = http("POST", f"{g}/v1/sandboxes/{cloudy}/checkpoint", {"name": "cloudy"}, token=fleet.token,
                               timeout=300)
        assert status == 201, ckpt
    finally:
        for sid in made:
            http("DELETE", f"{g}/v1/sandboxes/{sid}", token=fleet.token)
    cloud = cli("ls", "--store", stores["cloud"], "--data-dir", str(stores["base"] / "ls0"), "projects/demo/")
    assert any("cloudy" in json.dumps(r) for r in cloud), cloud  # made in the cloud, written to its store
    deadline = time.monotonic() + 60
    while True:
        home = cli("ls", "--store", stores["home"], "--data-dir", str(stores["base"] / f"ls{time.monotonic()}"),
                   "projects/demo/")
        if any("cloudy" in json.dumps(r) for r in home) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert any("cloudy" in json.dumps(r) for r in home), home
    reported(fleet, "edge-0", 0)  # home's utilization back to 0 in the gateway's view: the restore goes home
    status, _, back = http("POST", g + "/v1/sandboxes/restore", {"checkpoint": ckpt["name"]}, token=fleet.token,
                           timeout=300)
    assert status == 201, back
    try:
        assert back["id"] in where(fleet)["edge-0"]
        status, _, out = http("POST", f"{g}/v1/sandboxes/{back['id']}/exec", {"cmd": "cat /root/c.txt"},
                              token=fleet.token, timeout=120)
        assert "ZnJvbS10aGUtY2xvdWQK" in str(out), out  # base64 of "from-the-cloud\n"
    finally:
        http("DELETE", f"{g}/v1/sandboxes/{back['id']}", token=fleet.token)


def test_the_cloud_edge_reads_only_the_cloud_store(burst: tuple[Fleet, dict[str, Any]]) -> None:
    fleet, stores = burst
    cloud_edge = next(e for e in fleet.state["edges"] if e["pool"] == "cloud")
    argv = cloud_edge["argv"]
    assert argv[argv.index("--store") + 1] == stores["cloud"]
    status, _, body = http("POST", fleet.gateways[0] + "/v1/sandboxes", {"image": PRIVATE}, token=fleet.token)
    assert status in (201, 503), body
    if status == 201:
        http("DELETE", f"{fleet.gateways[0]}/v1/sandboxes/{body['id']}", token=fleet.token)
        assert body["id"] not in where(fleet)["edge-1"]  # never placed where its image is not


def test_a_bad_policy_is_refused_by_the_cli(burst: tuple[Fleet, dict[str, Any]]) -> None:
    fleet, _ = burst
    done = subprocess.run([sys.executable, "-m", "tools.cli", "fleet", "--dir", str(fleet.root), "policy", "set",
                           "--home", "onprem", "--overflow", "onprem"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, "two pools" in done.stderr) == (1, True), done.stderr
    shown = fleet.cli("policy", "show")
    assert json.dumps(shown["eligibility"]["prefixes"]) == '["img/"]'
