"""Profile: where a sandbox create + exec + destroy cycle spends its time with N sandboxes held.

Publishes the fixture's ``python`` image to a ``file://`` store under a temp
dir, creates and holds ``--held`` sandboxes, times ``--cycles`` create +
``/bin/true`` + destroy cycles, then runs as many again under cProfile and
prints the top functions by own time.  Used to find what grows with the
number held (bench/README.md, "Manager operations were O(number of
sandboxes)").  Everything it made is destroyed and removed at exit.

    .venv/bin/python bench/profile_create.py --held 600
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from converters.publish import publish_sync  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from sandbox.host.manager import Sandbox, SandboxManager  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "debian-bookworm.oci.tar"
REF = "profile/python"


async def cycles(mgr: SandboxManager, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        box = await mgr.create(REF)
        box.exec(["/bin/true"])
        mgr.destroy(box.id)
    return (time.perf_counter() - start) / n


async def run(args: argparse.Namespace, work: Path) -> None:
    url = f"file://{work}/store"
    mgr = SandboxManager(work / "host", url)
    held: list[Sandbox] = []
    try:
        for _ in range(args.held):
            held.append(await mgr.create(REF))
        print(f"{args.held} held: create + exec + destroy {await cycles(mgr, args.cycles) * 1000:.1f} ms per cycle")
        prof = cProfile.Profile()
        prof.enable()
        await cycles(mgr, args.cycles)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    finally:
        for box in held:
            mgr.destroy(box.id)
        mgr.close()


def main() -> int:
    p = argparse.ArgumentParser(prog="bench/profile_create.py", description=__doc__.splitlines()[0])
    p.add_argument("--held", type=int, default=300, help="sandboxes created and held first (default 300)")
    p.add_argument("--cycles", type=int, default=10, help="timed cycles, and as many profiled (default 10)")
    p.add_argument("--top", type=int, default=25, help="functions printed (default 25)")
    p.add_argument("--fixture", type=Path, default=FIXTURE, help=f"the oci-archive (default {FIXTURE})")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), help="where the store and data dir go")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lb-profile-", dir=args.tmpdir))
    try:
        publish_sync(f"oci-archive:{args.fixture}:python", REF, store=f"file://{work}/store", data_dir=work / "pub")
        asyncio.run(run(args, work))
    finally:
        left = kmount.mounts_under(work)
        for mp in left:
            kmount.umount(mp, lazy=True, missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        print(f"cleanup: {len(left)} mounts were left and removed; {work} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
