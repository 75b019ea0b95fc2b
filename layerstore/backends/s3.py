"""A store in an S3 bucket (AWS S3, MinIO, Ceph RGW, moto) through boto3.

Object ``k`` is ``<prefix>/k`` in the bucket.  Endpoint, region and
credentials come from the usual AWS configuration (environment, profile,
instance role); botocore itself reads ``AWS_ENDPOINT_URL_S3`` and
``AWS_ENDPOINT_URL`` when no endpoint is given.

- One boto3 client per backend, created on first use in a worker thread
  (never at import: it reads files and takes ~50 ms).  Every boto3 call,
  including reading a response body, runs in this backend's own thread pool
  (one thread per connection), through :meth:`S3Backend._call`, which also
  maps every botocore error in one place (:meth:`S3Backend._error`).  Not
  ``asyncio.to_thread``: its shared default pool has ``min(32, cpus + 4)``
  threads (6 on a 2-core host), which would cap S3 concurrency below the
  connection pool, and a stalled store would starve every other user of it.
- botocore's own retries are off (one attempt): ``RetryingBackend`` is the
  single place that retries, so attempts are counted and logged once.
- Payload checksums are only sent where S3 requires them (botocore >= 1.36
  sends CRC32 trailers by default, which several S3-compatible servers
  reject); content is verified against its blake3 name above this layer.
- Objects from ``multipart_threshold`` bytes up are uploaded in parts of
  ``part_size`` (sequentially; a failed upload is aborted, and a retry
  starts a new one).  ``put_if_absent`` of a large object checks ``head``
  first (no upload when it exists), completes the upload with
  ``If-None-Match: *`` and checks the size after (Ceph RGW ignores the
  condition on completion; large objects are content-addressed packs).
  ``put_conditional`` is always a single PUT with ``If-Match``/``If-None-Match``
  (refs are small; S3 allows 5 GiB).
- S3 servers differ in what they do with conditional writes (README, "S3
  compatibility"): ``If-Match`` is sent with the ETag quoted, as S3 returns it;
  when a server refuses that although the object still has that ETag (Ceph
  RGW 16), :meth:`S3Backend.probe_conditional_writes` measures on scratch
  objects which spelling the server honours *and enforces* and the backend
  uses that one from then on.  A 5xx answer to a conditional write is a
  conflict when the object has changed (RGW answers some losers of a race
  500) and a retryable error when it has not.
- Etags are S3's ``ETag`` strings (quotes included), mtimes S3's
  ``LastModified`` in whole seconds (``list`` answers milliseconds, ``HEAD``
  seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from botocore import exceptions as bx

from layerstore.backend import (
    Backend,
    BackendError,
    CredentialsError,
    Leftovers,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    TransientError,
    check_key,
    check_prefix,
    check_range,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MULTIPART_THRESHOLD = 64 << 20
PART_SIZE = 16 << 20
MAX_SINGLE_PUT = 5 << 30

_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "TooManyRequestsException", "RequestLimitExceeded", "OperationAborted",
}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "InvalidSecurity", "AccountProblem", "AllAccessDisabled",
    "ExpiredTokenException", "UnrecognizedClientException", "InvalidClientTokenId",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or a "
                    "profile (AWS_PROFILE) allowed to use the bucket; check the endpoint")


class NoSuchBucket(BackendError):
    """The store's bucket does not exist (at this endpoint)."""


class _RangeNotSatisfiable(BackendError):
    """HTTP 416: the range starts at or past the end (handled inside ``get``)."""


class _ConditionalConflict(TransientError):
    """HTTP 409 ConditionalRequestConflict: a concurrent conditional write; worth retrying."""


class _ServerError(TransientError):
    """HTTP 5xx.  After a conditional write it may also be a lost race (Ceph RGW answers some
    losers of parallel ``If-Match`` writes 500, not 412): ``put_conditional`` looks."""


class ConditionalWritesUnsupported(BackendError):
    """The server honours no spelling of ``If-Match`` that it also enforces: refs cannot be moved
    safely on it (``layerbox store check`` says what it does)."""


Spelling = Literal["quoted", "bare"]


def _spell(etag: str, spelling: Spelling) -> str:
    bare = etag.strip('"')
    return f'"{bare}"' if spelling == "quoted" else bare


def _same_etag(a: str, b: str) -> bool:
    return a.strip('"') == b.strip('"') and bool(a.strip('"'))


@dataclass(frozen=True)
class ConditionalSupport:
    """What one S3 server does with conditional writes, as :meth:`S3Backend.probe_conditional_writes`
    measured it on a scratch object.  ``spelling`` is the ``If-Match`` form to send: the first of
    quoted (as S3 documents and returns ETags) and bare that the server both honours (a matching
    ETag writes) and enforces (a stale one is refused); None when neither is both."""

    if_none_match: bool  # PUT If-None-Match: * refuses an existing key
    if_match_quoted: bool  # If-Match with the ETag as returned (quoted) writes
    if_match_bare: bool  # ... with the ETag without its quotes
    stale_quoted_refused: bool  # a stale ETag is refused, quoted
    stale_bare_refused: bool  # ... and bare
    missing_if_match: str  # If-Match on a missing key: "404", "412" or "written"
    multipart_if_none_match: bool  # CompleteMultipartUpload honours If-None-Match: *
    multipart_etag: bool  # CompleteMultipartUpload answers a non-empty ETag

    @property
    def spelling(self) -> Spelling | None:
        if self.if_match_quoted and self.stale_quoted_refused:
            return "quoted"
        if self.if_match_bare and self.stale_bare_refused:
            return "bare"
        return None

    def problems(self) -> list[str]:
        """What layerbox cannot rely on here, and what it does instead; empty on a full S3."""
        out = []
        if not self.if_none_match:
            out.append("PUT If-None-Match: * overwrites an existing key: new refs and locks are not safe "
                       "against concurrent writers (unsupported)")
        if self.spelling is None:
            out.append("no If-Match spelling is both honoured and enforced: moving an existing ref is "
                       "refused (unsupported)")
        elif self.spelling == "bare":
            out.append("If-Match with the ETag quoted, as S3 returns it, is refused; the bare ETag works "
                       "(layerbox sends it bare here)")
        if self.missing_if_match == "written":
            out.append("If-Match on a missing key writes it (unsupported: a deleted ref could be recreated "
                       "by a stale writer)")
        if not self.multipart_if_none_match:
            out.append("CompleteMultipartUpload ignores If-None-Match: * (large objects are content-"
                       "addressed, so a racing duplicate writes the same bytes; layerbox checks the size "
                       "after every such upload)")
        if not self.multipart_etag:
            out.append("CompleteMultipartUpload answers an empty ETag (layerbox does not use it)")
        return out


class S3Backend(Backend):
    """Objects under ``prefix/`` in ``bucket``; see the module docstring."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_connections: int = 16,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        part_size: int = PART_SIZE,
    ) -> None:
        if part_size < 5 << 20:
            raise ValueError(f"S3 parts must be at least 5 MiB, not {part_size}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url
        self.region = region
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._spelling: Spelling = "quoted"  # If-Match as S3 documents it, until the server says otherwise
        self._support: ConditionalSupport | None = None
        self._probe_lock = asyncio.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._bucket_seen = False

    def __repr__(self) -> str:
        return f"S3Backend({self.url!r}, endpoint={self.endpoint})"

    @property
    def endpoint(self) -> str:
        """The endpoint for messages: no credentials, AWS's default before first use."""
        url = self._client.meta.endpoint_url if self._client is not None else self.endpoint_url
        if not url:
            return "the default AWS endpoint"
        parts = urllib.parse.urlsplit(url)
        netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    # -- the one bridge to boto3 -----------------------------------------------------------
    def _get_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session()
                config = Config(
                    region_name=self.region or session.region_name or "us-east-1",
                    connect_timeout=self.connect_timeout,
                    read_timeout=self.read_timeout,
                    retries={"mode": "standard", "total_max_attempts": 1},
                    max_pool_connections=self.max_connections,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    user_agent_appid="layerbox",
                )
                self._client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
            return self._client

    async def _call(self, op: str, key: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)`` in this backend's threads; botocore errors become BackendErrors."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_connections, thread_name_prefix="layerbox-s3")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(self._get_client()))
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise self._error(exc, op, key) from exc

    def _error(self, exc: Exception, op: str, key: str) -> BackendError:
        """The one mapping from botocore errors to the Backend's errors."""
        where = f"{self.url}: {op} {key!r}"
        if isinstance(exc, bx.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            message = error.get("Message", "")
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            said = f"{code or 'HTTP ' + str(status)}{': ' + message if message else ''}"
            if code == "NoSuchBucket":
                return self._no_bucket()
            if code in _NOT_FOUND_CODES or (status == 404 and not code):
                return ObjectNotFound(key, self.url)
            if code in ("PreconditionFailed", "412") or status == 412:
                return PreconditionFailed(key, self.url, said)
            if code == "InvalidRange" or status == 416:
                return _RangeNotSatisfiable(f"{where}: {said}")
            if code == "ConditionalRequestConflict":
                return _ConditionalConflict(f"{where}: {said} (HTTP {status})")
            if code in _CREDENTIAL_CODES or status == 403:
                return CredentialsError(f"{where}: S3 at {self.endpoint} refused the request "
                                        f"({said}): {_CREDENTIALS_FIX}")
            if status >= 500:
                return _ServerError(f"{where}: {said} (HTTP {status}) from {self.endpoint}")
            if code in _TRANSIENT_CODES or status == 429:
                return TransientError(f"{where}: {said} (HTTP {status}) from {self.endpoint}")
            return BackendError(f"{where}: {said} (HTTP {status}) from {self.endpoint}")
        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError,
                            bx.CredentialRetrievalError)):
            return CredentialsError(f"{where}: {exc}: {_CREDENTIALS_FIX}")
        if isinstance(exc, bx.SSLError):
            return BackendError(f"{where}: TLS with {self.endpoint} failed: {exc}; check the "
                                "endpoint URL and its certificate (AWS_CA_BUNDLE)")
        if isinstance(exc, bx.ReadTimeoutError):
            return TransientError(f"{where}: {self.endpoint} sent nothing for "
                                  f"{self.read_timeout:g} s (read timeout)")
        if isinstance(exc, bx.ConnectTimeoutError):
            return TransientError(f"{where}: could not connect to {self.endpoint} within "
                                  f"{self.connect_timeout:g} s")
        if isinstance(exc, bx.EndpointConnectionError):
            return TransientError(f"{where}: could not connect to {self.endpoint}: check the "
                                  "endpoint (AWS_ENDPOINT_URL_S3) and that the service is up")
        if isinstance(exc, (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError)):
            return TransientError(f"{where}: connection to {self.endpoint} failed: {exc}")
        return BackendError(f"{where}: {exc}")

    def _no_bucket(self) -> NoSuchBucket:
        endpoint = self.endpoint
        option = "" if "amazonaws.com" in endpoint or " " in endpoint else f" --endpoint-url {endpoint}"
        fix = f"create it (aws s3 mb s3://{self.bucket}{option}) or fix the store URL"
        return NoSuchBucket(f"{self.url}: bucket {self.bucket!r} does not exist at {endpoint}: {fix}", fix=fix)

    def _key(self, key: str) -> str:
        return self._root + key

    async def _check_bucket(self) -> None:
        """After a bare 404 (HEAD has no error body): tell a missing bucket from a missing key."""
        if self._bucket_seen:
            return

        def head_bucket(client: Any) -> None:
            try:
                client.head_bucket(Bucket=self.bucket)
            except bx.ClientError as exc:
                if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    raise self._no_bucket() from exc
                raise

        await self._call("head_bucket", "", head_bucket)
        self._bucket_seen = True

    # -- reads -------------------------------------------------------------------------------
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        check_key(key)
        check_range(start, end)
        lo = start or 0
        if end is not None and end <= lo:
            if await self.head(key) is None:
                raise ObjectNotFound(key, self.url)
            return b""
        extra = {}
        if lo or end is not None:
            extra["Range"] = f"bytes={lo}-{'' if end is None else end - 1}"

        def get_object(client: Any) -> bytes:
            response = client.get_object(Bucket=self.bucket, Key=self._key(key), **extra)
            with contextlib.closing(response["Body"]) as body:
                data: bytes = body.read()  # raises IncompleteReadError if short
                return data

        try:
            data = await self._call("get", key, get_object)
        except _RangeNotSatisfiable:
            return b""  # the object exists and the range starts at or past its end
        self._bucket_seen = True
        return data

    async def head(self, key: str) -> ObjectInfo | None:
        check_key(key)

        def head_object(client: Any) -> ObjectInfo:
            r = client.head_object(Bucket=self.bucket, Key=self._key(key))
            return ObjectInfo(key, r["ContentLength"], r["ETag"], r["LastModified"].timestamp())

        try:
            info = await self._call("head", key, head_object)
        except ObjectNotFound:
            await self._check_bucket()
            return None
        self._bucket_seen = True
        return info

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        check_prefix(prefix)
        pages = await self._call("list", prefix, lambda client: iter(
            client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._root + prefix)))
        skip = len(self._root)
        while True:
            page = await self._call("list", prefix, lambda _client: next(pages, None))
            if page is None:
                return
            self._bucket_seen = True
            for item in page.get("Contents", ()):
                key = item["Key"][skip:]
                try:
                    check_key(key)
                except BackendError:
                    log.debug("%s: ignoring object %r: not a valid store key", self.url, item["Key"])
                    continue
                # whole seconds, as HEAD's Last-Modified (an HTTP date) has them: RGW and AWS list
                # with milliseconds, and one object must not have two mtimes
                yield ObjectInfo(key, item["Size"], item["ETag"], float(int(item["LastModified"].timestamp())))

    # -- writes --------------------------------------------------------------------------------
    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        if len(data) >= self.multipart_threshold:
            await self._multipart("put", key, data, {})
        else:
            await self._put_object("put", key, data, {})

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        try:
            if len(data) >= self.multipart_threshold:
                if await self.head(key) is not None:
                    return False  # do not upload what is there
                await self._multipart("put_if_absent", key, data, {"IfNoneMatch": "*"})
                # Ceph RGW completes an upload over an existing key despite If-None-Match: a
                # writer racing us may have replaced our bytes.  Large objects are packs, named
                # by their content, so what is there must at least be as long as ours.
                info = await self.head(key)
                if info is None or info.size != len(data):
                    raise BackendError(
                        f"{self.url}: put_if_absent {key!r}: after the upload the object is "
                        f"{'gone' if info is None else f'{info.size} bytes'}, not the {len(data)} written: "
                        "another writer put different bytes under this key at the same time")
            else:
                await self._put_object("put_if_absent", key, data, {"IfNoneMatch": "*"})
        except PreconditionFailed:
            return False
        return True

    async def put_conditional(self, key: str, data: bytes, if_match: str | None) -> str:
        check_key(key)
        if len(data) > MAX_SINGLE_PUT:
            raise BackendError(f"{self.url}: put_conditional {key!r}: {len(data)} bytes is more "
                               "than one S3 PUT can carry (5 GiB)")
        spelling = self._spelling
        try:
            return await self._put_once(key, data, if_match, spelling)
        except PreconditionFailed:
            if if_match is None or self._support is not None:
                raise
            # Ceph RGW refuses If-Match with the ETag quoted as it returns it, moto the bare
            # one: when the object still has our ETag the spelling was refused, not the
            # version.  Which spelling the server honours and enforces is measured once on a
            # scratch object, never assumed: a server that ignored a spelling would turn
            # every conflict into a silent overwrite.
            info = await self.head(key)
            if info is None or not _same_etag(info.etag, if_match):
                raise
            support = await self.probe_conditional_writes()
            chosen = support.spelling
            if chosen is None:
                raise ConditionalWritesUnsupported(
                    f"{self.url}: put_conditional {key!r}: {self.endpoint} honours no If-Match spelling "
                    "that it also enforces, so refs cannot be moved safely on it; `layerbox store check` "
                    "reports what it supports") from None
            if chosen == spelling:
                raise
            return await self._put_once(key, data, if_match, chosen)

    async def _put_once(self, key: str, data: bytes, if_match: str | None, spelling: Spelling) -> str:
        condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": _spell(if_match, spelling)}
        try:
            return await self._put_object("put_conditional", key, data, condition)
        except ObjectNotFound:  # If-Match on a missing key
            raise PreconditionFailed(key, self.url, f"it no longer exists (expected {if_match})") from None
        except _ConditionalConflict as exc:  # 409: lost to a concurrent conditional write
            raise PreconditionFailed(key, self.url, str(exc)) from exc
        except _ServerError as exc:
            # unchanged: a server error, retried as any; changed: a lost race (or our own write
            # landing before the error), a conflict the caller re-reads (Store.set_ref knows its
            # own bytes)
            info = await self.head(key)
            unchanged = info is None if if_match is None else info is not None and _same_etag(info.etag, if_match)
            if unchanged:
                raise
            raise PreconditionFailed(key, self.url, f"{exc}; the object has changed since") from exc

    async def probe_conditional_writes(self) -> ConditionalSupport:
        """Measure what this server does with conditional writes, on scratch objects under
        ``probes/`` (removed after; docs/FORMAT.md).  Remembered for this backend: ``put_conditional``
        then sends the spelling the server honours."""
        async with self._probe_lock:
            if self._support is None:
                self._support = await self._probe()
                self._spelling = self._support.spelling or "quoted"
                log.info("%s: conditional writes at %s: %s", self.url, self.endpoint,
                         "; ".join(self._support.problems()) or "all supported")
            return self._support

    async def _probe(self) -> ConditionalSupport:
        key = f"probes/conditional-{uuid.uuid4().hex}"
        missing = f"probes/conditional-{uuid.uuid4().hex}"
        n = 0

        async def attempt(condition: dict[str, str]) -> bool:
            """One PUT of new bytes under ``condition``: True when it wrote."""
            nonlocal n
            n += 1
            try:
                await self._put_object("probe", key, f"probe {n}".encode(), condition)
            except (PreconditionFailed, ObjectNotFound, _ConditionalConflict):
                return False
            return True

        async def etag() -> str:
            info = await self.head(key)
            if info is None:
                raise BackendError(f"{self.url}: probe object {key!r} vanished while probing")
            return info.etag

        try:
            if not await attempt({"IfNoneMatch": "*"}):
                raise BackendError(f"{self.url}: could not create the probe object {key!r}")
            first = await etag()
            if_none_match = not await attempt({"IfNoneMatch": "*"})
            stale = first if not if_none_match else ""
            current = await etag()
            if not stale:  # the refused write left the first version: make it stale now
                await self._put_object("probe", key, b"probe stale", {})
                stale, current = current, await etag()
            results: dict[Spelling, tuple[bool, bool]] = {}
            for spelling in ("quoted", "bare"):
                honoured = await attempt({"IfMatch": _spell(current, spelling)})
                refused = not await attempt({"IfMatch": _spell(stale, spelling)})
                current = await etag()
                results[spelling] = (honoured, refused)
            try:
                await self._put_object("probe", missing, b"probe missing", {"IfMatch": _spell(current, "quoted")})
                missing_if_match = "written"
            except ObjectNotFound:
                missing_if_match = "404"
            except PreconditionFailed:
                missing_if_match = "412"
            multipart_refused, multipart_etag = await self._probe_multipart(key)
            return ConditionalSupport(
                if_none_match=if_none_match, if_match_quoted=results["quoted"][0],
                if_match_bare=results["bare"][0], stale_quoted_refused=results["quoted"][1],
                stale_bare_refused=results["bare"][1], missing_if_match=missing_if_match,
                multipart_if_none_match=multipart_refused, multipart_etag=multipart_etag)
        finally:
            for doomed in (key, missing):
                with contextlib.suppress(BackendError):
                    await self.delete(doomed)

    async def _probe_multipart(self, key: str) -> tuple[bool, bool]:
        """(completion with If-None-Match: * refused on an existing key, a completion's ETag non-empty)."""
        name = self._key(key)

        async def one_part_upload(extra: dict[str, str]) -> str:
            created = await self._call("probe", key, lambda client: client.create_multipart_upload(
                Bucket=self.bucket, Key=name))
            upload_id = created["UploadId"]
            try:
                part = await self._call("probe", key, lambda client: client.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=1, Body=b"probe part"))
                done = await self._call("probe", key, lambda client: client.complete_multipart_upload(
                    Bucket=self.bucket, Key=name, UploadId=upload_id,
                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}, **extra))
            except BaseException:
                await self._abort(key, name, upload_id)
                raise
            return str(done.get("ETag") or "").strip('"')

        try:
            await one_part_upload({"IfNoneMatch": "*"})
        except PreconditionFailed:
            refused = True
        else:
            refused = False
        return refused, bool(await one_part_upload({}))

    async def _put_object(self, op: str, key: str, data: bytes, extra: dict[str, str]) -> str:
        response = await self._call(op, key, lambda client: client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, **extra))
        self._bucket_seen = True
        etag: str = response["ETag"]
        return etag

    async def _multipart(self, op: str, key: str, data: bytes, extra: dict[str, str]) -> None:
        name = self._key(key)
        created = await self._call(op, key, lambda client: client.create_multipart_upload(
            Bucket=self.bucket, Key=name))
        upload_id = created["UploadId"]
        try:
            parts = []
            for number, offset in enumerate(range(0, len(data), self.part_size), start=1):
                piece = data[offset:offset + self.part_size]

                def upload_part(client: Any, n: int = number, p: bytes = piece) -> Any:
                    return client.upload_part(Bucket=self.bucket, Key=name, UploadId=upload_id,
                                              PartNumber=n, Body=p)

                uploaded = await self._call(op, key, upload_part)
                parts.append({"PartNumber": number, "ETag": uploaded["ETag"]})
            await self._call(op, key, lambda client: client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, **extra))
        except BaseException:
            await self._abort(key, name, upload_id)
            raise

    async def _abort(self, key: str, name: str, upload_id: str) -> None:
        try:
            await self._call("abort multipart upload", key, lambda client: client.abort_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id))
        except BackendError as exc:
            # The parts stay billed until a lifecycle rule removes them: say which.
            log.warning("%s: could not abort multipart upload %s of %r: %s", self.url, upload_id,
                        key, exc)

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._call("delete", key, lambda client: client.delete_object(
            Bucket=self.bucket, Key=self._key(key)))

    async def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """Abort multipart uploads under the prefix started more than ``older_than`` s ago.

        A killed writer leaves its parts behind (billed, invisible to ``list``);
        S3 gives no "last changed" time, so the age is from the upload's start.
        """
        def uploads(client: Any) -> list[tuple[str, str, float]]:
            out = []
            for page in client.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=self._root):
                for up in page.get("Uploads", []):
                    out.append((up["Key"], up["UploadId"], up["Initiated"].timestamp()))
            return out

        def abort(client: Any, name: str, upload_id: str) -> None:
            client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)

        cutoff = time.time() - older_than
        found: Leftovers = []
        for name, upload_id, started in await self._call("sweep_leftovers", "", uploads):
            if started > cutoff:
                continue
            if not dry_run:
                await self._call("sweep_leftovers", name, functools.partial(abort, name=name, upload_id=upload_id))
            found.append(f"s3://{self.bucket}/{name} (multipart upload {upload_id})")
        return found

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        client = self._client
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(pool, client.close)
        pool.shutdown(wait=False, cancel_futures=True)
