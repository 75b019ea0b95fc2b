"""The generated protobuf and gRPC modules of ``snapshots.proto``.

They are generated, not committed: ``make venv`` (and the first import in a
checkout without them) runs grpc_tools' protoc into ``_generated/`` beside the
.proto, so the stubs always match the installed protobuf runtime.  A checkout
that cannot be written (an installed package) generates into a private
temporary directory instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from layerstore.hoststate import flocked
from snapshots.errors import SnapshotError

HERE = Path(__file__).resolve().parent
PROTO = HERE / "snapshots.proto"
OUT = HERE / "_generated"


class StubsUnavailable(SnapshotError):
    """protoc could not generate the gRPC modules of ``snapshots.proto`` (the next import tries again)."""

    fix = "reinstall grpcio-tools matching the installed grpcio and protobuf (make venv)"


def _generate(out: Path) -> None:
    from grpc_tools import protoc  # build-time tool; imported only when generating

    out.mkdir(parents=True, exist_ok=True)
    with flocked(out / ".lock"):  # 0600: an importer's start is never another user's to stall
        stamp = out / ".source"
        source = PROTO.read_bytes()
        if stamp.exists() and stamp.read_bytes() == source and (out / "snapshots_pb2_grpc.py").exists():
            return
        include = Path(protoc.__file__).resolve().parent / "_proto"
        code = protoc.main(["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out}",
                            f"--grpc_python_out={out}", str(PROTO)])
        if code != 0:
            raise StubsUnavailable(f"protoc failed ({code}) on {PROTO} writing into {out} (its messages are "
                                   f"on stderr): {StubsUnavailable.fix}")
        tmp = stamp.with_suffix(".tmp")
        tmp.write_bytes(source)
        os.replace(tmp, stamp)


def _load() -> tuple[ModuleType, ModuleType]:
    out = OUT
    try:
        _generate(out)
    except OSError:
        out = Path(tempfile.mkdtemp(prefix="layerbox-grpc-"))
        _generate(out)
    # the generated grpc module imports `snapshots_pb2` by its bare name
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("snapshots_pb2")
        grpc_mod = importlib.import_module("snapshots_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return pb2, grpc_mod


pb, rpc = _load()

if __name__ == "__main__":  # `python -m snapshots.containerd.grpcapi`: generate now (make venv)
    print(f"generated {OUT}")
