"""Hosts for tests: a data dir with its own lazyfetch daemon, torn down even on failure."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from converters.publish import publish
from layerstore.store import Store
from lazyfetch import kmount
from lazyfetch.mounts import HostMounts


def publish_sync(url: str, data_dir: Path, src: str, name: str) -> str:
    async def run() -> str:
        async with await Store.open(url, data_dir) as s:
            return (await publish(s, src, name)).digest

    return asyncio.run(run())


def resolve_sync(url: str, data_dir: Path, ref: str):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        async with await Store.open(url, data_dir) as s:
            return await s.resolve(ref, refresh=True)

    return asyncio.run(run())


class Host:
    def __init__(self, root: Path, url: str, **daemon_options: object) -> None:
        self.data_dir = root
        self.url = url
        self.mounts = HostMounts(root, url, daemon_options=dict(daemon_options))
        self.points: list[Path] = []

    def mount(self, ref: str, *, writable: bool = False) -> Path:
        mp = self.data_dir.parent / f"mnt-{self.data_dir.name}-{len(self.points)}"
        mp.mkdir()
        self.mounts.mount(resolve_sync(self.url, self.data_dir, ref), mp, writable=writable)
        self.points.append(mp)
        return mp

    def stats(self) -> dict:
        return dict(self.mounts.client.request("GET", "/stats"))

    def daemon_pid(self) -> int:
        health = self.mounts.client.health()
        assert health is not None
        return int(health["pid"])

    def close(self) -> list[str]:
        problems = []
        try:
            self.mounts.umount_all(stop_daemon=True)
        except Exception as exc:  # keep tearing down; report at the end
            problems.append(f"umount_all: {exc}")
        for mp in kmount.mounts_under(self.data_dir) + [str(p) for p in self.points if kmount.is_mountpoint(p)]:
            problems.append(f"left mounted: {mp}")
            kmount.umount(mp, lazy=True, missing_ok=True)
        return problems


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Callable[..., Host]]:
    made: list[Host] = []

    def make(url: str, name: str = "host", **options: object) -> Host:
        options.setdefault("fetch_timeout", 5.0)
        options.setdefault("trace_seconds", 1.0)
        # no background fill unless a test asks: tests count the bytes each read fetches
        options.setdefault("fill_below", 0)
        h = Host(tmp_path / name, url, **options)
        made.append(h)
        return h

    yield make
    problems = [p for h in reversed(made) for p in h.close()]
    assert not problems, problems


