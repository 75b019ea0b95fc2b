"""The local LMDB metadata cache (layerstore/cache.py) under a process's concurrent users."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Thread A holds LMDB's write transaction while Python code of its own runs inside it (the
# locations add_pack stores come from a generator); meanwhile the main thread opens the same
# cache again, as every Store.open of a service creating or checkpointing sandboxes does.
SCENARIO = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[2])
    from layerstore.cache import MetadataCache
    from layerstore.packs import ChunkLocation

    data_dir, store = sys.argv[1], "file:///nowhere"
    first = MetadataCache(data_dir, store)
    inside = threading.Event()

    def locations():
        inside.set()
        for n in range(20):
            time.sleep(0.01)  # Python code, needing the GIL, inside the write transaction
            yield n.to_bytes(32, "big"), ChunkLocation(b"p" * 32, n, 1, 1)

    writer = threading.Thread(target=first.add_pack, args=(b"p" * 32, locations()))
    writer.start()
    inside.wait()
    opened = [MetadataCache(data_dir, store) for _ in range(20)]
    writer.join()
    assert all(c.locate((19).to_bytes(32, "big")) is not None for c in opened)
    for c in (first, *opened):
        c.close()
    print("done")
""")


def test_opening_the_cache_while_another_thread_writes_never_deadlocks(tmp_path: Path) -> None:
    """open_db without a transaction began a write transaction holding the GIL, and waited for the
    writer lock that the other thread could not release without the GIL: 200 concurrent
    checkpoints hung the suite.  The databases are now opened once, with the environment."""
    try:
        out = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path), str(REPO)], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("opening the cache beside a write transaction hung (a deadlock)") from exc
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
