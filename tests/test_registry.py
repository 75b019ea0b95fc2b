"""converters.registry and the docker:// transport of converters.oci, against a real registry.

Debian's docker-registry runs on 127.0.0.1 (one plain instance, one in token
auth mode behind the token server of support.registry); skopeo fills it with
the Debian fixture and small layouts built here (a linux/amd64 + linux/arm64
index, images whose blobs get corrupted).  Faults the registry cannot produce
(truncated bodies, 503s, redirects to another host, huge manifests, Basic
challenges) come from support.registry.FaultProxy in front of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tarfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from support.proc import run
from support.registry import (
    FaultProxy,
    LayoutBuilder,
    RegistryServer,
    ServerThread,
    TokenServer,
    corrupt_file,
    fixture_archive,
    push,
    require_tools,
    running_registry,
    tar_of,
)

from converters.errors import ConvertError, DigestMismatch
from converters.oci import (
    convert_image,
    inspect_image,
    parse_image_ref,
)
from converters.ocispec import (
    BlobDigestMismatch,
    BlobNotFound,
    BlobTruncated,
    Descriptor,
    ImageRefError,
    LayerDigestMismatch,
    ManifestNotFound,
    ManifestTooLarge,
    OciError,
    Platform,
    PlatformNotFound,
    Reference,
    RegistryAuthError,
    RegistryError,
    RegistryUnavailable,
    parse_reference,
)
from converters.registry import (
    BLOB_QUEUE_DEPTH,
    Credentials,
    RegistryClient,
    SyncRegistryClient,
    default_credentials,
)

ALICE = ("alice", "wonderland")
REF_NAME = "org.opencontainers.image.ref.name"
FAST = 0.01  # retry_delay: retries without the production backoff


# -- servers and images (session scope: started once, always stopped) -------------------


@pytest.fixture(scope="session")
def servers() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    require_tools()
    root = tmp_path_factory.mktemp("registry")
    with running_registry(root) as server:
        yield server
    shutil.rmtree(root)  # the pushed fixture: about 90 MB


@pytest.fixture(scope="session")
def python_ref(registry: RegistryServer) -> str:
    """The fixture's ``python`` tag pushed as fixture/python:latest."""
    archive = fixture_archive()
    push(f"oci-archive:{archive}:python", f"{registry.host}/fixture/python:latest")
    return f"{registry.host}/fixture/python:latest"


@dataclass(frozen=True)
class Small:
    """The small images pushed by ``small``: name -> manifest descriptor / document."""

    layout: Path
    amd64: dict[str, Any]
    arm64: dict[str, Any]
    index: dict[str, Any]
    verify: dict[str, Any]
    inflate: dict[str, Any]
    manifests: dict[str, dict[str, Any]]


@pytest.fixture(scope="session")
def small(registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    root = tmp_path_factory.mktemp("layouts") / "layout"
    lay = LayoutBuilder(root)
    amd64 = lay.image([tar_of({"etc/arch": b"amd64\n", "bin/tool": b"A" * 70_000})], arch="amd64")
    arm64 = lay.image([tar_of({"etc/arch": b"arm64\n", "bin/tool": b"B" * 70_000})], arch="arm64")
    index = lay.image_index([amd64, arm64])
    lay.tag(index, "multi")
    # layers with content of their own: their blobs are corrupted in the registry's storage
    verify = lay.image([tar_of({"data/verify": os.urandom(50_000)})])
    lay.tag(verify, "verify")
    inflate = lay.image([tar_of({"data/inflate": os.urandom(50_000)})])
    lay.tag(inflate, "inflate")
    push(f"oci:{root}:multi", f"{registry.host}/fixture/multi:latest", all_images=True)
    push(f"oci:{root}:multi", f"{registry.host}/fixture/multi-docker:latest", all_images=True,
         manifest_format="v2s2")  # a Docker manifest list of Docker v2 schema 2 manifests
    push(f"oci:{root}:verify", f"{registry.host}/tamper/verify:latest")
    push(f"oci:{root}:inflate", f"{registry.host}/tamper/inflate:latest")
    manifests = {d["digest"]: lay.manifest(d) for d in (amd64, arm64, verify, inflate)}
    yield Small(root, amd64, arm64, index, verify, inflate, manifests)
    shutil.rmtree(root.parent)


@pytest.fixture(scope="session")
def token_server(servers: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenServer]:
    workdir = tmp_path_factory.mktemp("tokens")
    server = TokenServer(workdir)
    runner, server.port = servers.serve(server.app())
    yield server
    servers.stop_app(runner)
    shutil.rmtree(workdir)


@pytest.fixture(scope="session")
def auth_registry(
    token_server: TokenServer, small: Small, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RegistryServer]:
    require_tools()
    root = tmp_path_factory.mktemp("auth-registry")
    with running_registry(root, token_server) as server:
        push(f"oci:{small.layout}:multi", f"{server.host}/private/multi:latest", all_images=True, creds=ALICE)
        yield server
    shutil.rmtree(root)


@pytest.fixture
def proxy(servers: ServerThread, registry: RegistryServer) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(servers, registry.host)
    yield fault_proxy
    fault_proxy.close()


@pytest_asyncio.fixture
async def client() -> AsyncIterator[RegistryClient]:
    async with RegistryClient(retry_delay=FAST) as c:
        yield c


def left_behind(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def fixture_manifest_digest(tag: str) -> str:
    with tarfile.open(fixture_archive()) as tar:
        f = tar.extractfile("./index.json")
        assert f is not None
        index = json.load(f)
    (desc,) = [m for m in index["manifests"] if m["annotations"][REF_NAME] == tag]
    return str(desc["digest"])


async def other_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def desc_of(obj: dict[str, Any]) -> Descriptor:
    return Descriptor.from_json(obj, "test")


# -- references, schemes, credentials (no server) -----------------------------------------


def test_parse_reference_forms() -> None:
    ref = parse_reference("127.0.0.1:5000/fixture/python:latest")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == ("127.0.0.1:5000", "fixture/python", "latest", None)
    assert ref.host == "127.0.0.1:5000"
    assert ref.reference == "latest"
    digest = "sha256:" + "ab" * 32
    ref = parse_reference(f"localhost/a/b@{digest}")
    assert (ref.registry, ref.repository, ref.tag, ref.reference) == ("localhost", "a/b", None, digest)
    ref = parse_reference(f"example.com:443/a/b:v1@{digest}")
    assert (ref.tag, ref.reference, str(ref)) == ("v1", digest, f"example.com:443/a/b:v1@{digest}")
    # Docker Hub defaults, as docker and skopeo spell them
    ref = parse_reference("python")
    assert (ref.registry, ref.repository, ref.tag, ref.host) == (
        "docker.io", "library/python", "latest", "registry-1.docker.io"
    )
    assert parse_reference("user/app:1.0").repository == "user/app"
    assert parse_reference("docker.io/python:3").repository == "library/python"
    assert parse_reference("index.docker.io/library/python").registry == "docker.io"
    assert parse_reference("127.0.0.1:5000/x").tag == "latest"


@pytest.mark.parametrize(
    "text",
    ["", "Upper/Case", "host:5000/repo:bad tag", "repo@sha256:1234", "repo@md5:" + "0" * 32, "a//b", "host:5000/"],
)
def test_parse_reference_rejects(text: str) -> None:
    with pytest.raises(ImageRefError, match="image reference"):
        parse_reference(text)


def test_docker_transport_refs() -> None:
    src = parse_image_ref("docker://127.0.0.1:5000/fixture/python:latest")
    assert (src.transport, src.path, src.reference) == ("docker", None, "latest")
    assert src.remote == Reference("127.0.0.1:5000", "fixture/python", "latest")
    assert str(src) == "docker://127.0.0.1:5000/fixture/python:latest"
    digest = "sha256:" + "0" * 64
    assert parse_image_ref(f"docker://localhost:1/a@{digest}").reference == digest
    with pytest.raises(ImageRefError, match="docker://HOST"):
        parse_image_ref("docker:127.0.0.1:5000/a")
    with pytest.raises(ImageRefError, match="malformed repository"):
        parse_image_ref("docker://127.0.0.1:5000/UPPER")


def test_plain_http_only_for_local_and_listed_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERBOX_INSECURE_REGISTRIES", "registry.lan:5000, other.lan")
    c = RegistryClient(insecure_hosts=["mine.lan"])
    assert c.base_url("127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert c.base_url("localhost") == "http://localhost"
    assert c.base_url("[::1]:5000") == "http://[::1]:5000"
    assert c.base_url("registry.lan:5000") == "http://registry.lan:5000"
    assert c.base_url("registry.lan:6000") == "https://registry.lan:6000"
    assert c.base_url("other.lan:1234") == "http://other.lan:1234"
    assert c.base_url("mine.lan") == "http://mine.lan"
    assert c.base_url("registry-1.docker.io") == "https://registry-1.docker.io"


def test_default_credentials_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LAYERBOX_REGISTRY_USER", "LAYERBOX_REGISTRY_PASSWORD", "REGISTRY_AUTH_FILE",
                "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "DOCKER_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_credentials("r.example:5000") is None
    docker = tmp_path / ".docker" / "config.json"
    docker.parent.mkdir()
    docker.write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": {"auth": "aHViOmh1YnB3"},  # hub:hubpw
        "r.example:5000": {"auth": "ZG9jazpkb2NrcHc="},  # dock:dockpw
    }}))
    assert default_credentials("docker.io") == Credentials("hub", "hubpw")
    assert default_credentials("r.example:5000") == Credentials("dock", "dockpw")
    skopeo = tmp_path / "run" / "containers" / "auth.json"
    skopeo.parent.mkdir(parents=True)
    skopeo.write_text(json.dumps({"auths": {"r.example:5000": {"username": "sk", "password": "sp"}}}))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert default_credentials("r.example:5000") == Credentials("sk", "sp")
    named = tmp_path / "auth.json"
    named.write_text(json.dumps({"auths": {"r.example:5000": {"auth": "bmFtZWQ6bnB3"}}}))  # named:npw
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(named))
    assert default_credentials("r.example:5000") == Credentials("named", "npw")
    monkeypatch.setenv("LAYERBOX_REGISTRY_USER", "env")
    monkeypatch.setenv("LAYERBOX_REGISTRY_PASSWORD", "envpw")
    assert default_credentials("r.example:5000") == Credentials("env", "envpw")
    assert "envpw" not in repr(default_credentials("x"))


def test_platform_parse_and_match() -> None:
    assert Platform.parse("linux/arm64/v8").matches(Platform("linux", "arm64"))
    assert not Platform.parse("linux/arm/v7").matches(Platform("linux", "arm", "v6"))
    assert Platform.parse("linux/amd64").matches(Platform("linux", "amd64", "v3"))
    with pytest.raises(ValueError, match="OS/ARCH"):
        Platform.parse("amd64")


# -- manifests, configs, indexes --------------------------------------------------------


@pytest.mark.asyncio
async def test_pull_manifest_and_config(client: RegistryClient, python_ref: str) -> None:
    image = await client.get_manifest(python_ref)
    assert image.manifest_digest == fixture_manifest_digest("python")
    assert image.manifest_media_type == "application/vnd.oci.image.manifest.v1+json"
    assert image.index_digest is None
    assert len(image.layers) == 3
    assert all(layer.media_type.endswith("tar+gzip") for layer in image.layers)
    assert image.config["config"]["Cmd"] == ["/bin/bash"]
    assert image.platform == Platform("linux", "amd64")
    config_bytes = await client.read_blob(image.reference, image.config_descriptor, limit=1 << 20)
    assert "sha256:" + hashlib.sha256(config_bytes).hexdigest() == image.config_digest
    manifest = await client.fetch_manifest(python_ref)
    assert manifest.header_digest == manifest.digest == image.manifest_digest
    # by digest: the same image, and the digest is checked
    pinned = await client.get_manifest(image.pinned)
    assert (pinned.manifest_digest, pinned.layers) == (image.manifest_digest, image.layers)
    assert pinned.reference.digest == image.manifest_digest


@pytest.mark.asyncio
async def test_docker_v2_schema2_manifest(client: RegistryClient, registry: RegistryServer, python_ref: str) -> None:
    push(f"oci-archive:{fixture_archive()}:python", f"{registry.host}/fixture/python-v2s2:latest",
         manifest_format="v2s2")
    oci = await client.get_manifest(python_ref)
    docker = await client.get_manifest(f"{registry.host}/fixture/python-v2s2:latest")
    assert docker.manifest_media_type == "application/vnd.docker.distribution.manifest.v2+json"
    assert docker.config_descriptor.media_type == "application/vnd.docker.container.image.v1+json"
    assert [d.media_type for d in docker.layers] == ["application/vnd.docker.image.rootfs.diff.tar.gzip"] * 3
    assert [d.digest for d in docker.layers] == [d.digest for d in oci.layers]
    assert docker.manifest_digest != oci.manifest_digest
    resolved = await asyncio.to_thread(inspect_image, f"docker://{registry.host}/fixture/python-v2s2:latest")
    assert resolved.manifest_media_type == docker.manifest_media_type
    assert [layer.digest for layer in resolved.layers] == [d.digest for d in oci.layers]


@pytest.mark.asyncio
async def test_platform_selection_on_index(client: RegistryClient, registry: RegistryServer, small: Small) -> None:
    ref = f"{registry.host}/fixture/multi:latest"
    index = await client.fetch_manifest(ref)
    assert index.kind == "index"
    assert index.digest == small.index["digest"]
    arm = await client.get_manifest(ref, "linux/arm64")
    amd = await client.get_manifest(ref, Platform("linux", "amd64"))
    assert (arm.manifest_digest, amd.manifest_digest) == (small.arm64["digest"], small.amd64["digest"])
    assert arm.index_digest == amd.index_digest == small.index["digest"]
    assert (str(arm.platform), arm.config["architecture"]) == ("linux/arm64", "arm64")
    assert arm.layers[0].digest == small.manifests[small.arm64["digest"]]["layers"][0]["digest"]
    assert (await client.get_manifest(ref)).manifest_digest == small.amd64["digest"]  # this host: amd64
    with pytest.raises(PlatformNotFound, match=r"linux/s390x; available: linux/amd64, linux/arm64"):
        await client.get_manifest(ref, "linux/s390x")
    # the index itself by digest, then the platform's manifest
    by_digest = await client.get_manifest(f"{registry.host}/fixture/multi@{small.index['digest']}", "linux/arm64")
    assert by_digest.manifest_digest == small.arm64["digest"]


@pytest.mark.asyncio
async def test_platform_selection_on_docker_manifest_list(
    client: RegistryClient, registry: RegistryServer, small: Small
) -> None:
    ref = f"{registry.host}/fixture/multi-docker:latest"
    index = await client.fetch_manifest(ref)
    assert (index.kind, index.media_type) == ("index", "application/vnd.docker.distribution.manifest.list.v2+json")
    arm = await client.get_manifest(ref, "linux/arm64")
    assert arm.manifest_media_type == "application/vnd.docker.distribution.manifest.v2+json"
    assert arm.index_digest == index.digest
    assert arm.config["architecture"] == "arm64"
    # skopeo rewrote the manifests, not the layers
    assert arm.layers[0].digest == small.manifests[small.arm64["digest"]]["layers"][0]["digest"]


@pytest.mark.asyncio
async def test_missing_tag_and_digest(client: RegistryClient, registry: RegistryServer, small: Small) -> None:
    with pytest.raises(ManifestNotFound, match=r"fixture/multi has no manifest tagged nope .*MANIFEST_UNKNOWN"):
        await client.get_manifest(f"{registry.host}/fixture/multi:nope")
    missing = "sha256:" + "0" * 64
    with pytest.raises(ManifestNotFound, match=f"fixture/multi has no manifest {missing}"):
        await client.get_manifest(f"{registry.host}/fixture/multi@{missing}")
    # docker-registry 2.8 says MANIFEST_UNKNOWN (not NAME_UNKNOWN) for a repository it never saw
    with pytest.raises(ManifestNotFound, match="repository no/such/repo has no manifest tagged latest"):
        await client.get_manifest(f"{registry.host}/no/such/repo:latest")
    with pytest.raises(BlobNotFound, match=f"repository fixture/multi has no blob {missing}"):
        await client.read_blob(parse_reference(f"{registry.host}/fixture/multi"),
                               Descriptor("x", missing, 1), limit=10)
    assert issubclass(ManifestNotFound, FileNotFoundError)
    assert issubclass(ManifestNotFound, OciError)
    assert issubclass(ManifestNotFound, ConvertError)


@pytest.mark.asyncio
async def test_oversized_manifest(client: RegistryClient, proxy: FaultProxy) -> None:
    huge = json.dumps({"schemaVersion": 2, "pad": "x" * (5 << 20)}).encode()
    proxy.faults.manifests["big/one/manifests/announced"] = (huge, "application/vnd.oci.image.manifest.v1+json", True)
    proxy.faults.manifests["big/one/manifests/chunked"] = (huge, "application/vnd.oci.image.manifest.v1+json", False)
    with pytest.raises(ManifestTooLarge, match=r"big/one manifest announced is \d+ bytes, more than the 4194304"):
        await client.get_manifest(f"{proxy.host}/big/one:announced")
    with pytest.raises(ManifestTooLarge, match="big/one manifest chunked is larger than the 4194304 byte limit"):
        await client.get_manifest(f"{proxy.host}/big/one:chunked")


@pytest.mark.asyncio
async def test_manifest_digest_checked(client: RegistryClient, proxy: FaultProxy, small: Small) -> None:
    # a registry answering a digest request with other bytes
    body = json.dumps(small.manifests[small.amd64["digest"]], indent=1).encode()
    proxy.faults.manifests[f"fixture/multi/manifests/{small.amd64['digest']}"] = (
        body, "application/vnd.oci.image.manifest.v1+json", True
    )
    with pytest.raises(BlobDigestMismatch, match="manifest sha256:.* hashing to sha256:"):
        await client.get_manifest(f"{proxy.host}/fixture/multi@{small.amd64['digest']}")


# -- blobs ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_blob_stream_verified(client: RegistryClient, registry: RegistryServer, small: Small) -> None:
    ref = parse_reference(f"{registry.host}/tamper/verify:latest")
    layer = small.manifests[small.verify["digest"]]["layers"][0]
    async with client.open_blob(ref, desc_of(layer)) as blob:
        data = b"".join([chunk async for chunk in blob])
    assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["digest"]
    wrong_size = Descriptor(layer["mediaType"], layer["digest"], layer["size"] + 1)
    with pytest.raises(BlobTruncated, match=f"tamper/verify blob {layer['digest']}"):
        await client.read_blob(ref, wrong_size, limit=1 << 20)


@pytest.mark.asyncio
async def test_corrupt_blob_in_storage(client: RegistryClient, registry: RegistryServer, small: Small) -> None:
    layer = small.manifests[small.verify["digest"]]["layers"][0]
    stored = registry.blob_file(layer["digest"])
    original = corrupt_file(stored, len(stored.read_bytes()) // 2)
    try:
        with pytest.raises(BlobDigestMismatch) as info:
            await client.read_blob(parse_reference(f"{registry.host}/tamper/verify"), desc_of(layer), limit=1 << 20)
    finally:
        stored.write_bytes(original)
    message = str(info.value)
    assert registry.host in message
    assert "tamper/verify" in message
    assert layer["digest"] in message
    assert info.value.expected == layer["digest"]
    assert info.value.actual != layer["digest"]


@pytest.mark.asyncio
@pytest.mark.parametrize(("cut", "requests"), [(0, 4), (25_000, 1)])
async def test_truncated_blob(
    client: RegistryClient, proxy: FaultProxy, small: Small, cut: int, requests: int
) -> None:
    """Closed before the first byte: retried (3 times); after bytes were delivered: final."""
    layer = small.manifests[small.verify["digest"]]["layers"][0]
    proxy.faults.truncate[layer["digest"]] = cut
    with pytest.raises(BlobTruncated) as info:
        await client.read_blob(parse_reference(f"{proxy.host}/tamper/verify"), desc_of(layer), limit=1 << 20)
    message = str(info.value)
    assert proxy.host in message
    assert "tamper/verify" in message
    assert layer["digest"] in message
    assert info.value.retryable
    assert sum(1 for _, path, _ in proxy.requests if path.endswith(layer["digest"])) == requests


@pytest.mark.asyncio
async def test_5xx_retried_then_given_up(client: RegistryClient, proxy: FaultProxy, small: Small) -> None:
    layer = small.manifests[small.amd64["digest"]]["layers"][0]
    ref = parse_reference(f"{proxy.host}/fixture/multi")
    proxy.faults.unavailable[layer["digest"]] = 2
    data = await client.read_blob(ref, desc_of(layer), limit=1 << 20)
    assert len(data) == layer["size"]
    proxy.faults.unavailable[layer["digest"]] = 100
    with pytest.raises(RegistryUnavailable, match="HTTP 503 after 3 retries") as info:
        await client.read_blob(ref, desc_of(layer), limit=1 << 20)
    assert info.value.retryable


@pytest.mark.asyncio
async def test_redirect_to_another_host(client: RegistryClient, proxy: FaultProxy, small: Small) -> None:
    layer = small.manifests[small.arm64["digest"]]["layers"][0]
    proxy.faults.redirect.add(layer["digest"])
    proxy.faults.basic = ALICE
    async with RegistryClient(credentials=lambda _r: Credentials(*ALICE), retry_delay=FAST) as authed:
        data = await authed.read_blob(
            parse_reference(f"{proxy.host}/fixture/multi"), desc_of(layer), limit=1 << 20
        )
    assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["digest"]
    cdn = [(path, auth) for where, path, auth in proxy.requests if where == "cdn"]
    assert cdn == [(f"fixture/multi/blobs/{layer['digest']}", None)]  # credentials stay home
    assert any(auth and auth.startswith("Basic ") for where, _, auth in proxy.requests if where == "proxy")


@pytest.mark.asyncio
async def test_basic_challenge(proxy: FaultProxy, small: Small) -> None:
    proxy.faults.basic = ALICE
    async with RegistryClient(credentials=lambda _r: None, retry_delay=FAST) as anonymous:
        with pytest.raises(RegistryAuthError, match=f"registry {proxy.host} requires credentials.*skopeo login"):
            await anonymous.get_manifest(f"{proxy.host}/fixture/multi:latest")
    async with RegistryClient(credentials=lambda _r: Credentials("alice", "nope"), retry_delay=FAST) as wrong:
        with pytest.raises(RegistryAuthError, match=f"credentials for {proxy.host} rejected"):
            await wrong.get_manifest(f"{proxy.host}/fixture/multi:latest")
    async with RegistryClient(credentials=lambda _r: Credentials(*ALICE), retry_delay=FAST) as right:
        image = await right.get_manifest(f"{proxy.host}/fixture/multi:latest")
    assert image.manifest_digest == small.amd64["digest"]


# -- bearer tokens against the registry in token auth mode ---------------------------------


@pytest.mark.asyncio
async def test_bearer_token_fetched_cached_reused(
    auth_registry: RegistryServer, token_server: TokenServer, small: Small
) -> None:
    ref = f"{auth_registry.host}/private/multi:latest"
    scope = "repository:private/multi:pull"
    before = token_server.tokens_for(scope)
    async with RegistryClient(credentials=lambda _r: Credentials(*ALICE), retry_delay=FAST) as c:
        image = await c.get_manifest(ref, "linux/arm64")  # index, manifest, config
        data = await c.read_blob(image.reference, image.layers[0], limit=1 << 20)
        await c.get_manifest(ref, "linux/amd64")
        assert c.token_fetches == 1
    assert image.manifest_digest == small.arm64["digest"]
    assert "sha256:" + hashlib.sha256(data).hexdigest() == image.layers[0].digest
    assert token_server.tokens_for(scope) == before + 1  # one token, reused for 6 requests


@pytest.mark.asyncio
async def test_bearer_without_or_with_wrong_credentials(auth_registry: RegistryServer, token_server: TokenServer) -> None:
    ref = f"{auth_registry.host}/private/multi:latest"
    async with RegistryClient(credentials=lambda _r: None, retry_delay=FAST) as anonymous:
        with pytest.raises(RegistryAuthError, match=f"registry {auth_registry.host} requires credentials by token server"):
            await anonymous.get_manifest(ref)
    async with RegistryClient(credentials=lambda _r: Credentials("alice", "wrong"), retry_delay=FAST) as wrong:
        with pytest.raises(
            RegistryAuthError,
            match=rf"credentials for {auth_registry.host} \(user 'alice'\) rejected .*skopeo login {auth_registry.host}",
        ):
            await wrong.get_manifest(ref)


def test_convert_through_token_auth_with_env_credentials(
    auth_registry: RegistryServer, small: Small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAYERBOX_REGISTRY_USER", ALICE[0])
    monkeypatch.setenv("LAYERBOX_REGISTRY_PASSWORD", ALICE[1])
    result = convert_image(f"docker://{auth_registry.host}/private/multi:latest", tmp_path / "out",
                           platform="linux/arm64")
    assert result.manifest_digest == small.arm64["digest"]
    assert result.transport == "docker"
    assert result.platform == "linux/arm64"
    monkeypatch.delenv("LAYERBOX_REGISTRY_USER")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "none.json"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with pytest.raises(RegistryAuthError, match="requires credentials"):
        inspect_image(f"docker://{auth_registry.host}/private/multi:latest")


# -- the sync bridge -------------------------------------------------------------------


def test_blob_stream_reads_verifies_and_closes(registry: RegistryServer, python_ref: str) -> None:
    with SyncRegistryClient() as sync:
        image = sync.get_manifest(python_ref)
        top = image.layers[2]
        with sync.open_blob(image.reference, top) as stream:
            data = stream.read()
            stream.verify()
        assert len(data) == top.size
        assert stream.count == top.size
        assert "sha256:" + hashlib.sha256(data).hexdigest() == top.digest
        # a big layer: read a little, then close; the download stops (the queue is bounded)
        base = image.layers[0]
        stream = sync.open_blob(image.reference, base)
        assert len(stream.read(1000)) <= 1000
        time.sleep(0.5)  # time enough to download all 63 MB over loopback without backpressure
        assert stream.queued <= BLOB_QUEUE_DEPTH
        with pytest.raises(RegistryError, match="verified before its end"):
            stream.verify()
        stream.close()
        with pytest.raises(ValueError, match="closed"):
            stream.read(1)
        assert sync.call(other_tasks()) == []  # the download task is gone
    assert not any(t.name == "layerbox-registry" for t in threading.enumerate())


def test_blob_stream_raises_download_errors(proxy: FaultProxy, small: Small) -> None:
    layer = small.manifests[small.verify["digest"]]["layers"][0]
    proxy.faults.truncate[layer["digest"]] = layer["size"] // 2
    with SyncRegistryClient(retry_delay=FAST) as sync, sync.open_blob(
        parse_reference(f"{proxy.host}/tamper/verify"), desc_of(layer)
    ) as stream, pytest.raises(BlobTruncated, match="tamper/verify blob"):
        stream.read()


# -- convert_image over docker:// --------------------------------------------------------


@pytest.fixture(scope="module")
def converted(python_ref: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    work = tmp_path_factory.mktemp("registry-convert")
    convert_image(f"oci-archive:{fixture_archive()}:python", work / "archive")
    convert_image(f"docker://{python_ref}", work / "registry")
    yield work / "archive", work / "registry"
    shutil.rmtree(work)  # a few hundred MB of layers


def test_convert_matches_archive(converted: tuple[Path, Path], python_ref: str) -> None:
    from_archive, from_registry = (json.loads((p / "image.json").read_text()) for p in converted)
    assert from_registry["source"]["transport"] == "docker"
    assert from_registry["source"]["ref"] == f"docker://{python_ref}"
    for key in ("manifest_digest", "manifest_media_type", "config_digest", "platform"):
        assert from_registry["source"][key] == from_archive["source"][key], key
    assert from_registry["config"] == from_archive["config"]
    assert len(from_registry["layers"]) == 3
    for a, r in zip(from_archive["layers"], from_registry["layers"], strict=True):
        assert (r["digest"], r["blob_digest"], r["oci"]) == (a["digest"], a["blob_digest"], a["oci"])
        assert (converted[1] / r["meta"]).read_bytes() == (converted[0] / a["meta"]).read_bytes()


def test_every_source_gives_the_same_layers_and_chain_ids(
    converted: tuple[Path, Path], python_ref: str, tmp_path: Path
) -> None:
    """The fixture's python image from a registry, an oci-archive, an oci directory and a
    docker-archive (skopeo stores its layers uncompressed): the same layers, diff ids and chain ids."""
    archive = fixture_archive()
    layout, saved = tmp_path / "layout", tmp_path / "python-docker.tar"
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="data")
    run(
        ["skopeo", "--insecure-policy", "copy", "--quiet", f"oci-archive:{archive}:python",
         f"docker-archive:{saved}:python:latest"],
        timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    docs = {
        "registry": json.loads((converted[1] / "image.json").read_text()),
        "oci-archive": json.loads((converted[0] / "image.json").read_text()),
    }
    for name, ref in (("oci", f"oci:{layout}:python"), ("docker-archive", f"docker-archive:{saved}:python:latest")):
        convert_image(ref, tmp_path / name)
        docs[name] = json.loads((tmp_path / name / "image.json").read_text())
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("./index.json"))  # type: ignore[arg-type]
        (desc,) = [m for m in index["manifests"] if m["annotations"][REF_NAME] == "python"]
        manifest = json.load(tar.extractfile("./blobs/sha256/" + desc["digest"][7:]))  # type: ignore[arg-type]
        config = json.load(tar.extractfile("./blobs/sha256/" + manifest["config"]["digest"][7:]))  # type: ignore[arg-type]
    diff_ids = config["rootfs"]["diff_ids"]
    chain = [diff_ids[0]]
    for diff_id in diff_ids[1:]:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    for name, doc in docs.items():
        layers = doc["layers"]
        assert [x["oci"]["diff_id"] for x in layers] == diff_ids, name
        assert [x["oci"]["chain_id"] for x in layers] == chain, name
        assert [(x["digest"], x["blob_digest"]) for x in layers] == [
            (x["digest"], x["blob_digest"]) for x in docs["registry"]["layers"]
        ], name
    gzip_digests = [x["digest"] for x in manifest["layers"]]
    for name in ("registry", "oci-archive", "oci"):
        assert [x["oci"]["digest"] for x in docs[name]["layers"]] == gzip_digests, name
    assert [x["oci"]["digest"] for x in docs["docker-archive"]["layers"]] == diff_ids


def test_inspect_and_convert_by_digest(python_ref: str, registry: RegistryServer, small: Small, tmp_path: Path) -> None:
    digest = fixture_manifest_digest("python")
    image = inspect_image(f"docker://{registry.host}/fixture/python@{digest}")
    assert image.manifest_digest == digest
    assert len(image.layers) == 3
    assert image.layers[0].path == f"/v2/fixture/python/blobs/{image.layers[0].digest}"
    ref = f"docker://{registry.host}/fixture/multi@{small.index['digest']}"
    result = convert_image(ref, tmp_path / "out", platform="linux/arm64")
    assert result.manifest_digest == small.arm64["digest"]
    assert result.source == ref


def test_convert_errors_map_to_converter_contract(registry: RegistryServer, tmp_path: Path) -> None:
    """One error tree: what a registry lacks is the same error (and ImageRefError) as for a layout."""
    with pytest.raises(ManifestNotFound, match="fixture/multi has no manifest tagged nope") as info:
        convert_image(f"docker://{registry.host}/fixture/multi:nope", tmp_path / "a")
    assert isinstance(info.value, ImageRefError)
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(PlatformNotFound, match="no image for platform linux/s390x") as platform_info:
        convert_image(f"docker://{registry.host}/fixture/multi:latest", tmp_path / "b", platform="linux/s390x")
    assert isinstance(platform_info.value, ImageRefError)
    with pytest.raises(ImageRefError, match="OS/ARCH"):
        inspect_image(f"docker://{registry.host}/fixture/multi:latest", platform="arm64")
    assert left_behind(tmp_path) == []


def test_corrupt_layer_found_by_verify_leaves_nothing(registry: RegistryServer, small: Small, tmp_path: Path) -> None:
    """A flipped bit in the gzip header's MTIME: inflating works, only the digest can tell."""
    layer = small.manifests[small.verify["digest"]]["layers"][0]
    stored = registry.blob_file(layer["digest"])
    original = corrupt_file(stored, 4)
    out = tmp_path / "out"
    try:
        with pytest.raises(LayerDigestMismatch) as info:
            convert_image(f"docker://{registry.host}/tamper/verify:latest", out)
    finally:
        stored.write_bytes(original)
    assert isinstance(info.value.__cause__, BlobDigestMismatch)  # raised by BlobStream.verify
    message = str(info.value)
    assert registry.host in message
    assert "tamper/verify" in message
    assert layer["digest"] in message
    assert (info.value.layer, info.value.expected) == (1, layer["digest"])
    assert left_behind(out) == []


def test_corrupt_layer_breaking_gzip_leaves_nothing(registry: RegistryServer, small: Small, tmp_path: Path) -> None:
    layer = small.manifests[small.inflate["digest"]]["layers"][0]
    stored = registry.blob_file(layer["digest"])
    original = corrupt_file(stored, layer["size"] // 2)
    out = tmp_path / "out"
    try:
        with pytest.raises(LayerDigestMismatch, match="tamper/inflate blob") as info:
            convert_image(f"docker://{registry.host}/tamper/inflate:latest", out)
    finally:
        stored.write_bytes(original)
    assert isinstance(info.value, DigestMismatch)
    assert left_behind(out) == []


def test_truncated_layer_leaves_nothing(proxy: FaultProxy, small: Small, tmp_path: Path) -> None:
    layer = small.manifests[small.verify["digest"]]["layers"][0]
    proxy.faults.truncate[layer["digest"]] = layer["size"] - 100
    out = tmp_path / "out"
    with pytest.raises(BlobTruncated, match=rf"{proxy.host}: tamper/verify blob {layer['digest']}"):
        convert_image(f"docker://{proxy.host}/tamper/verify:latest", out)
    assert left_behind(out) == []

