"""Profile: what a sandbox create + exec + destroy cycle costs, phase by phase, as the host holds more.

Publishes the fixture's ``python`` image to a ``file://`` store under a temp dir, then for
each count of ``--held`` (e.g. ``0,1600,3200``) creates and holds sandboxes up to it and
times ``--cycles`` create + ``/bin/true`` + destroy cycles, ``--workers`` at a time: the
medians of the three, of the crun commands inside them (create, start, exec, delete), and
the cycles per second.  The last row's ratio to the
first says what grows with the number held (bench/README.md, "Manager operations were
O(number of sandboxes)").  ``--profile`` also runs as many cycles again at the last count
under cProfile (the calling thread only) and prints the top functions by own time.
Everything it made is destroyed and removed at exit.

    .venv/bin/python bench/profile_create.py --held 0,1600,3200
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from converters.publish import publish_sync  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from sandbox.backends.container.runtime import OciRuntime  # noqa: E402
from sandbox.host.manager import Sandbox, SandboxManager  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "debian-bookworm.oci.tar"
REF = "profile/python"
PHASES = ("create", "exec", "destroy", "crun create", "crun start", "crun run", "crun exec", "crun delete")
Timings = dict[str, list[float]]


def timing_crun(into: Timings) -> Callable[[], None]:
    """Time each crun command the manager runs into ``into``; returns the undo."""
    originals = {name: getattr(OciRuntime, name) for name in ("create", "start", "run", "exec", "delete")
                 if hasattr(OciRuntime, name)}  # (run: since create + start became one crun process)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into[f"crun {name}"].append(time.perf_counter() - t0)
        return wrapper

    for name, fn in originals.items():
        setattr(OciRuntime, name, timed(name, fn))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(OciRuntime, name, fn)
    return undo


async def cycles(mgr: SandboxManager, n: int, into: Timings, workers: int = 1) -> float:
    """``n`` create + exec + destroy cycles by ``workers`` at once; cycles per second."""
    left = [n]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            box = await mgr.create(REF)
            t1 = time.perf_counter()
            await asyncio.to_thread(box.exec, ["/bin/true"])
            t2 = time.perf_counter()
            await asyncio.to_thread(mgr.destroy, box.id)
            into["create"].append(t1 - t0)
            into["exec"].append(t2 - t1)
            into["destroy"].append(time.perf_counter() - t2)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return n / (time.perf_counter() - start)


def row(held: int, timings: Timings, rate: float) -> list[str]:
    return [str(held), *(f"{statistics.median(timings[p]) * 1000:.1f}" if timings[p] else "-" for p in PHASES),
            f"{rate:.1f}"]


async def run(args: argparse.Namespace, work: Path) -> None:
    mgr = SandboxManager(work / "host", f"file://{work}/store")
    held: list[Sandbox] = []
    rows: list[list[str]] = []
    firsts: Timings | None = None
    try:
        for target in args.held:
            while len(held) < target:
                held.append(await mgr.create(REF))
            timings: Timings = defaultdict(list)
            undo = timing_crun(timings)
            try:
                rate = await cycles(mgr, args.cycles, timings, args.workers)
            finally:
                undo()
            rows.append(row(len(held), timings, rate))
            firsts = firsts or timings
            print("  ".join(rows[-1]), flush=True)
        header = ["held", *(f"{p} ms" for p in PHASES), "cycles/s"]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        print(f"\nmedians of {args.cycles} create + exec /bin/true + destroy cycles at each count held, "
              f"{args.workers} at a time")
        for r in [header, *rows]:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if len(rows) > 1 and firsts is not None:
            last = timings
            print("last/first: " + ", ".join(
                f"{p} {statistics.median(last[p]) / statistics.median(firsts[p]):.2f}x"
                for p in PHASES if last[p] and firsts[p]))
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            await cycles(mgr, args.cycles, defaultdict(list))
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    finally:
        mgr.close()  # every sandbox, the layer mounts and the daemon with its holder


def counts(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: counts separated by commas, e.g. 0,1600,3200") from None
    if not out or out[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: counts of 0 or more")
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="bench/profile_create.py", description=__doc__.splitlines()[0])
    p.add_argument("--held", type=counts, default=[0, 300], help="sandboxes held while timing, comma-separated "
                   "(default 0,300)")
    p.add_argument("--cycles", type=int, default=10, help="timed cycles per count (default 10)")
    p.add_argument("--workers", type=int, default=1, help="cycles at once (default 1; the issue's rate: 2)")
    p.add_argument("--profile", action="store_true", help="also profile as many cycles at the last count")
    p.add_argument("--top", type=int, default=25, help="functions printed with --profile (default 25)")
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
