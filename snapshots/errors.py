"""Errors of checkpoint and restore."""

from __future__ import annotations

from layerstore.errors import LayerboxError


class SnapshotError(LayerboxError):
    pass


class CheckpointMismatch(SnapshotError):
    """A checkpoint's bound digests or versions do not match: restoring would be unsafe."""
