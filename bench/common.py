"""Helpers every benchmark uses: its error, logging, rates, tables, the JSON-or-table output,
a fake-credentials AWS environment.

The benchmarks run as scripts (``python bench/NAME.py``), so they import this as ``common``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

MB = 1_000_000

AWS_LEAKS = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
             "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
             "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


class BenchError(Exception):
    """The benchmark cannot run or a step failed; the message says what to do."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit(doc: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str]) -> None:
    """The run's result on stdout: one JSON document, or the tables."""
    if as_json:
        json.dump(doc, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render(doc))


def rate(nbytes: int, seconds: float) -> float | None:
    return nbytes / MB / seconds if seconds > 0 else None


@contextlib.contextmanager
def aws_environment(endpoint: str, home: Path, *, access_key: str = "testing", secret_key: str = "testing",
                    region: str = "us-east-1") -> Iterator[None]:
    """Point boto3 at the S3 server the bench started (moto: fake credentials; an RGW: the keys it
    made for the run) and at no config of the host's; restore the environment after."""
    saved = dict(os.environ)
    try:
        for name in AWS_LEAKS:
            os.environ.pop(name, None)
        os.environ.update({
            "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": region,
            "AWS_CONFIG_FILE": str(home / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
        })
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def remove_tree(path: Path) -> None:
    """rm -rf, also when extracted directories lack write permission (non-root runs)."""

    def fix(func: Callable[..., Any], failed: str, _exc: Any) -> None:
        parent = os.path.dirname(failed)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
        func(failed)

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=fix)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def workspace(base: Path, prefix: str, *, before_removal: Callable[[Path], None] | None = None,
              after_removal: Callable[[], None] | None = None) -> Iterator[Path]:
    """A fresh directory under ``base``, removed however the benchmark ends (SIGTERM and SIGHUP
    unwind through every ``finally`` like Ctrl-C does)."""
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield path
    finally:
        try:
            if before_removal is not None:
                before_removal(path)
            remove_tree(path)
            if after_removal is not None:
                after_removal()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


# -- figures ------------------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": pct(values, 50), "p99": pct(values, 99),
            "min": min(values) if values else None, "max": max(values) if values else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
