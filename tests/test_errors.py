"""Every error the project raises on purpose is a LayerboxError with an exit code, a retryable flag and a fix.

The class checks import every module of the six packages and look at every exception
class defined there; the source check reads the packages' ASTs for ``raise
RuntimeError`` / ``raise Exception``.  Each allow-list says why its entries stay.
"""

from __future__ import annotations

import ast
import errno
import importlib
import inspect
import pickle
import pkgutil
import sys
from argparse import ArgumentParser, Namespace
from pathlib import Path

import pytest

from converters.errors import BadEntry
from converters.ocispec import BlobTruncated, ClientNotOpen, RegistryUnavailable
from layerstore.backend import CredentialsError, PreconditionFailed, TransientError
from layerstore.backends.wrappers import RetriesExhausted
from layerstore.errors import LayerboxError
from layerstore.locks import StoreLocked
from lazyfetch.client import DaemonUnavailable
from lazyfetch.control import HTTPError
from lazyfetch.errors import FanotifyError, KernelMountError, LazyfetchError
from lazyfetch.fetcher import FetchTimeout
from sandbox.core.errors import (
    CommandInProgress,
    HostUnsupported,
    ImageNotFound,
    InvalidField,
    JobNotAdmitting,
    NotARegularFile,
    RuntimeTimeout,
    SandboxError,
)
from sandbox.edge.routes.commands import InputStalled
from sandbox.host.admission import CapacityExceeded
from sandbox.isolation.idmap import RANGE_SIZE, IdmapError, RangePool, RangesExhausted
from sandbox.isolation.landlock import LandlockError
from sandbox.isolation.nftables import NftError, NftUnavailable
from sandbox.isolation.seccomp import SeccompCompileError
from sandbox.pools.fncall import PoolCreateFailed, PoolsBusy
from sandbox.sdk.errors import ServiceUnavailable
from snapshots.containerd.grpcapi import StubsUnavailable
from snapshots.errors import SnapshotError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("layerstore", "converters", "lazyfetch", "snapshots", "sandbox", "tools")

# Exception classes of the packages that are not LayerboxErrors, and why.
NOT_LAYERBOX: dict[str, str] = {
    "lazyfetch.kmount._FallBack": "private control flow: the new mount API or lowerdir+ is missing, so "
                                  "mount_overlay falls back to mount(2); raised and caught inside kmount.py",
    "lazyfetch.fuseserver._Refused": "private control flow: the errno a FUSE request is answered with; "
                                     "raised and caught inside the server loop of fuseserver.py",
    "sandbox.backends.vm.agent._Broken": "private control flow: what the reader thread found the guest "
                                         "doing wrong; raised and caught inside its loop in agent.py, "
                                         "which turns it into AgentMisbehaved for every caller",
}

# Classes callers may retry unchanged: the ones the issue names, and the store's and the edge's.
RETRYABLE = (RangesExhausted, RuntimeTimeout, JobNotAdmitting, CommandInProgress, InputStalled,
             CapacityExceeded, PoolsBusy, PoolCreateFailed, ServiceUnavailable, TransientError,
             RetriesExhausted, StoreLocked, FetchTimeout, RegistryUnavailable, BlobTruncated)
# ... and some that must not be: the retry wrapper retries every retryable store error, and a
# lost conditional write must go back to its caller, who re-reads before writing again
NOT_RETRYABLE = (LayerboxError, PreconditionFailed, CredentialsError, ImageNotFound, InvalidField,
                 NotARegularFile, IdmapError, SeccompCompileError, NftError)

# `raise RuntimeError(...)` / `raise Exception(...)` that stay, by (file, name), and why.
GENERIC_RAISES: dict[tuple[str, str], str] = {
    ("sandbox/core/sync.py", "RuntimeError"):
        "run_blocking: a blocking library call made from inside an event loop is a caller's bug, raised as the "
        "RuntimeError asyncio.run itself raises for it",
}


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the packages, by dotted name."""
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.rsplit(".", 1)[-1] != "__main__":  # those run a program when imported
                importlib.import_module(info.name)
    found: dict[str, type[BaseException]] = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in PACKAGES:
            continue
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__.split(".")[0] in PACKAGES):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


CLASSES = _exception_classes()


def test_the_walk_finds_the_project_s_exceptions() -> None:
    """Not a vacuous pass: the walk reaches leaves deep in every package, and the allow-list is current."""
    for cls in (RangesExhausted, HTTPError, StubsUnavailable, ClientNotOpen, BadEntry, DaemonUnavailable,
                CapacityExceeded, InputStalled):
        assert CLASSES[f"{cls.__module__}.{cls.__qualname__}"] is cls
    assert len(CLASSES) > 100
    assert set(NOT_LAYERBOX) <= set(CLASSES), "an allow-listed class is gone: drop it from NOT_LAYERBOX"


def test_every_exception_class_is_a_layerbox_error() -> None:
    outside = sorted(name for name, cls in CLASSES.items()
                     if not issubclass(cls, LayerboxError) and name not in NOT_LAYERBOX)
    assert outside == [], "derive them from their package's root (STYLE practice 7)"
    assert not [name for name in NOT_LAYERBOX if issubclass(CLASSES[name], LayerboxError)]


@pytest.mark.parametrize("name", sorted(n for n, c in CLASSES.items() if issubclass(c, LayerboxError)))
def test_attributes_have_their_types(name: str) -> None:
    cls = CLASSES[name]
    assert issubclass(cls, LayerboxError)
    assert type(cls.retryable) is bool
    assert type(cls.exit_code) is int
    assert cls.fix is None or (isinstance(cls.fix, str) and cls.fix.strip())


def test_retryable_ones_are_marked() -> None:
    assert [c.__name__ for c in RETRYABLE if not c.retryable] == []
    assert [c.__name__ for c in NOT_RETRYABLE if c.retryable] == []


def test_the_issue_s_classes_sit_under_their_package_roots() -> None:
    """Each keeps a builtin base only where callers catch that builtin (see each class's docstring)."""
    assert issubclass(NftError, SandboxError)
    assert issubclass(NftUnavailable, HostUnsupported)  # the host lacks libnftables
    for cls in (LandlockError, IdmapError):  # raised inside files-API operations, which callers catch as OSError
        assert issubclass(cls, SandboxError)
        assert issubclass(cls, OSError)
    assert issubclass(SeccompCompileError, SandboxError)
    assert not issubclass(SeccompCompileError, OSError)
    assert issubclass(HTTPError, LazyfetchError)
    assert issubclass(RangesExhausted, SandboxError)
    # a full pool is capacity, not a problem with the request's files (what OSError says to the edge)
    assert not issubclass(RangesExhausted, OSError)
    assert issubclass(StubsUnavailable, SnapshotError)
    assert issubclass(ClientNotOpen, RuntimeError)  # what using a closed client raised before


def test_fix_and_retryable_per_instance() -> None:
    plain = SandboxError("sandbox x: no")
    assert (plain.fix, plain.retryable, plain.exit_code) == (None, False, 1)
    told = SandboxError("sandbox x: busy", fix="wait", retryable=True)
    assert (told.fix, told.retryable, str(told)) == ("wait", True, "sandbox x: busy")
    assert (SandboxError.retryable, SandboxError.fix) == (False, None)  # the class is untouched
    assert RuntimeTimeout("crun: slow").retryable  # the class's own value when the raise says nothing
    again = pickle.loads(pickle.dumps(told))
    assert (again.fix, again.retryable, str(again)) == ("wait", True, "sandbox x: busy")


def test_constructors_with_positional_errnos_still_work() -> None:
    odd = NotARegularFile(errno.EINVAL, "/dev/x", "FIFO")
    assert (odd.errno, odd.filename, odd.fix, odd.retryable) == (errno.EINVAL, "/dev/x", None, False)
    busy = KernelMountError(errno.EBUSY, operation="umount", source=None, mountpoint="/mnt/x", fstype=None,
                            hint="something still reads it")
    assert (busy.errno, busy.fix) == (errno.EBUSY, "something still reads it")
    assert "something still reads it" in str(busy)
    assert FanotifyError(errno.EPERM, "fanotify_init", hint="run as root").fix == "run as root"
    refused = IdmapError(errno.EINVAL, "'/x' is not an overlay mount")
    assert (refused.errno, str(refused)) == (errno.EINVAL, "[Errno 22] '/x' is not an overlay mount")
    assert BadEntry("../x", 512, "escapes the root", "drop it from the archive").fix == "drop it from the archive"
    assert BadEntry("x", None, "no target").fix is None


def test_http_error_retryable_follows_its_status() -> None:
    assert HTTPError(503, "not ready").retryable
    assert not HTTPError(400, "not JSON").retryable
    assert HTTPError(409, "layer busy", retryable=True).retryable


def test_a_full_uid_pool_is_a_retryable_sandbox_error_naming_the_pool(tmp_path: Path) -> None:
    """The bug this fixes: RangesExhausted was an OSError, so the edge answered 400 os_error."""
    pool = RangePool(tmp_path / "userns.json", first=RANGE_SIZE * 4, slots=1)
    assert pool.allocate("lb-one") == (RANGE_SIZE * 4, RANGE_SIZE)
    with pytest.raises(SandboxError) as full:
        pool.allocate("lb-two")
    assert isinstance(full.value, RangesExhausted)
    assert full.value.retryable
    assert full.value.fix
    assert str(pool.path) in str(full.value)
    assert not isinstance(full.value, OSError)
    from sandbox.edge.errors import as_api_error as _as_api_error

    answer = _as_api_error(full.value)
    assert (answer.retryable, answer.status >= 500) == (True, True), (answer.status, answer.code)
    pool.release("lb-one")
    assert pool.allocate("lb-two") == (RANGE_SIZE * 4, RANGE_SIZE)  # what retrying after a destroy gets


def test_cli_prints_the_fix_after_the_message(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tools import cli

    def failing(error: LayerboxError) -> ArgumentParser:
        def run(_: Namespace) -> int:
            raise error

        parser = ArgumentParser()
        parser.set_defaults(verb=cli.Verb("fail", "fails on purpose", run, ()))
        return parser

    monkeypatch.setattr(cli, "build_parser", lambda: failing(StoreLocked("file:///s: locked by gc", fix="wait")))
    assert cli.main([]) == 1
    assert capsys.readouterr().err.splitlines() == ["layerbox: file:///s: locked by gc", "layerbox: fix: wait"]
    # a message that already ends with its fix is not followed by it again
    monkeypatch.setattr(cli, "build_parser", lambda: failing(ClientNotOpen("closed: use with", fix="use with")))
    assert cli.main([]) == 2  # ConvertError's exit code
    assert capsys.readouterr().err.splitlines() == ["layerbox: closed: use with"]


# -- the source -------------------------------------------------------------------------------
def _generic_raises(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id in ("RuntimeError", "Exception"):
                out.append((node.lineno, target.id))
    return out


def test_no_generic_raises_in_the_packages() -> None:
    found: dict[tuple[str, str], list[int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_generated" in path.parts:  # protoc's output, not ours
                continue
            rel = str(path.relative_to(ROOT))
            for line, name in _generic_raises(ast.parse(path.read_text(), rel)):
                found.setdefault((rel, name), []).append(line)
    unexplained = {f"{rel}:{lines}: raise {name}" for (rel, name), lines in found.items()
                   if (rel, name) not in GENERIC_RAISES}
    assert unexplained == set(), "raise the package's LayerboxError leaf (a new one where none fits)"
    assert set(GENERIC_RAISES) <= set(found), "an allow-listed raise is gone: drop it from GENERIC_RAISES"


def test_the_source_check_sees_what_it_looks_for() -> None:
    probe = ast.parse("raise RuntimeError('x')\nraise Exception\nraise ValueError('fine')\nraise\n")
    assert _generic_raises(probe) == [(1, "RuntimeError"), (2, "Exception")]


# -- the edge's answer for each error class ---------------------------------------------------------
LAYERBOX_CLASSES = sorted((name, cls) for name, cls in CLASSES.items() if issubclass(cls, LayerboxError))


@pytest.mark.parametrize(("name", "cls"), LAYERBOX_CLASSES, ids=[n for n, _ in LAYERBOX_CLASSES])
def test_each_error_class_keeps_its_status_and_retryable_flag_at_the_edge(name: str, cls: type) -> None:
    """Every LayerboxError answers by its own class, never by a builtin base it also has: a
    retryable one answers a status a client retries (429, 503, 502, 504), a 4xx only for what
    the caller got wrong or may not see, and the flag travels in the body."""
    from sandbox.core.errors import ERROR_CODES
    from sandbox.edge.errors import code_of

    retryable = bool(cls.retryable)
    code = code_of(cls, retryable=retryable)
    status = ERROR_CODES[code]
    assert 400 <= status < 600, (name, code)
    if retryable:
        assert status in (409, 429, 502, 503, 504), (name, code, status)  # 409: retry once it changed
    if code in ("os_error", "file_not_found", "file_conflict", "permission_denied"):
        # the builtin rows are the kernel's answers to the files API; a LayerboxError reaches one only
        # through a row of its own (path_escape, not_a_regular_file...), never through its builtin base
        pytest.fail(f"{name} answers {code} by its builtin base")


EXPECTED_ANSWERS = [
    # (class, status, code, retryable): the ones callers act on, the issue's full uid pool among them
    (RangesExhausted, 503, "busy", True),
    (RuntimeTimeout, 503, "runtime_timeout", True),
    (JobNotAdmitting, 409, "conflict", True),
    (CommandInProgress, 409, "conflict", True),
    (CapacityExceeded, 503, "capacity", True),
    (TransientError, 503, "busy", True),
    (FetchTimeout, 503, "busy", True),
]


@pytest.mark.parametrize(("cls", "status", "code", "retryable"), EXPECTED_ANSWERS,
                         ids=[c.__name__ for c, *_ in EXPECTED_ANSWERS])
def test_retryable_errors_answer_retryable(cls: type, status: int, code: str, retryable: bool) -> None:
    from sandbox.core.errors import ERROR_CODES
    from sandbox.edge.errors import code_of

    assert (ERROR_CODES[code_of(cls, retryable=cls.retryable)], code_of(cls, retryable=cls.retryable),
            cls.retryable) == (status, code, retryable)


def test_error_answers_built_from_instances() -> None:
    """The whole answer (status, code, retryable, field, Retry-After) of errors as they are raised."""
    from layerstore.objects import BadName
    from lazyfetch.errors import KernelMountError
    from sandbox.core.errors import (
        HostUnsupported,
        ImageNotFound,
        InvalidField,
        NotARegularFile,
        PathEscape,
        ReceiptsBroken,
        SandboxNotFound,
        SandboxStateError,
        UnsupportedOption,
    )
    from sandbox.edge.errors import as_api_error
    from snapshots.errors import CheckpointMismatch

    def answer(exc: BaseException) -> tuple[int, str, bool]:
        err = as_api_error(exc)
        return err.status, err.code, err.retryable

    full = as_api_error(RangesExhausted("all 1 uid ranges of /d/userns.json are in use"))
    assert (full.status, full.code, full.retryable, full.headers()["Retry-After"]) == (503, "busy", True, "1")
    bad = as_api_error(InvalidField("memory", "is not an integer"))
    assert (bad.status, bad.code, bad.field) == (400, "invalid_field", "memory")
    assert answer(BadName("x::y is not a ref")) == (400, "invalid_field", False)
    assert answer(SandboxNotFound("no sandbox lb-000000000000")) == (404, "sandbox_not_found", False)
    assert answer(ImageNotFound("img/x")) == (404, "image_not_found", False)
    assert answer(PathEscape(18, "/a: refused", "/a")) == (403, "path_escape", False)
    assert answer(NotARegularFile(22, "/dev/x", "FIFO")) == (409, "not_a_regular_file", False)
    assert answer(SandboxStateError("paused")) == (409, "conflict", False)
    assert answer(CheckpointMismatch("policy")) == (409, "conflict", False)
    assert answer(UnsupportedOption("memory: ...")) == (400, "unsupported_option", False)
    assert answer(ReceiptsBroken("cut")) == (500, "receipts_broken", False)
    assert answer(HostUnsupported("no QEMU")) == (501, "host_unsupported", False)
    # a kernel mount failure is this host's, not the caller's: not the OSError row's 400
    assert answer(KernelMountError(16, operation="mount", source=None, mountpoint="/m", fstype="erofs"))[:2] == (
        500, "lazyfetch_error")
    # the kernel's own errors of the files API keep their rows
    assert answer(FileNotFoundError(2, "No such file or directory", "/x")) == (404, "file_not_found", False)
    assert answer(IsADirectoryError(21, "Is a directory", "/x")) == (409, "file_conflict", False)
    assert answer(OSError(22, "Invalid argument")) == (400, "os_error", False)
    assert answer(ValueError("a bug")) == (500, "internal", False)


def test_every_code_the_edge_answers_has_its_status() -> None:
    """An ApiError raised by its code alone takes its status from ERROR_CODES: a code missing there
    would answer 500 (and a client would not know it); the probe shows the scan sees them."""
    import re

    from sandbox.core.errors import ERROR_CODES

    used = set()
    for path in (ROOT / "sandbox").rglob("*.py"):
        used |= set(re.findall(r'ApiError\(None, "([a-z_]+)"', path.read_text()))
    assert {"bad_signature", "quota_exceeded", "port_closed"} <= used
    assert sorted(used - set(ERROR_CODES)) == []
