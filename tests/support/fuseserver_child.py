"""A FUSE server process for tests/test_fuseserver.py: serves a directory of blobs.

    python tests/support/fuseserver_child.py DIR PID:FD [--resumed] [--stall-after N]

Takes the /dev/fuse fd from process PID (pidfd_getfd), as a restarted daemon
takes it from its holder, and serves DIR's blobs until unmounted.  With
``--stall-after N`` every read after the first N blocks forever, after printing
``stalled OFFSET`` on stdout: the test then knows requests are in flight.  The
server's log goes to stdout too (``INFO:lazyfetch.fuseserver:request ... resent``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lazyfetch.fuseserver import DirectorySource, FuseServer, take_fd  # noqa: E402


class Stalling(DirectorySource):
    def __init__(self, path: str, stall_after: int) -> None:
        super().__init__(path)
        self._left = stall_after
        self._count = threading.Lock()
        self._never = threading.Event()

    def read(self, name: str, offset: int, size: int) -> bytes:
        with self._count:
            self._left -= 1
            stall = self._left < 0
        if stall:
            print(f"stalled {offset}", flush=True)
            self._never.wait()
        return super().read(name, offset, size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("holder", help="PID:FD of the process holding the /dev/fuse fd")
    parser.add_argument("--resumed", action="store_true")
    parser.add_argument("--stall-after", type=int)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)  # the test reads the log
    pid, fd = (int(x) for x in args.holder.split(":"))
    source = (DirectorySource(args.dir) if args.stall_after is None
              else Stalling(args.dir, args.stall_after))
    server = FuseServer(source, take_fd(pid, fd), threads=4)
    server.serve(resumed=args.resumed)


if __name__ == "__main__":
    main()
