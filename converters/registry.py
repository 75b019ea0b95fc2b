"""Pull images from an OCI distribution registry (the ``/v2/`` HTTP API).

The async core is :class:`RegistryClient` (one ``aiohttp.ClientSession``,
opened by ``async with``)::

    async with RegistryClient() as client:
        image = await client.get_manifest("127.0.0.1:5000/fixture/python:latest")
        async with client.open_blob(image.reference, image.layers[0]) as blob:
            async for data in blob:
                ...

Contract:

- Every byte handed out is verified: a manifest fetched by digest must hash to
  that digest (and to the ``Docker-Content-Digest`` the registry announces); a
  config or layer must have the size and digest of its descriptor.  A blob that
  ends short raises :class:`BlobTruncated`, one that runs long
  :class:`BlobSizeMismatch` as soon as the extra byte arrives, and one with the
  right size but the wrong content :class:`BlobDigestMismatch` at its end,
  after the last chunk.  Callers must not commit anything derived from a blob
  before its iteration finished without error.
- Connection errors, 429 and 5xx are retried with backoff until a response is
  good and its first body bytes arrived; after a byte was delivered, an error
  is final (the caller has consumed data it cannot take back).
- Authentication: requests go out anonymously first; a 401 challenge selects
  Bearer (a token from the challenge's realm, cached per host and scope until
  it expires) or Basic.  Credentials come from ``credentials`` (default
  :func:`default_credentials`: ``LAYERBOX_REGISTRY_USER``/``_PASSWORD``,
  ``REGISTRY_AUTH_FILE``, the ``auth.json`` that ``skopeo login`` writes,
  ``~/.docker/config.json``) and are only sent when a registry asks.
- Plain http is used for ``127.0.0.1``, ``localhost``, ``::1`` and hosts listed
  in ``LAYERBOX_INSECURE_REGISTRIES`` (comma separated ``host[:port]``) or
  ``insecure_hosts``; https everywhere else.
- Errors are those of :mod:`converters.ocispec` (the one error tree of
  everything OCI, rooted at ``OciError``): a tag or digest the registry lacks
  is :class:`ManifestNotFound`, transport and HTTP failures derive from
  :class:`RegistryError`; every message names the registry, the repository and
  the tag or digest.  Nothing here prints.
- Manifests, indexes, descriptors, platforms and configs are parsed by
  :mod:`converters.ocispec`, with the same rules as for an image layout.

Synchronous callers (the layer converter) use :class:`SyncRegistryClient`,
which runs a client on an event loop in its own thread, and its
:class:`BlobStream`, a file-like ``read(n)`` over a download in flight that
implements :class:`converters.ocispec.BlobReader`
(``SyncRegistryClient.blobs(ref)`` is the registry's ``BlobSource``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp

from converters.ocispec import (
    DOCKER_HUB,
    DOCKER_HUB_API,
    MANIFEST_ACCEPT,
    MAX_CONFIG_BYTES,
    MAX_INDEX_DEPTH,
    MAX_MANIFEST_BYTES,
    BlobCheck,
    BlobDigestMismatch,
    BlobNotFound,
    BlobSizeMismatch,
    BlobTruncated,
    ClientNotOpen,
    Descriptor,
    ManifestNotFound,
    ManifestTooLarge,
    OciError,
    Platform,
    Reference,
    RegistryAuthError,
    RegistryError,
    RegistryUnavailable,
    UnsupportedImage,
    VerifyingStream,
    check_size,
    index_entries,
    manifest_kind,
    parse_json,
    parse_manifest,
    parse_reference,
    select_platform,
    want_platform,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

STREAM_CHUNK = 256 << 10
CORRUPT_HINT = "the registry's copy is corrupt, or a proxy or the connection altered it; try again"
INSECURE_ENV = "LAYERBOX_INSECURE_REGISTRIES"
USER_ENV = "LAYERBOX_REGISTRY_USER"
PASSWORD_ENV = "LAYERBOX_REGISTRY_PASSWORD"
LOGIN_HINT = "run `skopeo login {host}` or set LAYERBOX_REGISTRY_USER and LAYERBOX_REGISTRY_PASSWORD"
# a token without expires_in lives 60 s (distribution's token spec); renew a little early
DEFAULT_TOKEN_SECONDS = 60
TOKEN_MARGIN_SECONDS = 10
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

_CHALLENGE_PARAM_RE = re.compile(r'\s*([A-Za-z][\w-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))\s*,?')
# -- what get_manifest returns ----------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """One manifest or index document as fetched, verified against its digest."""

    reference: Reference
    digest: str  # of the body as received
    media_type: str
    kind: Literal["index", "manifest"]
    body: bytes
    document: Mapping[str, Any]
    header_digest: str | None  # Docker-Content-Digest, when the registry sent one


@dataclass(frozen=True)
class RegistryImage:
    """An image resolved to one platform's manifest, its config and layers (lowest first).

    ``reference`` is what was asked for; ``pinned`` names the manifest by digest.
    ``index_digest`` is the index the manifest was selected from, if any.
    """

    reference: Reference
    manifest_digest: str
    manifest_media_type: str
    index_digest: str | None
    platform: Platform | None
    config_descriptor: Descriptor
    config: Mapping[str, Any]
    layers: tuple[Descriptor, ...]

    @property
    def config_digest(self) -> str:
        return self.config_descriptor.digest

    @property
    def pinned(self) -> Reference:
        return self.reference.with_digest(self.manifest_digest)


# -- credentials --------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)

    def basic_header(self) -> str:
        """The ``Authorization`` value for HTTP Basic auth."""
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


CredentialSource = Callable[[str], "Credentials | None"]


def _auth_files() -> list[Path]:
    files = []
    if path := os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(path))
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(runtime) / "containers" / "auth.json")
    home = Path.home()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    files.append(config_home / "containers" / "auth.json")
    docker_config = os.environ.get("DOCKER_CONFIG")
    files.append(Path(docker_config) / "config.json" if docker_config else home / ".docker" / "config.json")
    return files


def _auth_key_host(key: str) -> str:
    """``https://index.docker.io/v1/`` -> ``index.docker.io``; ``host:5000`` stays."""
    if "://" in key:
        key = key.split("://", 1)[1]
    return key.split("/", 1)[0]


def _registry_aliases(registry: str) -> set[str]:
    if registry == DOCKER_HUB:
        return {DOCKER_HUB, "index.docker.io", DOCKER_HUB_API}
    return {registry}


def _credentials_from_file(path: Path, registry: str) -> Credentials | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("ignoring unreadable registry auth file %s: %s", path, exc)
        return None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
    aliases = _registry_aliases(registry)
    for key, entry in auths.items():
        if _auth_key_host(str(key)) not in aliases or not isinstance(entry, dict):
            continue
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return Credentials(entry["username"], entry["password"])
        encoded = entry.get("auth")
        if isinstance(encoded, str) and encoded:
            try:
                user, sep, password = base64.b64decode(encoded).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                log.warning("ignoring malformed 'auth' for %s in %s", key, path)
                continue
            if sep:
                return Credentials(user, password)
    return None


def default_credentials(registry: str) -> Credentials | None:
    """Credentials for ``registry`` (``host[:port]`` or ``docker.io``), or ``None``.

    In order: ``LAYERBOX_REGISTRY_USER``/``LAYERBOX_REGISTRY_PASSWORD`` (for
    every registry), ``REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/auth.json``
    (``skopeo login``), ``~/.config/containers/auth.json``, then
    ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``; the first file
    with an ``auths`` entry for the host wins.  Credential helpers
    (``credsStore``) are not consulted.
    """
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user and password is not None:
        return Credentials(user, password)
    for path in _auth_files():
        creds = _credentials_from_file(path, registry)
        if creds is not None:
            log.debug("registry %s: using credentials from %s", registry, path)
            return creds
    return None


def _parse_challenges(headers: Iterable[str]) -> dict[str, dict[str, str]]:
    """``WWW-Authenticate`` values -> ``{"bearer": {"realm": ..., ...}, "basic": {...}}``."""
    found: dict[str, dict[str, str]] = {}
    for header in headers:
        scheme, _, rest = header.strip().partition(" ")
        params = {}
        for m in _CHALLENGE_PARAM_RE.finditer(rest):
            value = m.group(2) if m.group(2) is not None else m.group(3)
            params[m.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
        found.setdefault(scheme.lower(), params)
    return found


@dataclass
class _Token:
    value: str
    expires: float  # time.monotonic()


def _error_detail(body: bytes) -> str:
    """The ``errors`` of a distribution error body, as ``CODE: message``."""
    try:
        doc = json.loads(body)
        errors = doc.get("errors") if isinstance(doc, dict) else None
        if isinstance(errors, list) and errors:
            return "; ".join(
                f"{e.get('code', '?')}: {e.get('message', '')}" for e in errors if isinstance(e, dict)
            )
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return body[:200].decode("utf-8", "replace").strip()


async def _read_body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a body, so that a caller can tell one over the limit."""
    parts: list[bytes] = []
    got = 0
    while got <= limit and (part := await resp.content.read(limit + 1 - got)):
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _is_insecure(host: str, listed: frozenset[str]) -> bool:
    hostname = urlsplit(f"//{host}").hostname or host
    return hostname in LOCAL_HOSTS or host in listed or hostname in listed


# -- the async client ---------------------------------------------------------


class RegistryClient:
    """An async client for the OCI distribution API; use it as ``async with``.

    ``insecure_hosts`` adds ``host[:port]`` names reached over plain http (to
    the local ones and ``LAYERBOX_INSECURE_REGISTRIES``).  ``credentials``
    maps a registry name to :class:`Credentials` (default:
    :func:`default_credentials`); it is called at most once per registry, in a
    worker thread, and only when a registry asks for authentication.
    ``retries`` is how often a request is repeated after a connection error,
    429 or 5xx, sleeping ``retry_delay * 2**n`` seconds before attempt n.
    """

    def __init__(
        self,
        *,
        insecure_hosts: Iterable[str] = (),
        credentials: CredentialSource | None = None,
        retries: int = 3,
        retry_delay: float = 0.5,
        connect_timeout: float = 30.0,
        read_timeout: float = 60.0,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        max_config_bytes: int = MAX_CONFIG_BYTES,
    ) -> None:
        listed = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
        self._insecure = frozenset(listed | set(insecure_hosts))
        self._credential_source = credentials or default_credentials
        self._retries = retries
        self._retry_delay = retry_delay
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self.max_manifest_bytes = max_manifest_bytes
        self.max_config_bytes = max_config_bytes
        self._session: aiohttp.ClientSession | None = None
        self._tokens: dict[tuple[str, str], _Token] = {}
        self._basic: dict[str, str] = {}  # host -> Authorization header
        self._credentials: dict[str, Credentials | None] = {}
        self._auth_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.token_fetches = 0  # tokens fetched from realms (the rest came from the cache)

    async def __aenter__(self) -> RegistryClient:
        # auto_decompress off: digests are over the bytes as stored, never a re-encoding
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            auto_decompress=False,
            headers={"User-Agent": "layerbox", "Accept-Encoding": "identity"},
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            fix = "use it inside `async with RegistryClient() as client:`"
            raise ClientNotOpen(f"RegistryClient is not open (or already closed): {fix}", fix=fix)
        return self._session

    def base_url(self, host: str) -> str:
        scheme = "http" if _is_insecure(host, self._insecure) else "https"
        return f"{scheme}://{host}"

    # -- authentication --------------------------------------------------

    async def _credentials_for(self, registry: str) -> Credentials | None:
        if registry not in self._credentials:
            self._credentials[registry] = await asyncio.to_thread(self._credential_source, registry)
        return self._credentials[registry]

    def _auth_header(self, host: str, scope: str) -> str | None:
        token = self._tokens.get((host, scope))
        if token is not None:
            if token.expires > time.monotonic():
                return f"Bearer {token.value}"
            del self._tokens[(host, scope)]
        return self._basic.get(host)

    async def _authenticate(self, ref: Reference, scope: str, challenges: list[str]) -> None:
        """Answer a 401: fetch a Bearer token for ``scope`` or arm Basic auth."""
        host = ref.host
        parsed = _parse_challenges(challenges)
        creds = await self._credentials_for(ref.registry)
        if "bearer" in parsed:
            await self._fetch_token(ref, scope, parsed["bearer"], creds)
            return
        if "basic" in parsed:
            if creds is None:
                raise RegistryAuthError(
                    f"registry {host} requires credentials for {ref.repository}; "
                    + LOGIN_HINT.format(host=ref.registry)
                )
            log.debug("registry %s: using Basic auth as %s", host, creds.username)
            self._basic[host] = creds.basic_header()
            return
        raise RegistryAuthError(
            f"registry {host} answered 401 for {ref.repository} with an unsupported challenge "
            f"{'; '.join(challenges) or '(no WWW-Authenticate header)'}"
        )

    async def _fetch_token(
        self, ref: Reference, scope: str, challenge: Mapping[str, str], creds: Credentials | None
    ) -> None:
        host = ref.host
        realm = challenge.get("realm")
        if not realm:
            raise RegistryAuthError(f"registry {host}: Bearer challenge without a realm")
        realm_parts = urlsplit(realm)
        if realm_parts.scheme not in ("http", "https") or not realm_parts.netloc:
            raise RegistryAuthError(f"registry {host}: Bearer realm {realm!r} is not an http(s) URL")
        if (
            creds is not None
            and realm_parts.scheme == "http"
            and not _is_insecure(realm_parts.netloc, self._insecure)
        ):
            raise RegistryAuthError(
                f"registry {host}: refusing to send credentials to the plain-http token realm {realm}; "
                f"list {realm_parts.netloc} in {INSECURE_ENV} if that is intended"
            )
        params: list[tuple[str, str]] = []
        if service := challenge.get("service"):
            params.append(("service", service))
        requested = challenge.get("scope") or scope
        params.extend(("scope", s) for s in requested.split(" ") if s)
        headers = {"Authorization": creds.basic_header()} if creds is not None else {}
        log.info("registry %s: fetching a token for %s from %s", host, requested, realm)
        try:
            async with self.session.get(realm, params=params, headers=headers) as resp:
                body = await _read_body(resp, 1 << 20)
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RegistryUnavailable(f"registry {host}: token server {realm} unreachable: {exc}") from exc
        if status in (401, 403):
            who = f"credentials for {ref.registry} (user {creds.username!r}) rejected" if creds else (
                f"registry {ref.registry} requires credentials"
            )
            raise RegistryAuthError(
                f"{who} by token server {realm} (HTTP {status}) for {requested}; "
                + LOGIN_HINT.format(host=ref.registry)
            )
        if status != 200:
            retry = RegistryUnavailable if status >= 500 else RegistryAuthError
            raise retry(f"registry {host}: token server {realm} answered HTTP {status}: {_error_detail(body)}")
        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        value = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if not isinstance(value, str) or not value:
            raise RegistryAuthError(f"registry {host}: token server {realm} sent no token")
        expires_in = doc.get("expires_in") if isinstance(doc, dict) else None
        seconds = expires_in if isinstance(expires_in, int) and expires_in > 0 else DEFAULT_TOKEN_SECONDS
        self.token_fetches += 1
        self._tokens[(host, scope)] = _Token(
            value, time.monotonic() + max(seconds - TOKEN_MARGIN_SECONDS, 1)
        )

    # -- requests --------------------------------------------------------

    async def _backoff(self, attempt: int, what: str, problem: str) -> None:
        delay = self._retry_delay * (2**attempt)
        log.warning("%s: %s; retry %d of %d in %.1f s", what, problem, attempt + 1, self._retries, delay)
        await asyncio.sleep(delay)

    @asynccontextmanager
    async def _get(
        self,
        ref: Reference,
        path: str,
        *,
        kind: Literal["manifest", "blob"],
        name: str,
        accept: str | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """GET ``/v2/<repo>/<path>``: authenticated, retried, 200 or a raised error."""
        url = f"{self.base_url(ref.host)}/v2/{ref.repository}/{path}"
        what = f"registry {ref.registry}: {ref.repository} {kind} {name}"
        scope = ref.scope
        authenticated = False
        attempt = 0
        while True:
            headers = {"Accept": accept} if accept else {}
            if (auth := self._auth_header(ref.host, scope)) is not None:
                headers["Authorization"] = auth
            log.debug("GET %s", url)
            try:
                resp = await self.session.get(url, headers=headers)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                if attempt < self._retries:
                    await self._backoff(attempt, what, f"connection failed ({exc!r})")
                    attempt += 1
                    continue
                raise RegistryUnavailable(f"{what}: cannot reach {url}: {exc!r}") from exc
            except aiohttp.ClientError as exc:  # redirect loops, malformed responses
                raise RegistryError(f"{what}: request to {url} failed: {exc!r}") from exc
            try:
                status = resp.status
                if status == 200:
                    yield resp
                    return
                body = await _read_body(resp, 64 << 10)
            finally:
                resp.release()
            if status == 401 and not authenticated and not resp.history:
                lock = self._auth_locks.setdefault((ref.host, scope), asyncio.Lock())
                async with lock:
                    # a concurrent request may have fetched a token meanwhile
                    if self._auth_header(ref.host, scope) in (None, headers.get("Authorization")):
                        self._tokens.pop((ref.host, scope), None)
                        await self._authenticate(ref, scope, resp.headers.getall("WWW-Authenticate", []))
                authenticated = True
                continue
            if status in RETRY_STATUSES and attempt < self._retries:
                await self._backoff(attempt, what, f"HTTP {status}")
                attempt += 1
                continue
            raise self._status_error(ref, kind, name, status, body, authenticated)

    def _status_error(
        self, ref: Reference, kind: str, name: str, status: int, body: bytes, authenticated: bool
    ) -> OciError:
        what = f"registry {ref.registry}: {ref.repository} {kind} {name}"
        detail = _error_detail(body)
        if status == 404:
            cls: type[OciError] = ManifestNotFound if kind == "manifest" else BlobNotFound
            missing = "no manifest tagged" if kind == "manifest" and ":" not in name else f"no {kind}"
            return cls(
                f"registry {ref.registry}: repository {ref.repository} has {missing} {name} "
                f"(HTTP 404: {detail})"
            )
        if status in (401, 403):
            if authenticated or status == 403:
                return RegistryAuthError(
                    f"credentials for {ref.registry} rejected or lacking pull access to "
                    f"{ref.repository} (HTTP {status}: {detail}); " + LOGIN_HINT.format(host=ref.registry)
                )
            return RegistryAuthError(f"{what}: HTTP 401 after redirection ({detail})")
        if status in RETRY_STATUSES:
            return RegistryUnavailable(f"{what}: HTTP {status} after {self._retries} retries: {detail}")
        return RegistryError(f"{what}: unexpected HTTP {status}: {detail}")

    # -- manifests -------------------------------------------------------

    async def fetch_manifest(self, ref: Reference | str, expected: Descriptor | None = None) -> Manifest:
        """Fetch the manifest or index ``ref`` names, verified and size-limited.

        ``expected`` (the descriptor that pointed here) adds a size check.
        """
        ref = parse_reference(ref) if isinstance(ref, str) else ref
        name = ref.reference
        what = f"registry {ref.registry}: {ref.repository} manifest {name}"
        limit = self.max_manifest_bytes
        async with self._get(ref, f"manifests/{name}", kind="manifest", name=name, accept=MANIFEST_ACCEPT) as resp:
            if resp.content_length is not None:
                check_size(resp.content_length, limit, what)
            try:
                body = await _read_body(resp, limit)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise RegistryUnavailable(f"{what}: download failed: {exc!r}") from exc
            if len(body) > limit:
                raise ManifestTooLarge(f"{what} is larger than the {limit} byte limit; refusing to read it")
            header_digest = resp.headers.get("Docker-Content-Digest")
            content_type = resp.headers.get("Content-Type", "").split(";", 1)[0].strip()
        alg = (ref.digest or "sha256").partition(":")[0]
        digest = f"{alg}:{hashlib.new(alg, body).hexdigest()}"
        if ref.digest is not None and digest != ref.digest:
            raise BlobDigestMismatch(
                f"{what}: the registry sent a manifest hashing to {digest}; the registry or a proxy is "
                "corrupting data",
                expected=ref.digest,
                actual=digest,
            )
        if header_digest and header_digest.startswith(alg + ":") and header_digest != digest:
            raise BlobDigestMismatch(
                f"{what}: Docker-Content-Digest says {header_digest} but the body hashes to {digest}",
                expected=header_digest,
                actual=digest,
            )
        if expected is not None and len(body) != expected.size:
            raise BlobSizeMismatch(
                f"{what}: expected {expected.size} bytes, read {len(body)}; the registry or a proxy is "
                "corrupting data",
                expected=expected.digest,
                actual=digest,
            )
        document = parse_json(body, what)
        media_type, kind = manifest_kind(document, what, [content_type, expected.media_type if expected else ""])
        log.debug("%s: %s %s (%d bytes)", what, kind, digest, len(body))
        return Manifest(ref, digest, media_type, kind, body, document, header_digest)

    async def get_manifest(
        self, ref: Reference | str, platform: Platform | str | None = None
    ) -> RegistryImage:
        """Resolve ``ref`` to one image: manifest (via an index if need be), config, layers.

        ``platform`` picks from an index and defaults to :func:`host_platform`.
        Raises :class:`ManifestNotFound`, :class:`PlatformNotFound`,
        :class:`ManifestTooLarge`, :class:`UnsupportedImage`,
        :class:`BlobDigestMismatch`, :class:`RegistryAuthError`,
        :class:`RegistryUnavailable`.
        """
        ref = parse_reference(ref) if isinstance(ref, str) else ref
        want = want_platform(platform)
        manifest = await self.fetch_manifest(ref)
        index_digest: str | None = None
        chosen: Platform | None = None
        for _depth in range(MAX_INDEX_DEPTH):
            if manifest.kind == "manifest":
                return await self._image(ref, manifest, index_digest, chosen)
            where = f"registry {ref.registry}: {ref.repository} index {manifest.digest}"
            entries = index_entries(manifest.document, where)
            entry = select_platform(entries, want, where)
            index_digest = index_digest or manifest.digest
            chosen = entry.platform or chosen
            manifest = await self.fetch_manifest(ref.with_digest(entry.digest), entry)
        raise UnsupportedImage(
            f"registry {ref.registry}: {ref}: image indexes nested more than {MAX_INDEX_DEPTH} deep"
        )

    async def _image(
        self, ref: Reference, manifest: Manifest, index_digest: str | None, chosen: Platform | None
    ) -> RegistryImage:
        doc = manifest.document
        what = f"registry {ref.registry}: {ref.repository} manifest {manifest.digest}"
        parsed = parse_manifest(doc, what)
        config_desc, layers = parsed.config, parsed.layers
        data = await self.read_blob(ref, config_desc, limit=self.max_config_bytes)
        config = parse_json(data, f"{what}: config {config_desc.digest}")
        return RegistryImage(
            reference=ref,
            manifest_digest=manifest.digest,
            manifest_media_type=manifest.media_type,
            index_digest=index_digest,
            platform=chosen or Platform.from_json(config),
            config_descriptor=config_desc,
            config=config,
            layers=layers,
        )

    # -- blobs -----------------------------------------------------------

    async def read_blob(self, ref: Reference, descriptor: Descriptor, *, limit: int) -> bytes:
        """A whole (small) blob, verified; refuses blobs larger than ``limit``."""
        check_size(descriptor.size, limit, f"registry {ref.registry}: {ref.repository} blob {descriptor.digest}")
        async with self.open_blob(ref, descriptor) as blob:
            return b"".join([data async for data in blob])

    @asynccontextmanager
    async def open_blob(self, ref: Reference, descriptor: Descriptor) -> AsyncIterator[BlobDownload]:
        """Stream the blob ``descriptor`` names from ``ref``'s repository (tag and digest unused).

        Iterate the yielded :class:`BlobDownload` to the end: the last step
        raises if the size or digest is wrong.  Redirects (to a CDN or another
        host) are followed; credentials are not sent to another host.
        """
        name = descriptor.digest
        what = f"registry {ref.registry}: {ref.repository} blob {name}"
        attempt = 0
        while True:
            async with self._get(ref, f"blobs/{name}", kind="blob", name=name) as resp:
                blob = BlobDownload(resp, descriptor, what)
                try:
                    await blob.prime()
                except BlobTruncated as exc:
                    # nothing was delivered yet: a broken first read is worth a new request
                    if attempt < self._retries:
                        await self._backoff(attempt, what, str(exc.__cause__ or exc))
                        attempt += 1
                        continue
                    raise
                yield blob
                return


class BlobDownload:
    """One blob download in flight: ``async for data in blob`` yields verified bytes.

    The size is checked as bytes arrive; the digest after the last byte, in
    the step that ends the iteration.  ``received`` counts the bytes so far.
    """

    def __init__(self, resp: aiohttp.ClientResponse, descriptor: Descriptor, what: str) -> None:
        self._resp = resp
        self.descriptor = descriptor
        self.what = what
        self._check = BlobCheck(descriptor, what, remedy=CORRUPT_HINT, short=BlobTruncated)
        self._first: bytes | None = None
        self._done = False
        announced = resp.content_length
        if announced is not None and announced != descriptor.size:
            cls = BlobSizeMismatch if announced > descriptor.size else BlobTruncated
            raise cls(
                f"{what}: the registry announces {announced} bytes, the manifest says {descriptor.size}",
                expected=descriptor.digest,
            )

    @property
    def received(self) -> int:
        return self._check.count

    async def _read(self) -> bytes:
        try:
            return await self._resp.content.read(STREAM_CHUNK)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise BlobTruncated(
                f"{self.what}: the download broke after {self.received} of {self.descriptor.size} "
                f"bytes ({exc!r}); try again",
                expected=self.descriptor.digest,
            ) from exc

    async def prime(self) -> None:
        """Read the first chunk, so that a broken response can still be retried."""
        self._first = await self._read()

    def __aiter__(self) -> BlobDownload:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        if self._first is not None:
            data, self._first = self._first, None
        else:
            data = await self._read()
        if not data:
            self._done = True
            problem = self._check.problem()
            if problem is not None:
                raise problem
            raise StopAsyncIteration
        self._check.update(data)
        return data

    @property
    def actual(self) -> str:
        return self._check.actual


# -- the sync bridge ----------------------------------------------------------

BLOB_QUEUE_DEPTH = 16  # chunks of up to STREAM_CHUNK bytes buffered ahead of the reader
CLOSE_TIMEOUT = 30.0
_SYNC_FIX = "use it inside `with SyncRegistryClient() as r:`"


class SyncRegistryClient:
    """A :class:`RegistryClient` on an event loop in its own thread, for sync callers.

    ``with SyncRegistryClient() as registry:`` starts the thread and opens the
    client; leaving the block closes both.  Methods block the calling thread
    (which must not be the loop's) until the coroutine finishes.
    """

    def __init__(self, **client_options: Any) -> None:
        self._options = client_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: RegistryClient | None = None

    def __enter__(self) -> SyncRegistryClient:
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            try:
                loop.run_forever()
                # stopped: cancel what is left (blob pumps of streams never closed)
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="layerbox-registry", daemon=True)
        self._thread.start()
        started.wait()
        client = RegistryClient(**self._options)
        try:
            self.call(client.__aenter__())
        except BaseException:
            self._stop()
            raise
        self._client = client
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._client is not None:
                self.call(self._client.close())
        finally:
            self._client = None
            self._stop()

    def _stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop = None
        self._thread = None

    @property
    def client(self) -> RegistryClient:
        if self._client is None:
            raise ClientNotOpen(f"SyncRegistryClient is not open (or already closed): {_SYNC_FIX}", fix=_SYNC_FIX)
        return self._client

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise ClientNotOpen(f"SyncRegistryClient is not open (or already closed), so it has no event "
                                f"loop: {_SYNC_FIX}", fix=_SYNC_FIX)
        return self._loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop and wait for its result."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the waiting thread
            raise

    def get_manifest(self, ref: Reference | str, platform: Platform | str | None = None) -> RegistryImage:
        return self.call(self.client.get_manifest(ref, platform))

    def open_blob(self, ref: Reference, descriptor: Descriptor) -> BlobStream:
        """Start downloading a blob; read it from the returned :class:`BlobStream`."""
        return BlobStream(self.client, ref, descriptor, self.loop)

    def blobs(self, ref: Reference) -> RegistryBlobs:
        """The blobs of ``ref``'s repository as a :class:`converters.ocispec.BlobSource`."""
        return RegistryBlobs(self, ref)


@dataclass(frozen=True)
class RegistryBlobs:
    """One repository's blobs, streamed and verified (the registry's :class:`BlobSource`)."""

    registry: SyncRegistryClient
    reference: Reference

    def open_blob(self, desc: Descriptor) -> BlobStream:
        return self.registry.open_blob(self.reference, desc)


class BlobStream(VerifyingStream):
    """A blocking, file-like view of a blob download running on an event loop.

    The download starts at once and runs up to ``depth`` chunks ahead of the
    reader (then waits: backpressure).  ``read(n)`` blocks until bytes, the end
    (``b""``) or an error arrive; download errors (connection, truncation,
    oversize) are raised by ``read``.  A blob with the right size but the wrong
    digest reads to its end normally and :meth:`verify` raises
    :class:`BlobDigestMismatch`, so a converter that calls ``verify`` before
    committing leaves nothing behind.  ``close()`` cancels the download.
    """

    chunk = STREAM_CHUNK

    def __init__(
        self,
        client: RegistryClient,
        ref: Reference,
        descriptor: Descriptor,
        loop: asyncio.AbstractEventLoop,
        *,
        depth: int = BLOB_QUEUE_DEPTH,
    ) -> None:
        super().__init__()
        self.reference = ref
        self.descriptor = descriptor
        self.what = f"registry {ref.registry}: {ref.repository} blob {descriptor.digest}"
        self.count = 0  # bytes handed to the reader
        self._client = client
        self._loop = loop
        self._depth = depth
        self._items: queue.Queue[bytes | BaseException | None] = queue.Queue()
        self._credits: asyncio.Semaphore | None = None
        self._buf = memoryview(b"")
        self._eof = False
        self._error: BaseException | None = None
        self._mismatch: BlobDigestMismatch | None = None
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        loop.call_soon_threadsafe(self._spawn)

    def _spawn(self) -> None:
        self._task = self._loop.create_task(self._pump())
        self._task.add_done_callback(self._stopped)

    def _stopped(self, _task: asyncio.Task[None]) -> None:
        # after whatever the pump queued (a reader stops at the first None or error),
        # so that a reader never waits for a task that is gone, even one cancelled
        # before its first step
        self._items.put(RegistryError(f"{self.what}: the download was cancelled (stream closed)"))
        self._finished.set()

    async def _pump(self) -> None:
        self._credits = asyncio.Semaphore(self._depth)
        try:
            async with self._client.open_blob(self.reference, self.descriptor) as blob:
                async for data in blob:
                    await self._credits.acquire()
                    self._items.put(data)
            self._items.put(None)
        except BlobDigestMismatch as exc:  # raised after the last byte: verify() reports it
            self._mismatch = exc
            self._items.put(None)
        except Exception as exc:  # handed to the reading thread, which raises it
            self._items.put(exc)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _credit(self) -> None:
        if self._credits is not None:
            self._credits.release()

    @property
    def queued(self) -> int:
        """Chunks downloaded and not yet read (at most ``depth``, plus an end marker)."""
        return self._items.qsize()

    def _next_item(self, block: bool) -> bool:
        """Move the next queued chunk to the buffer; False at the end or when none is ready."""
        try:
            item = self._items.get(block=block)
        except queue.Empty:
            return False
        if item is None:
            self._eof = True
            return False
        if isinstance(item, BaseException):
            self._error = item
            raise item
        try:
            self._loop.call_soon_threadsafe(self._credit)
        except RuntimeError:  # the loop is closed; nobody waits for credit any more
            pass
        self._buf = memoryview(item)
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        with self._lock:
            if self.closed:
                raise ValueError(f"{self.what}: read from a closed BlobStream")
            if self._error is not None:
                raise self._error
            parts: list[bytes] = []
            got = 0
            while got < size:
                if not self._buf:
                    # block for the first bytes only; then take what is already there
                    if self._eof or not self._next_item(block=not parts):
                        break
                take = self._buf[: size - got]
                parts.append(bytes(take))
                self._buf = self._buf[len(take) :]
                got += len(take)
            self.count += got
            return b"".join(parts)

    def problem(self) -> OciError | None:
        """Why the bytes read so far are not the blob, or ``None`` when they are all of it."""
        if isinstance(self._error, OciError):
            return self._error
        if self._error is not None:
            return RegistryError(f"{self.what}: the download failed: {self._error!r}")
        if not self._eof or self._buf:
            return RegistryError(
                f"{self.what}: verified before its end ({self.count} of {self.descriptor.size} bytes read)"
            )
        return self._mismatch

    def close(self) -> None:
        if self.closed:
            return
        if not self._finished.is_set():
            try:
                self._loop.call_soon_threadsafe(self._cancel)
            except RuntimeError:  # the loop is closed: its shutdown cancelled the task already
                pass
            else:
                if not self._finished.wait(CLOSE_TIMEOUT):
                    log.warning("%s: download did not stop within %.0f s of close()", self.what, CLOSE_TIMEOUT)
        super().close()
