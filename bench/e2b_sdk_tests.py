"""E2B's own Python SDK tests, run unchanged against one layerbox edge: a compatibility check.

The tests are taken from a copy of e2b-dev/E2B (``--e2b-repo``: a checkout, or a bare git
directory such as the one ``fetch github:e2b-dev/E2B`` leaves; ``packages/python-sdk/tests`` and
its ``pytest.ini`` at ``--rev``), run with the installed ``e2b`` package against an edge of this
checkout (``python -m sandbox.edge``) on a ``file://`` store holding the fixture's ``python``
image, the template ``base`` made as tests/support/e2b.py makes it (the image with E2B's account
``user``, checkpointed and shared), and only ``E2B_API_KEY``, ``E2B_API_URL`` and
``E2B_SANDBOX_URL`` set, as a user's would be.

Every failure is printed with its first error line and, where one of :data:`KNOWN` matches it,
the reason it is expected here (no internet from this machine, no wildcard DNS for
``<port>-<id>.<domain>``, a tool E2B's ``base`` template has and the fixture image lacks, a
feature layerbox refuses by design, a test written for another SDK version); the rest are
**unexplained**: those are the bugs to look at.  Everything the run makes is removed at exit.
``python bench/e2b_sdk_tests.py --e2b-repo /work/.mirror/e2b-dev+E2B/repo``.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from io import BytesIO
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BenchError, log, workspace  # noqa: E402
from fairness import start_edge, stop_edge  # noqa: E402
from sdk import find_fixture, make_template, publish_image  # noqa: E402

from lazyfetch import kmount  # noqa: E402

SCHEMA = "layerbox.bench.e2b_sdk_tests.v1"
REPO = Path(__file__).resolve().parents[1]
SDK_DIR = "packages/python-sdk"
DEFAULT_SELECT = ("tests/sync/sandbox_sync", "tests/async/sandbox_async", "tests/sync/api_sync", "tests/async/api_async")

# fnmatch patterns of test names (the part after "::") and why each fails on this machine
KNOWN: list[tuple[str, str]] = [
    ("test_internet_access_*", "template and environment: runs curl (E2B's base template has it, the fixture "
                               "image does not) against the internet, which this machine cannot reach"),
    ("test_allow_public_traffic_*", "environment: needs wildcard DNS for <port>-<id>.<domain> (E2B_DOMAIN)"),
    ("test_allow_*", "template and environment: runs curl (not in the fixture image) against public addresses"),
    ("test_update_network_*", "template and environment: runs curl (not in the fixture image) against public "
                              "addresses"),
    ("test_auto_resume_wakes_on_http_request", "environment: needs wildcard DNS for <port>-<id>.<domain>"),
    ("test_ping_server", "environment: needs wildcard DNS for <port>-<id>.<domain>, and `python` (E2B's base "
                         "template has it; the fixture image has python3 only)"),
    ("test_bash_command_scoped_env_vars", "template: E2B's base template has sudo; the fixture image does not"),
    ("test_firewall_transform_injects_headers", "template: needs E2B's httpbin template"),
    ("test_connect_sets_stable_host_routing_headers", "environment: asserts E2B's own domain (sandbox.e2b.app)"),
    ("test_connect_normalizes_unset_tokens", "version: mocks a call the installed SDK no longer makes first"),
    ("test_file_symlink", "version: written for an SDK that typed a symlink as its target; the installed SDK "
                          "types it SYMLINK from envd's is_symlink (tests/test_e2b_files.py)"),
    ("test_mcp_*", "by design: no MCP gateway (docs/E2B.md)"),
    ("test_mask_request_host", "by design: maskRequestHost is refused naming the field (docs/E2B.md)"),
    ("test_deny_specific_ip", "by design: egress is default-deny plus allow rules; denyOut other than "
                              "0.0.0.0/0 is refused naming the field (docs/E2B.md)"),
    ("test_pause_filesystem_only", "by design: a container's filesystem-only pause keeps the host's kernel, so "
                                   "its boot id does not change (docs/E2B.md)"),
    ("test_auto_pause_filesystem_only_reboots", "by design: autoPauseMemory false is refused naming the field "
                                                "(docs/E2B.md)"),
    ("test_download_url_with_expired_signing", "message: layerbox's error message carries its code "
                                               "('unauthenticated: signature is already expired')"),
]


def tests_from(repo: Path, rev: str, into: Path) -> Path:
    """``packages/python-sdk/{tests,pytest.ini}`` of ``repo`` at ``rev``, under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    if (repo / SDK_DIR / "tests").is_dir():  # a checkout
        shutil.copytree(repo / SDK_DIR / "tests", into / "tests")
        shutil.copy(repo / SDK_DIR / "pytest.ini", into / "pytest.ini")
        return into
    done = subprocess.run(["git", "-C", str(repo), "archive", rev, f"{SDK_DIR}/tests", f"{SDK_DIR}/pytest.ini"],
                          capture_output=True)
    if done.returncode != 0:
        raise BenchError(f"{repo}: no {SDK_DIR}/tests at {rev}: {done.stderr.decode(errors='replace')[-300:]}")
    with tarfile.open(fileobj=BytesIO(done.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / SDK_DIR


def known(name: str) -> str | None:
    short = name.split("::")[-1].split("[")[0]
    return next((why for pattern, why in KNOWN if fnmatch.fnmatch(short, pattern)), None)


def outcomes(junit: Path) -> list[dict[str, Any]]:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        result = "failed" if failed is not None else "skipped" if skipped is not None else "passed"
        line = ""
        if failed is not None:
            line = (failed.get("message") or (failed.text or "")).strip().splitlines()[0][:300] if \
                (failed.get("message") or failed.text) else ""
        out.append({"test": name, "result": result, "error": line,
                    "known": known(name) if result == "failed" else None})
    return out


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sdk = tests_from(args.e2b_repo, args.rev, work / "e2b")
    store_url = f"file://{work / 'store'}"
    log(f"publish {args.fixture}:python")
    await publish_image(store_url, work, find_fixture(args.fixture))
    edge = await start_edge(REPO, work, store_url, name="e2b-sdk-tests",
                            projects={"bench": {"max_sandboxes": 64}, "ops": {"admin": True}})
    try:
        log("template 'base': the image with E2B's account user, checkpointed")
        await make_template(edge)
        env = {**os.environ, "E2B_API_KEY": edge.tokens["bench"], "E2B_API_URL": edge.url,
               "E2B_SANDBOX_URL": edge.url}
        junit = work / "junit.xml"
        log(f"pytest {' '.join(args.select)} (E2B's tests, the installed e2b SDK)")
        t0 = time.perf_counter()
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(sdk / "pytest.ini"),
                             "--import-mode=importlib", "--junitxml", str(junit), *args.select],
            cwd=sdk, env=env, capture_output=True, text=True, timeout=args.timeout)
        seconds = time.perf_counter() - t0
        if not junit.exists():
            raise BenchError(f"pytest wrote no report (exit {done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        return {"seconds": round(seconds, 1), "exit": done.returncode, "tests": outcomes(junit)}
    finally:
        log("stopping the edge (SIGTERM) and destroying what it left")
        problems = stop_edge(edge)
        if problems:
            log(f"cleanup: {problems}")


def render(doc: dict[str, Any]) -> str:
    tests = doc["tests"]
    count = {r: sum(1 for t in tests if t["result"] == r) for r in ("passed", "failed", "skipped")}
    failed = [t for t in tests if t["result"] == "failed"]
    unexplained = [t for t in failed if t["known"] is None]
    out = [f"E2B's Python SDK tests ({doc['settings']['e2b_repo']} at {doc['settings']['rev']}) with e2b "
           f"{doc['environment']['e2b']} against one layerbox edge: {count['passed']} passed, {count['failed']} "
           f"failed, {count['skipped']} skipped of {len(tests)} in {doc['seconds']} s", ""]
    by_reason: dict[str, list[str]] = {}
    for t in failed:
        if t["known"] is not None:
            by_reason.setdefault(t["known"], []).append(t["test"].split("::")[-1])
    out.append(f"expected here ({len(failed) - len(unexplained)}):")
    for why, names in sorted(by_reason.items()):
        out.append(f"  {len(names):3d}  {why}: {', '.join(sorted(set(names)))}")
    out.append(f"unexplained ({len(unexplained)}):")
    out += [f"  {t['test']}: {t['error']}" for t in unexplained] or ["  none"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/e2b_sdk_tests.py", description=__doc__.split("\n")[0])
    p.add_argument("--e2b-repo", type=Path, required=True, metavar="DIR",
                   help="a checkout or git directory of e2b-dev/E2B (e.g. what `fetch github:e2b-dev/E2B` left)")
    p.add_argument("--rev", default="HEAD", help="the revision of a git directory (default HEAD)")
    p.add_argument("--select", nargs="+", default=list(DEFAULT_SELECT), metavar="PATH",
                   help="test paths under packages/python-sdk (default: the sandbox and API tests, sync and async)")
    p.add_argument("--fixture", default=None, metavar="PATH", help="the fixture OCI archive (default: ../shared)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds the tests may take (default 3600)")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/e2b_sdk_tests.py: needs root (the edge mounts and runs containers)", file=sys.stderr)
        return 1
    from importlib.metadata import version

    left: list[str] = []
    try:
        with workspace(args.tmpdir, "lb-e2bsdk-", before_removal=lambda w: left.extend(kmount.mounts_under(w))) as work:
            results = asyncio.run(run(args, work))
    except BenchError as exc:
        log(f"bench/e2b_sdk_tests.py: {exc}")
        return 1
    doc = {"schema": SCHEMA, "settings": {"e2b_repo": str(args.e2b_repo), "rev": args.rev, "select": args.select},
           "environment": {"e2b": version("e2b")}, **results}
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    if left:
        log(f"bench/e2b_sdk_tests.py: mounts were left under the workdir: {left}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
