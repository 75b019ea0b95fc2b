"""A real OCI registry for tests: Debian's docker-registry, a token server, a fault proxy.

* :class:`RegistryServer` runs ``/usr/bin/docker-registry serve CONFIG`` on
  127.0.0.1 (a free port, filesystem storage in a temp dir), waits for
  ``GET /v2/`` to answer, and kills its process group on ``stop()``.  With a
  :class:`TokenServer` it runs in ``auth: token`` mode.
* :class:`TokenServer` issues the JWTs distribution's token auth accepts
  (RS256, the signing certificate in the ``x5c`` header, trusted through the
  registry's ``rootcertbundle``), asks for Basic credentials and counts what
  it issued.
* :class:`FaultProxy` forwards to a registry and injects faults: 503s,
  corrupted or truncated blobs, redirects to another host, Basic challenges,
  made-up manifests.
* :func:`push` copies images in with skopeo; :func:`build_layout` writes small
  OCI layouts (single images and multi-platform indexes) to push.

The aiohttp servers share one event loop in a background thread
(:class:`ServerThread`), so they serve the sync code under test too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import gzip
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from .env import FIXTURE_IMAGE, unavailable
from .proc import run

T = TypeVar("T")

REGISTRY_BIN = Path("/usr/bin/docker-registry")
FIXTURES = FIXTURE_IMAGE.parent
FIXTURE_ARCHIVE = FIXTURES / "debian-bookworm.oci.tar"
READY_TIMEOUT = 20.0
SKOPEO_TIMEOUT = 300

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
MT_LAYER_GZIP = MT_LAYER + "+gzip"
REF_NAME = "org.opencontainers.image.ref.name"


def fixture_archive() -> Path:
    if not FIXTURE_ARCHIVE.is_file():
        unavailable(f"the Debian fixture {FIXTURE_ARCHIVE} is not there (see {FIXTURES}/README.md)")
    return FIXTURE_ARCHIVE


def require_tools() -> None:
    if not REGISTRY_BIN.is_file():
        unavailable(f"{REGISTRY_BIN} is missing (apt-get install docker-registry)")
    if run(["sh", "-c", "command -v skopeo"], timeout=10, check=False).returncode != 0:
        unavailable("skopeo is missing (apt-get install skopeo)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- a loop thread for the aiohttp servers ----------------------------------------


class ServerThread:
    """An event loop in a daemon thread that hosts aiohttp apps on 127.0.0.1."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="test-servers", daemon=True)
        self._runners: list[web.AppRunner] = []
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def serve(self, app: web.Application) -> tuple[web.AppRunner, int]:
        """Start ``app`` on a free port of 127.0.0.1; returns its runner and port."""

        async def start() -> tuple[web.AppRunner, int]:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            server = site._server
            assert isinstance(server, asyncio.base_events.Server)
            return runner, int(server.sockets[0].getsockname()[1])

        runner, port = self.call(start())
        self._runners.append(runner)
        return runner, port

    def stop_app(self, runner: web.AppRunner) -> None:
        if runner in self._runners:
            self._runners.remove(runner)
            self.call(runner.cleanup())

    def close(self) -> None:
        for runner in list(self._runners):
            self.stop_app(runner)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


# -- the token server ---------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenServer:
    """Issues registry tokens (distribution's JWT format) to clients with valid Basic auth.

    ``issued`` lists ``(user, scopes)`` per token handed out; ``refused``
    counts requests without valid credentials.
    """

    workdir: Path
    service: str = "layerbox-test-registry"
    issuer: str = "layerbox-test-token-issuer"
    users: Mapping[str, str] = field(default_factory=lambda: {"alice": "wonderland"})
    expires_in: int = 300
    issued: list[tuple[str, list[str]]] = field(default_factory=list)
    refused: int = 0
    port: int = 0

    def __post_init__(self) -> None:
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "layerbox test token issuer")])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = self.workdir / "token-issuer.pem"
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        self._lock = threading.Lock()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def jwt(self, subject: str, access: list[dict[str, Any]]) -> str:
        der = self._cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": subject,
            "aud": self.service,
            "exp": now + self.expires_in,
            "nbf": now - 5,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"

    def _user(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return None
        return user if self.users.get(user) == password else None

    async def handle(self, request: web.Request) -> web.Response:
        user = self._user(request)
        if user is None:
            with self._lock:
                self.refused += 1
            return web.json_response(
                {"errors": [{"code": "UNAUTHORIZED", "message": "bad or missing credentials"}]},
                status=401,
                headers={"WWW-Authenticate": 'Basic realm="layerbox test tokens"'},
            )
        if request.query.get("service") != self.service:
            return web.json_response({"errors": [{"code": "DENIED", "message": "wrong service"}]}, status=400)
        scopes = request.query.getall("scope", [])
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]})
        token = self.jwt(user, access)
        with self._lock:
            self.issued.append((user, scopes))
        return web.json_response({"token": token, "access_token": token, "expires_in": self.expires_in})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/token", self.handle)
        return app

    def tokens_for(self, scope: str) -> int:
        with self._lock:
            return sum(1 for _, scopes in self.issued if scope in scopes)


# -- docker-registry ------------------------------------------------------------------


_LOGFMT = re.compile(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S*)')
_BLOB_URI = re.compile(r"^/v2/.+/blobs/(sha256:[0-9a-f]{64})$")


@dataclass(frozen=True)
class Response:
    """One request the registry answered, from its log: ``written`` is the body's bytes."""

    method: str
    uri: str
    status: int
    written: int

    @property
    def digest(self) -> str | None:
        m = _BLOB_URI.match(self.uri)
        return m.group(1) if m else None


class RegistryServer:
    """``docker-registry serve`` on 127.0.0.1:<free port>, storage under ``root``."""

    def __init__(self, root: Path, token: TokenServer | None = None) -> None:
        self.root = root
        self.token = token
        self.storage = root / "storage"
        self.config = root / "config.yml"
        self.log_path = root / "registry.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> None:
        # JSON is YAML, and leaves no doubt about quoting
        config: dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {"addr": self.host, "secret": uuid.uuid4().hex},
        }
        if self.token is not None:
            config["auth"] = {
                "token": {
                    "realm": self.token.realm,
                    "service": self.token.service,
                    "issuer": self.token.issuer,
                    "rootcertbundle": str(self.token.cert_path),
                }
            }
        self.config.write_text(json.dumps(config, indent=2))

    def start(self) -> None:
        self.storage.mkdir(parents=True, exist_ok=True)
        problems = []
        for _attempt in range(3):  # the free port may be taken between probe and bind
            self.port = free_port()
            self._write_config()
            with self.log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [str(REGISTRY_BIN), "serve", str(self.config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, killed as one
                )
            problem = self._wait_ready()
            if problem is None:
                return
            problems.append(problem)
            self.stop()
        raise RuntimeError(
            "docker-registry did not start:\n" + "\n".join(problems) + "\n" + self.log_tail()
        )

    def _wait_ready(self) -> str | None:
        assert self._proc is not None
        deadline = time.monotonic() + READY_TIMEOUT
        last = ""
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"exited with status {self._proc.returncode}"
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as resp:
                    if resp.status == 200:
                        return None
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and self.token is not None:  # token auth: alive and asking
                    return None
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        return f"no answer on http://{self.host}/v2/ within {READY_TIMEOUT} s ({last})"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def responses(self, since: int = 0) -> list[Response]:
        """The requests the registry answered after byte ``since`` of its log, in order.

        distribution logs one logfmt ``response completed`` line per request, quoting a value
        only when it needs quotes (a URI with ``:`` in it does)."""
        out = []
        text = self.log_path.read_bytes()[since:].decode(errors="replace")
        for line in text.splitlines():
            if 'msg="response completed"' not in line:
                continue
            fields = dict(_LOGFMT.findall(line))
            out.append(Response(fields.get("http.request.method", "").strip('"'),
                                fields.get("http.request.uri", "").strip('"'),
                                int(fields.get("http.response.status", "0")),
                                int(fields.get("http.response.written", "0"))))
        return out

    def blob_gets(self, since: int = 0) -> list[Response]:
        """The successful blob GETs after byte ``since`` of the log (``digest`` set on each)."""
        return [r for r in self.responses(since) if r.method == "GET" and r.digest and r.status < 300]

    def blob_file(self, digest: str) -> Path:
        """Where filesystem storage keeps a blob's bytes (to corrupt them)."""
        alg, _, hexpart = digest.partition(":")
        return self.storage / "docker" / "registry" / "v2" / "blobs" / alg / hexpart[:2] / hexpart / "data"


@contextlib.contextmanager
def running_registry(root: Path, token: TokenServer | None = None) -> Iterator[RegistryServer]:
    server = RegistryServer(root, token)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def push(
    source: str,
    dest: str,
    *,
    all_images: bool = False,
    creds: tuple[str, str] | None = None,
    manifest_format: str | None = None,
) -> None:
    """``skopeo copy SOURCE docker://DEST`` over plain http.

    ``manifest_format`` is skopeo's ``--format`` (``oci``, ``v2s2``).
    """
    argv = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if all_images:
        argv.append("--all")
    if manifest_format is not None:
        argv += ["--format", manifest_format]
    if creds is not None:
        argv += ["--dest-creds", f"{creds[0]}:{creds[1]}"]
    # skopeo must not pick up the host's own registry logins
    with tempfile.TemporaryDirectory(prefix="skopeo-auth-") as tmp:
        auth_file = Path(tmp) / "auth.json"
        auth_file.write_text('{"auths": {}}')
        env = {**os.environ, "REGISTRY_AUTH_FILE": str(auth_file)}
        run([*argv, source, f"docker://{dest}"], timeout=SKOPEO_TIMEOUT, env=env)


# -- small OCI layouts to push -------------------------------------------------------


def tar_of(files: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class LayoutBuilder:
    """Writes an OCI image layout (``oci:DIR:TAG`` for skopeo) blob by blob."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self._index: list[dict[str, Any]] = []

    def blob(self, data: bytes, media_type: str, **extra: Any) -> dict[str, Any]:
        digest = sha256(data)
        (self.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}

    def json_blob(self, doc: Mapping[str, Any], media_type: str, **extra: Any) -> dict[str, Any]:
        return self.blob(json.dumps(doc).encode(), media_type, **extra)

    def image(
        self, layers: list[bytes], *, arch: str = "amd64", gzip_layers: bool = True, diff_ids: list[str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """``layers`` are uncompressed tars; returns the manifest's descriptor (with platform).

        ``diff_ids`` replaces the config's (correct) ``rootfs.diff_ids``; ``labels`` become the
        config's ``config.Labels``.
        """
        config = {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], **({"Labels": dict(labels)} if labels else {})},
            "rootfs": {"type": "layers", "diff_ids": diff_ids or [sha256(t) for t in layers]},
        }
        blobs = [
            self.blob(gzip.compress(t, mtime=0), MT_LAYER_GZIP) if gzip_layers else self.blob(t, MT_LAYER)
            for t in layers
        ]
        manifest = {
            "schemaVersion": 2,
            "mediaType": MT_OCI_MANIFEST,
            "config": self.json_blob(config, MT_OCI_CONFIG),
            "layers": blobs,
        }
        return self.json_blob(manifest, MT_OCI_MANIFEST, platform={"architecture": arch, "os": "linux"})

    def image_index(self, manifests: list[dict[str, Any]]) -> dict[str, Any]:
        doc = {"schemaVersion": 2, "mediaType": MT_OCI_INDEX, "manifests": manifests}
        return self.json_blob(doc, MT_OCI_INDEX)

    def tag(self, desc: Mapping[str, Any], name: str) -> None:
        entry = {k: v for k, v in desc.items() if k != "platform"}
        self._index.append({**entry, "annotations": {REF_NAME: name}})
        doc = {"schemaVersion": 2, "mediaType": MT_OCI_INDEX, "manifests": self._index}
        (self.root / "index.json").write_text(json.dumps(doc))

    def manifest(self, desc: Mapping[str, Any]) -> dict[str, Any]:
        return dict(json.loads((self.root / "blobs" / "sha256" / desc["digest"][7:]).read_bytes()))


# -- a proxy that breaks things on purpose ----------------------------------------------


@dataclass
class Faults:
    """What :class:`FaultProxy` does to requests; tests set these fields."""

    # blob digest -> number of 503 answers before the real one
    unavailable: dict[str, int] = field(default_factory=dict)
    # blob digest -> index of a byte to flip
    flip: dict[str, int] = field(default_factory=dict)
    # blob digest -> bytes to send before closing the connection (Content-Length stays full)
    truncate: dict[str, int] = field(default_factory=dict)
    # blob digests answered with a 307 to the proxy's other listener ("another host")
    redirect: set[str] = field(default_factory=set)
    # manifest path ("repo/manifests/ref") -> (body, content type, announce Content-Length)
    manifests: dict[str, tuple[bytes, str, bool]] = field(default_factory=dict)
    # demand HTTP Basic auth with these credentials (the upstream registry wants none)
    basic: tuple[str, str] | None = None


class FaultProxy:
    """Forwards ``/v2/`` to ``upstream`` and applies :class:`Faults`; records requests.

    The second listener (``cdn_port``) serves redirected blobs under
    ``/cdn/<repo>/blobs/<digest>``, as a CDN behind a registry would.
    """

    def __init__(self, servers: ServerThread, upstream: str) -> None:
        self.servers = servers
        self.upstream = upstream
        self.faults = Faults()
        self.requests: list[tuple[str, str, str | None]] = []  # (listener, path, Authorization)
        self._session: aiohttp.ClientSession | None = None
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        cdn = web.Application()
        cdn.router.add_get("/cdn/{path:.*}", self._cdn)
        self._runner, self.port = servers.serve(app)
        self._cdn_runner, self.cdn_port = servers.serve(cdn)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.servers.stop_app(self._runner)
        self.servers.stop_app(self._cdn_runner)
        if self._session is not None:
            self.servers.call(self._session.close())

    async def _upstream_get(self, path: str, headers: Mapping[str, str]) -> tuple[int, Mapping[str, str], bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        async with self._session.get(f"http://{self.upstream}/{path}", headers=headers, allow_redirects=False) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        self.requests.append(("cdn", path, request.headers.get("Authorization")))
        status, headers, body = await self._upstream_get(f"v2/{path}", {})
        return web.Response(status=status, body=body, content_type=headers.get("Content-Type"))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        auth = request.headers.get("Authorization")
        self.requests.append(("proxy", path, auth))
        f = self.faults
        if f.basic is not None:
            expected = "Basic " + base64.b64encode(f"{f.basic[0]}:{f.basic[1]}".encode()).decode()
            if auth != expected:
                return web.json_response(
                    {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
                    status=401,
                    headers={"WWW-Authenticate": 'Basic realm="layerbox test proxy"'},
                )
            auth = None  # the upstream registry runs without auth
        manifest_key = path.removeprefix("v2/")
        if manifest_key in f.manifests:
            body, content_type, announce = f.manifests[manifest_key]
            return await self._send(request, body, {"Content-Type": content_type}, announce=announce)
        digest = path.rsplit("/", 1)[-1] if "/blobs/" in path else ""
        if f.unavailable.get(digest, 0) > 0:
            f.unavailable[digest] -= 1
            return web.Response(status=503, text="try later")
        if digest in f.redirect:
            repo_path = path.removeprefix("v2/")
            raise web.HTTPTemporaryRedirect(f"http://localhost:{self.cdn_port}/cdn/{repo_path}")
        headers = {k: v for k, v in request.headers.items() if k in ("Accept", "Range")}
        if auth:
            headers["Authorization"] = auth
        status, up_headers, body = await self._upstream_get(path, headers)
        keep = {
            k: v
            for k, v in up_headers.items()
            if k in ("Content-Type", "Docker-Content-Digest", "WWW-Authenticate", "Location")
        }
        if status == 200 and digest in f.flip:
            at = f.flip[digest]
            body = body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1 :]
        if status == 200 and digest in f.truncate:
            return await self._send(request, body, keep, cut=f.truncate[digest])
        return await self._send(request, body, keep, status=status)

    async def _send(
        self,
        request: web.Request,
        body: bytes,
        headers: Mapping[str, str],
        *,
        status: int = 200,
        announce: bool = True,
        cut: int | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers=headers)
        if announce:
            resp.content_length = len(body)
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        if cut is None:
            await resp.write(body)
            await resp.write_eof()
            return resp
        await resp.write(body[:cut])
        transport = request.transport
        if transport is not None:
            transport.close()  # mid-body: the client sees a connection closed early
        return resp


def corrupt_file(path: Path, at: int) -> bytes:
    """Flip one bit of ``path`` at byte ``at``; returns the original content."""
    data = path.read_bytes()
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
    return data
