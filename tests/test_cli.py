"""``layerbox`` (tools/cli.py) as a table of verbs: every row has a parser and a function, the help
lists every verb, ``sandbox create`` and ``sandbox exec`` take their defaults from the model, and
verbs run through ``main`` (sync, async, and a group whose verb follows its options).

Root-free and fast: nothing here starts a sandbox or mounts anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.core import model
from tools import cli

ROOT = Path(__file__).resolve().parent.parent


def groups(verbs: tuple[cli.Verb, ...] = cli.VERBS,
           path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], tuple[cli.Verb, ...]]]:
    """Every list of verbs in the table with the argv that reaches it: the top level first."""
    yield path, verbs
    for verb in verbs:
        if verb.verbs:
            yield from groups(verb.verbs, (*path, verb.name))


def leaves() -> Iterator[tuple[tuple[str, ...], cli.Verb]]:
    for path, verbs in groups():
        for verb in verbs:
            if not verb.verbs:
                yield (*path, verb.name), verb


def sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(found[0].choices) if found else {}


def parser_at(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    for name in path:
        parser = sub_parsers(parser)[name]
    return parser


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _row(path: tuple[str, ...]) -> cli.Verb:
    verbs, row = cli.VERBS, None
    for name in path:
        row = next(v for v in verbs if v.name == name)
        verbs = row.verbs
    assert row is not None
    return row


def test_every_verb_has_a_parser_and_a_function() -> None:
    for path, verbs in groups():
        names = [v.name for v in verbs]
        assert len(set(names)) == len(names), f"{path}: a verb twice"
        if path and _row(path).pick:
            # a pick group's verbs are the choices of one positional: parsing one selects its row
            for verb in verbs:
                assert cli.build_parser().parse_args([*path, verb.name]).verb is verb
            continue
        parsers = sub_parsers(parser_at(path))
        assert list(parsers) == names, path
        for verb in verbs:
            assert parsers[verb.name].get_default("verb") is (None if verb.verbs else verb), (*path, verb.name)
    for path, verb in leaves():
        assert callable(verb.run), path
        assert verb.run.__name__.startswith("cmd_"), path
    assert {path for path, verb in leaves() if verb.is_async} >= {("publish",), ("sandbox", "create")}


def test_help_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    for path, verbs in groups():
        text = help_text(list(path), capsys)
        assert "{" + ",".join(v.name for v in verbs) + "}" in text, path
        squeezed = "".join(text.split())  # help wraps lines at spaces and hyphens
        for verb in verbs:
            assert "".join(verb.help.split()) in squeezed, (path, verb.name)


def test_sandbox_create_defaults_are_the_models() -> None:
    args = cli.build_parser().parse_args(["sandbox", "create", "img"])
    assert cli._sandbox_options(args) == model.SandboxOptions()
    defaults = {f.name: f.default for f in dataclasses.fields(model.SandboxOptions)}
    for name in cli._create_flags(model):
        if name != "env":
            assert getattr(args, name) == defaults[name], name
    assert args.env == []


def test_parser_follows_a_changed_model(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    @dataclasses.dataclass(frozen=True)
    class Options(model.SandboxOptions):
        pids: int = 99
        memory: int = 64 << 20
        cpu_class: model.CpuClass = "best-effort"
        env: dict[str, str] = dataclasses.field(default_factory=lambda: {"LANG": "C.UTF-8"})

    @dataclasses.dataclass(frozen=True)
    class Exec(model.ExecRequest):
        output_cap: int = 4096

    monkeypatch.setattr(model, "SandboxOptions", Options)
    monkeypatch.setattr(model, "ExecRequest", Exec)
    args = cli.build_parser().parse_args(["sandbox", "create", "img"])
    assert (args.pids, args.memory, args.cpu_class, args.env) == (99, 64 << 20, "best-effort",
                                                                  [("LANG", "C.UTF-8")])
    assert cli._sandbox_options(args) == Options()
    given = cli.build_parser().parse_args(["sandbox", "create", "img", "--pids", "7"])
    assert cli._sandbox_options(given) == Options(pids=7)
    assert "(default 99)" in help_text(["sandbox", "create"], capsys)
    assert cli.build_parser().parse_args(["sandbox", "exec", "lb-1", "--", "true"]).output_cap == 4096


@pytest.mark.parametrize("argv", [["sandbox", "nope"], ["daemon", "nope"], ["vm", "nope"], ["sandbox"]])
def test_unknown_action_is_refused_by_argparse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_edge_is_the_edge_services_own_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    """`layerbox edge` hands every argument to sandbox.edge.app.main, its options included."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["edge", "--help"])
    assert exited.value.code == 0
    assert "--max-commands-per-project" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        cli.main(["edge", "--data-dir", "/nonexistent", "--store", "file:///nonexistent", "--tokens", "/nonexistent",
                  "--no-such-flag"])
    assert exited.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_verbs_run_through_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Async verbs (publish, ls, cache) and a pick group with its options before the verb."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "b").write_bytes(b"hello")
    store = ["--store", f"file://{tmp_path / 'store'}", "--data-dir", str(tmp_path / "host")]
    assert cli.main(["publish", str(src), "--name", "t/img:1", *store, "--json"]) == 0
    published = json.loads(capsys.readouterr().out)
    assert cli.main(["ls", *store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "t/img:1", "digest": published["digest"],
                                                    "kind": "image"}]
    assert cli.main(["cache", *store, "rebuild", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["refs"] == "1"
    assert cli.main(["cache", "drop", *store]) == 0
    assert capsys.readouterr().out.startswith("dropped=")
    assert cli.main(["show", "t/nope", *store]) != 0
    assert "t/nope" in capsys.readouterr().err


def test_one_bridge_into_asyncio() -> None:
    for path in sorted((ROOT / "tools").glob("*.py")):
        assert "asyncio.run(" not in path.read_text(), f"{path.name}: use sandbox.core.sync.run_blocking"
