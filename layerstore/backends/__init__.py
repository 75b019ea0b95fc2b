"""Store backends and the one place that assembles them: :func:`open_backend`.

=====================  ==============================================
URL                    backend
=====================  ==============================================
``file:///path``       :class:`~layerstore.backends.posix.PosixBackend`
``/path``              the same (an absolute path)
``s3://bucket/prefix`` :class:`~layerstore.backends.s3.S3Backend`
=====================  ==============================================
"""

from __future__ import annotations

import os
import re
import urllib.parse

from layerstore.backend import Backend, BackendError, check_key
from layerstore.backends.posix import PosixBackend
from layerstore.backends.wrappers import LimitedBackend, RetryingBackend

__all__ = ["InvalidStoreURL", "open_backend"]

SUPPORTED = "file:///absolute/path (or just /absolute/path), s3://bucket[/prefix]"
# S3's rules for new buckets (dots allowed, as MinIO and Ceph accept them too).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class InvalidStoreURL(BackendError, ValueError):
    """A store URL this module cannot open; the message lists the supported forms."""


def open_backend(
    url: str,
    *,
    s3_endpoint: str | None = None,
    region: str | None = None,
    max_concurrency: int = 16,
    retries: int = 5,
    connect_timeout: float = 5.0,
    read_timeout: float = 30.0,
) -> Backend:
    """The backend for ``url``, wrapped as every caller should use it.

    ``RetryingBackend(LimitedBackend(backend, max_concurrency))``: a retry's
    back-off does not hold one of the ``max_concurrency`` slots.  ``retries``
    is how often a retryable failure is retried (0: never).  For S3,
    ``s3_endpoint`` defaults to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    (botocore reads them) and then AWS; ``region`` to the AWS configuration,
    then ``us-east-1``; the timeouts bound connecting and each wait for data
    (a stalled server fails the attempt after ``read_timeout`` seconds).
    Nothing connects until the first call.
    """
    if retries < 0:
        raise ValueError(f"retries must be 0 or more, not {retries}")
    backend: Backend
    if url.startswith("/"):
        backend = PosixBackend(url)
    else:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "file":
            backend = PosixBackend(_file_path(url, parts))
        elif parts.scheme == "s3":
            from layerstore.backends.s3 import S3Backend  # boto3 is slow to import: only when used

            bucket, prefix = _s3_location(url, parts)
            backend = S3Backend(bucket, prefix, endpoint_url=s3_endpoint, region=region,
                                connect_timeout=connect_timeout, read_timeout=read_timeout,
                                max_connections=max_concurrency)
        else:
            raise InvalidStoreURL(f"unsupported store URL {_redact(url)!r}: use {SUPPORTED}")
    backend = LimitedBackend(backend, max_concurrency)
    if retries:
        backend = RetryingBackend(backend, attempts=retries + 1)
    return backend


def _file_path(url: str, parts: urllib.parse.SplitResult) -> str:
    if parts.netloc not in ("", "localhost"):
        raise InvalidStoreURL(f"store URL {url!r} names host {parts.netloc!r}: a file URL is a path "
                              "on this host (mount the shared filesystem and use file:///mountpoint/...)")
    if parts.query or parts.fragment:
        raise InvalidStoreURL(f"store URL {url!r}: file URLs take no '?' or '#' part")
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise InvalidStoreURL(f"store URL {url!r} has no absolute path: use {SUPPORTED}")
    return os.path.normpath(path)


def _s3_location(url: str, parts: urllib.parse.SplitResult) -> tuple[str, str]:
    if "@" in parts.netloc:
        raise InvalidStoreURL(f"store URL {_redact(url)!r} carries credentials: remove them and set "
                              "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile instead")
    bucket = parts.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise InvalidStoreURL(f"store URL {url!r}: {bucket!r} is not a valid bucket name "
                              "(3-63 lowercase letters, digits, '.' and '-'): use s3://bucket[/prefix]")
    if parts.query or parts.fragment:
        raise InvalidStoreURL(f"store URL {url!r}: s3 URLs take no '?' or '#' part")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except BackendError as exc:
            raise InvalidStoreURL(f"store URL {url!r}: prefix {prefix!r} is not a valid key path") from exc
    return bucket, prefix


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
