"""The snapshotter's errors, each one gRPC status code containerd maps to its errdefs."""

from __future__ import annotations

import grpc

from snapshots.errors import SnapshotError


class SnapshotterError(SnapshotError):
    code = grpc.StatusCode.INTERNAL


class NotFound(SnapshotterError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SnapshotterError):
    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgument(SnapshotterError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(SnapshotterError):
    code = grpc.StatusCode.FAILED_PRECONDITION
