"""The E2B surface's own ground: per-sandbox tokens that outlive an edge's crash, and E2B's error
shape on its routes (the native API's on its own)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from e2b import Sandbox, TimeoutException
from support.e2b import ALPHA, TEMPLATE, E2bEdge, e2b_edge
from support.edges import http
from support.sandboxes import PROCESS_ARGS, store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def served(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b-edge"), store_url) as edge:
        yield edge


def test_a_sandboxs_envd_token_outlives_a_crash_of_its_edge(served: E2bEdge) -> None:
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        assert sbx.commands.run("echo before").stdout == "before\n"
        served.edge.kill()  # SIGKILL: the sandbox lives on, the next start adopts it
        served.edge.start()
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"  # adopted by the new start
        # the same handle, the same X-Access-Token: the key it was derived from is the edge's own file
        assert sbx.commands.run("echo after").stdout == "after\n"
    finally:
        sbx.kill()


def test_errors_on_e2b_routes_have_e2bs_shape_and_native_routes_keep_theirs(served: E2bEdge) -> None:
    status, _, body = _get(served.url + "/sandboxes/lb-000000000000", ALPHA)
    assert status == 404
    assert body["code"] == 404
    assert "lb-000000000000" in body["message"]
    status, _, body = _get(served.url + "/sandboxes/not-an-id", ALPHA)  # names no sandbox: E2B's 404
    assert status == 404
    assert body["code"] == 404
    assert "sandboxID" in body["message"]
    status, _, body = _get(served.url + "/v2/sandboxes?limit=many", ALPHA)
    assert status == 400
    assert body["code"] == 400
    assert "limit" in body["message"]
    status, _, body = _get(served.url + "/sandboxes", "x" * 20)
    assert status == 401
    assert body["code"] == 401
    status, _, body = http("GET", served.url + "/v1/sandboxes/lb-000000000000", token=ALPHA)
    assert status == 404
    assert body["error"]["code"] == "sandbox_not_found"


def _get(url: str, key: str) -> tuple[int, dict[str, str], dict[str, object]]:
    req = urllib.request.Request(url, headers={"X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_a_crash_of_the_edge_mid_command_ends_the_stream_and_leaves_no_orphan(served: E2bEdge) -> None:
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        handle = sbx.commands.run("echo started; sleep 600", background=True, timeout=0)
        served.edge.kill()  # SIGKILL while the command runs and its stream is open
        with pytest.raises(TimeoutException):  # the SDK's answer to a dropped connection: an error, not a hang
            handle.wait()
        served.edge.start()
        assert sbx.commands.run("echo after").stdout == "after\n"  # the sandbox was adopted, its token still opens it
        # the command that outlived its edge was ended by the next start's reconcile, not left running unowned
        assert sbx.commands.run(f"{PROCESS_ARGS} | grep -c '^sleep 600 ' || true", user="root").stdout == "0\n"
        assert [p for p in sbx.commands.list() if "600" in " ".join(p.args)] == []
    finally:
        sbx.kill()
