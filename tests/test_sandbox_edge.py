"""Through the edge service and the SDK: jobs and preemption, restore, abuse, disconnects, leases,
streamed files, FnCall, and a service crash with sandboxes running."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support.sandboxes import (
    PROCESS_ARGS,
    REF,
    ServerThread,
    assert_clean,
    no_sandboxes_left,
    serving,
)

from lazyfetch import kmount
from sandbox.host.manager import SandboxManager
from sandbox.sdk import (
    AsyncJob,
    AsyncSandbox,
    CheckpointNotFound,
    FileNotFound,
    NotFound,
    QuotaExceeded,
    RunNotFound,
    Sandbox,
    SandboxKilled,
    SandboxNotFound,
    UnsupportedIsolation,
    call,
    capabilities,
)

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA = "alpha-edge-token-0123456789", "beta-edge-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 6},
                       "beta": {"tokens": [BETA], "max_sandboxes": 2}}}


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, reap_interval=0.3, fncall_pool=1) as srv:  # stopping closes the pools
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    with no_sandboxes_left(manager):
        yield server.url


def test_the_service_starts_the_lazyfetch_daemon_before_the_first_create(
        server: ServerThread, manager: SandboxManager) -> None:
    assert manager.list() == []  # first in this module: nothing has mounted anything yet
    deadline = time.monotonic() + 30
    while manager.host.client.health() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.host.client.health() is not None


def test_preempt_a_job_and_resume_it_through_the_sdk(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        a = await AsyncSandbox.create(REF, url=url, token=ALPHA, job="train-1", labels={"role": "a"})
        b = await AsyncSandbox.create(REF, url=url, token=ALPHA, job="train-1", disk=32 << 20)
        first = await a.commands.run("echo step >> /root/log; wc -l < /root/log", idempotency_key="s1")
        await b.files.write("/root/b.txt", "bee")
        job = AsyncJob("train-1", url=url, token=ALPHA)
        run = await job.preempt(grace=2)
        assert sorted(run.sandboxes) == sorted([a.sandbox_id, b.sandbox_id])
        assert run.manifest["job"] == "alpha/train-1"
        with pytest.raises(SandboxKilled):  # the host is free of them
            await a.refresh()
        # another project can neither resume this run nor restore its checkpoints
        with pytest.raises(RunNotFound):
            await AsyncJob.resume_run(run.ref, url=url, token=BETA)
        some_checkpoint = next(iter(run.sandboxes.values()))
        with pytest.raises(CheckpointNotFound):
            await AsyncSandbox.restore(some_checkpoint, url=url, token=BETA)
        resumed = await AsyncJob.resume_run(run.ref, url=url, token=ALPHA)
        new_a = await AsyncSandbox.connect(resumed.sandboxes[a.sandbox_id], url=url, token=ALPHA)
        new_b = await AsyncSandbox.connect(resumed.sandboxes[b.sandbox_id], url=url, token=ALPHA)
        retry = await new_a.commands.run("echo step >> /root/log; wc -l < /root/log", idempotency_key="s1")
        assert (retry.replayed, retry.stdout) == (True, first.stdout)
        assert await new_a.files.read("/root/log") == "step\n"
        assert await new_b.files.read("/root/b.txt") == "bee"
        assert new_a.info.labels["role"] == "a"
        assert new_b.info.disk == 32 << 20
        assert new_a.info.job == "train-1"
        receipts = await new_a.receipts()
        assert [r.action for r in receipts].count("exec") == 1  # inherited; the retry ran nothing
        keyed = await new_a.receipts(action="exec", idempotency_key="s1")
        assert len(keyed) == 1
        assert keyed[0].inherited is True
        assert await new_a.receipts(since=time.time() + 3600) == []
        # a checkpoint restores through the SDK as a fresh sandbox of the same project
        ckpt = await new_b.checkpoint(labels={"k": "v"})
        copy = await AsyncSandbox.restore(ckpt.name, url=url, token=ALPHA, job="train-2")
        assert await copy.files.read("/root/b.txt") == "bee"
        assert sorted(await job.pause()) == sorted([new_a.sandbox_id, new_b.sandbox_id])
        assert sorted(await job.resume()) == sorted([new_a.sandbox_id, new_b.sandbox_id])
        for sb in (new_a, new_b, copy):
            await sb.kill()
        await job.close()
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_abuse_is_contained(url: str, manager: SandboxManager) -> None:
    from lazyfetch.client import socket_path

    sock = str(socket_path(manager.data_dir))

    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA, disk=48 << 20, pids=64,
                                             memory=128 << 20) as victim, \
                await AsyncSandbox.create(REF, url=url, token=ALPHA, disk=48 << 20, pids=64,
                                          memory=128 << 20) as attacker:
            await victim.files.write("/root/secret", "victim's secret")
            # 1 GB of output: the client receives at most output_cap, flagged, and the edge stays up
            flood = await attacker.commands.run("head -c 1000000000 /dev/zero; echo done >&2",
                                                output_cap=1 << 20, timeout=120)
            assert (len(flood.stdout), flood.truncated, flood.exit_code) == (1 << 20, True, 0)
            assert "done" in flood.stderr
            # disk fill stops at the sandbox's own limit
            fill = await attacker.commands.run("dd if=/dev/zero of=/root/fill bs=1M count=200", timeout=60)
            assert "No space left on device" in fill.stderr
            # the other sandbox's files: not through the files API, not through /proc or the host paths
            victim_root = str(manager.boxes / victim.sandbox_id / "rootfs")
            probe = await attacker.commands.run(
                f"cat {victim_root}/root/secret; ls /proc/*/root/root/secret; "
                "grep -l secret /proc/*/root/root/* 2>/dev/null; echo end")
            assert "victim's secret" not in probe.stdout
            # resolved inside the attacker's own root: both name files it does not have
            with pytest.raises(FileNotFound):
                await attacker.files.read(f"/../../../{victim.sandbox_id}/rootfs/root/secret")
            with pytest.raises(FileNotFound):
                await attacker.files.read(f"{victim_root}/root/secret")
            # the host's daemon socket (filesystem path or abstract name) is out of reach
            reach = await attacker.commands.run(
                ["python3", "-c", "import socket, sys\nfor a in (sys.argv[1], '\\0' + sys.argv[1]):\n"
                 "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(a); print('reached')\n"
                 "    except OSError as e:\n        print(e.errno)\n", sock])
            assert "reached" not in reach.stdout
            assert len(reach.stdout.split()) == 2
            # a fork bomb and a memory hog stay inside; both sandboxes keep answering
            await attacker.commands.run("python3 -c 'import os\nwhile 1:\n  try: os.fork()\n  except OSError: pass'",
                                        timeout=5)
            hog = await attacker.commands.run("python3 -c 'b = bytearray(1 << 30)'", timeout=60)
            assert hog.exit_code != 0
            assert (await victim.commands.run("cat /root/secret")).stdout == "victim's secret"
            assert (await attacker.commands.run("echo alive")).stdout == "alive\n"

    asyncio.run(scenario())
    assert Path(sock).is_socket()  # it was there all along, for the host


def test_leaving_the_exec_stream_kills_the_command(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALPHA}"}) as s:
                resp = await s.post(f"{url}/v1/sandboxes/{sb.sandbox_id}/exec",
                                    json={"cmd": "echo started; sleep 300; echo never"})
                assert json.loads(await resp.content.readline())["type"] == "stdout"
                resp.close()  # the client goes away mid-command
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                execs = [r for r in await sb.receipts() if r.action == "exec"]
                if execs:
                    break
                await asyncio.sleep(0.1)
            assert execs[0].details["interrupted"] == "disconnect"
            left = await sb.commands.run(PROCESS_ARGS + " | grep -c '^sleep 300 ' || true")
            assert left.stdout.strip() == "0"

    asyncio.run(scenario())


def test_a_lapsed_lease_is_reaped_and_a_renewed_one_is_not(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        crashed = await AsyncSandbox.create(REF, url=url, token=ALPHA, job="crashy", lease_ttl=1)
        kept = await AsyncSandbox.create(REF, url=url, token=ALPHA, job="steady", lease_ttl=1)
        job = AsyncJob("steady", url=url, token=ALPHA)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(st.id == crashed.sandbox_id for st in manager.list()):
            await job.renew(60)  # the live client keeps renewing; the crashed one stopped
            await asyncio.sleep(0.2)
        assert not any(st.id == crashed.sandbox_id for st in manager.list())
        assert (await kept.commands.run("echo here")).stdout == "here\n"
        await kept.kill()
        # its last sandbox gone, the job is gone: a renew keeps nothing alive and makes no lease
        with pytest.raises(NotFound, match="'alpha/steady' has no sandbox on this host") as gone:
            await job.renew(60)
        assert (gone.value.status, gone.value.code) == (404, "not_found")
        await job.close()
        await crashed.close()

    asyncio.run(scenario())


def test_streamed_upload_and_download_of_a_large_file(url: str, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        for _ in range(80):
            f.write(os.urandom(1 << 20))
    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        assert sb.files.upload("/root/big.bin", src) == 80 << 20
        inside = sb.commands.run("sha256sum /root/big.bin").stdout.split()[0]
        assert inside == hashlib.sha256(src.read_bytes()).hexdigest()
        st = sb.files.stat("/root/big.bin")
        assert (st.type, st.size, st.mode, st.uid) == ("file", 80 << 20, 0o644, 0)
        assert sb.files.stat("/root").type == "dir"
        assert sb.files.exists("/etc/os-release")
        assert not sb.files.exists("/root/nope")
        dst = tmp_path / "back.bin"
        assert sb.files.download("/root/big.bin", dst) == 80 << 20
        assert dst.read_bytes() == src.read_bytes()
        with pytest.raises(FileNotFound):
            sb.files.download("/root/missing", tmp_path / "x")


def test_fncall_through_the_service(url: str) -> None:
    async def scenario() -> None:
        caps = await capabilities(url=url, token=ALPHA)
        assert caps.isolation == ("container", "microvm", "vm")  # this host has QEMU and the guest assets
        assert caps.backends["microvm"]["accel"] in ("tcg", "kvm")
        # processes are checkpointed where a backend provides memory checkpoints (a microVM's RAM)
        assert "memory_checkpoint" in caps.backends["microvm"]["provides"]
        assert "memory_checkpoint" in caps.backends["container"]["lacks"]
        assert caps.checkpoint == {"filesystem": True, "processes": True}
        with pytest.raises(UnsupportedIsolation):
            await AsyncSandbox.create(REF, url=url, token=ALPHA, isolation="gvisor")
        r1 = await call(REF, "echo hi > /tmp/mark; cat /tmp/mark", url=url, token=ALPHA)
        assert (r1.exit_code, r1.stdout) == (0, "hi\n")
        r2 = await call(REF, "cat /tmp/mark", url=url, token=ALPHA)
        assert r2.exit_code != 0  # a fresh layer: the first call's file is gone
        fn = "def add(a, b, scale=1):\n    print('adding')\n    return {'sum': (a + b) * scale}\n"
        r3 = await call(REF, function=fn, args=[2, 3], kwargs={"scale": 10}, url=url, token=ALPHA)
        assert (r3.value, r3.stdout, r3.error) == ({"sum": 50}, "adding\n", None)
        r4 = await call(REF, function="def f():\n    raise ValueError('bad')\n", url=url, token=ALPHA)
        assert r4.value is None
        assert r4.error is not None
        assert "ValueError: bad" in r4.error

    asyncio.run(scenario())


# -- the service process crashes with sandboxes running ----------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_service(data_dir: Path, store_url: str, tokens: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.edge", "--data-dir", str(data_dir),
                             "--store", store_url, "--port", str(port), "--tokens", str(tokens)],
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"service exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("service did not listen within 60 s")


def test_service_crash_with_sandboxes_running_is_reconciled(store_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "edge"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_service(data_dir, store_url, tokens, port)
    try:
        survivor = Sandbox.create(REF, url=url, token=ALPHA, job="long")
        doomed = Sandbox.create(REF, url=url, token=ALPHA)
        survivor.files.write("/root/state", "kept")
        survivor_id, doomed_id = survivor.sandbox_id, doomed.sandbox_id
        survivor.close()
        doomed.close()
        proc.send_signal(signal.SIGKILL)  # the manager dies; crun containers, mounts, daemon stay
        proc.wait()
        mgr = SandboxManager(data_dir, store_url)
        mgr.backend("container").runtime.kill(doomed_id)  # and one sandbox dies while nobody watches
        proc = _start_service(data_dir, store_url, tokens, port)
        again = Sandbox.connect(survivor_id, url=url, token=ALPHA)
        assert again.commands.run("cat /root/state").stdout == "kept"
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(doomed_id, url=url, token=ALPHA)
        assert [c["id"] for c in mgr.backend("container").runtime.list()] == [survivor_id]
        again.kill()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        mgr = SandboxManager(data_dir, store_url)
        mgr.reconcile()
        mgr.close()
    assert_clean(mgr)
    assert kmount.mounts_under(data_dir) == []


def test_resume_checks_quota_for_the_whole_job_first(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        a = await AsyncSandbox.create(REF, url=url, token=BETA, job="pair")
        b = await AsyncSandbox.create(REF, url=url, token=BETA, job="pair")
        job = AsyncJob("pair", url=url, token=BETA)
        run = await job.preempt(grace=0)
        squatter = await AsyncSandbox.create(REF, url=url, token=BETA)  # beta's quota is 2
        with pytest.raises(QuotaExceeded, match="needs 2 more"):
            await AsyncJob.resume_run(run.ref, url=url, token=BETA)
        assert [st.id for st in manager.list(job="beta/pair")] == []  # nothing half-restored
        await squatter.kill()
        resumed = await AsyncJob.resume_run(run.ref, url=url, token=BETA)
        assert sorted(resumed.sandboxes) == sorted([a.sandbox_id, b.sandbox_id])
        for sid in resumed.sandboxes.values():
            await (await AsyncSandbox.connect(sid, url=url, token=BETA)).kill()
        await job.close()
        await a.close()
        await b.close()

    asyncio.run(scenario())
