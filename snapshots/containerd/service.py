"""The snapshotter as containerd's proxy plugin: the ``containerd.services.snapshots.v1.Snapshots``
gRPC service on a unix socket.

containerd (1.6 and 2.x) is configured with::

    [proxy_plugins.layerbox]
      type = "snapshot"
      address = "/run/layerbox/snapshotter.sock"

Every request field is checked once here or in the snapshotter (a key is a
non-empty string of at most 4096 characters; labels at most 64 KiB); errors
go back as the gRPC status containerd maps to its errdefs (NOT_FOUND,
ALREADY_EXISTS, FAILED_PRECONDITION, INVALID_ARGUMENT).  The socket is made
0600 in a 0700 directory: who can reach it can mount any layer of the store.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import empty_pb2

from layerstore.hoststate import make_private_dirs
from snapshots.containerd.errors import InvalidArgument, SnapshotterError
from snapshots.containerd.grpcapi import pb, rpc
from snapshots.containerd.metadata import Snapshot
from snapshots.containerd.snapshotter import Mount, Snapshotter

log = logging.getLogger("layerbox.snapshotter")
T = TypeVar("T")
LIST_BATCH = 100  # Infos per List message, as containerd's own proxy server sends them
WORKERS = 16


def _mounts(mounts: list[Mount]) -> list[Any]:
    return [pb.Mount(type=m.type, source=m.source, options=list(m.options)) for m in mounts]


def _info(snap: Snapshot) -> Any:
    info = pb.Info(name=snap.key, parent=snap.parent, kind=snap.kind, labels=snap.labels)
    info.created_at.FromNanoseconds(snap.created)
    info.updated_at.FromNanoseconds(snap.updated)
    return info


class Service(rpc.SnapshotsServicer):  # type: ignore[name-defined]
    def __init__(self, snapshotter: Snapshotter) -> None:
        self.sn = snapshotter

    def _run(self, context: grpc.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except SnapshotterError as exc:
            context.abort(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to containerd, logged whole here
            log.exception("%s failed", what)
            context.abort(grpc.StatusCode.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: abort raises")

    def Prepare(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC's names
        mounts = self._run(context, "prepare",
                           lambda: self.sn.prepare(request.key, request.parent, dict(request.labels)))
        return pb.PrepareSnapshotResponse(mounts=_mounts(mounts))

    def View(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        mounts = self._run(context, "view",
                           lambda: self.sn.view(request.key, request.parent, dict(request.labels)))
        return pb.ViewSnapshotResponse(mounts=_mounts(mounts))

    def Mounts(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        mounts = self._run(context, "mounts", lambda: self.sn.mounts_of(request.key))
        return pb.MountsResponse(mounts=_mounts(mounts))

    def Commit(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._run(context, "commit", lambda: self.sn.commit(request.name, request.key, dict(request.labels)))
        return empty_pb2.Empty()

    def Remove(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._run(context, "remove", lambda: self.sn.remove(request.key))
        return empty_pb2.Empty()

    def Stat(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        snap = self._run(context, "stat", lambda: self.sn.stat(request.key))
        return pb.StatSnapshotResponse(info=_info(snap))

    def Update(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def update() -> Snapshot:
            if not request.HasField("info"):
                raise InvalidArgument("info: the snapshot to update is missing")
            return self.sn.update(request.info.name, dict(request.info.labels), list(request.update_mask.paths))
        return pb.UpdateSnapshotResponse(info=_info(self._run(context, "update", update)))

    def List(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        snaps = self._run(context, "list", lambda: list(self.sn.walk(list(request.filters))))
        for i in range(0, len(snaps), LIST_BATCH):
            yield pb.ListSnapshotsResponse(info=[_info(s) for s in snaps[i:i + LIST_BATCH]])

    def Usage(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        size, inodes = self._run(context, "usage", lambda: self.sn.usage(request.key))
        return pb.UsageResponse(size=size, inodes=inodes)

    def Cleanup(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._run(context, "cleanup", self.sn.cleanup)
        return empty_pb2.Empty()


def serve(snapshotter: Snapshotter, socket_path: str | os.PathLike[str], *,
          ready: Callable[[], None] | None = None, stop: threading.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop``); the snapshotter's state is reconciled first."""
    sock = Path(socket_path)
    # a directory that is missing is made the snapshotter's own (0700); one that exists is left as
    # it is (`--socket /tmp/x.sock` must not close /tmp): the socket alone is what needs guarding
    make_private_dirs(sock.parent)
    if sock.is_socket() or sock.is_symlink():
        sock.unlink()  # left by a killed predecessor (containerd reconnects to the new one)
    elif sock.exists():
        raise InvalidArgument(f"{sock}: exists and is not a socket; not replaced")
    summary = snapshotter.start()
    log.info("snapshotter at %s: %s", snapshotter.root, summary)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="grpc"))
    rpc.add_SnapshotsServicer_to_server(Service(snapshotter), server)
    old_umask = os.umask(0o077)
    try:
        server.add_insecure_port(f"unix://{sock}")
        server.start()
    finally:
        os.umask(old_umask)
    os.chmod(sock, 0o600)  # connecting needs write permission: root's alone
    done = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: done.set())
    if ready is not None:
        ready()
    try:
        done.wait()
    finally:
        server.stop(grace=5).wait()
        snapshotter.close()
        sock.unlink(missing_ok=True)
