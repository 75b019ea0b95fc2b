"""The one way tests run external programs.

argv lists only (no shell), a timeout that kills the whole process group
(so a hung ``mkfs``/``fsck``/daemon and its children all go), and errors that
carry the command's stderr so a failing test shows why.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence

_OUTPUT_LIMIT = 20_000  # characters of each stream kept in error messages


def _text(data: bytes | None) -> str:
    text = (data or b"").decode("utf-8", "backslashreplace")
    if len(text) > _OUTPUT_LIMIT:
        text = "...[truncated]...\n" + text[-_OUTPUT_LIMIT:]
    return text


def _describe(argv: Sequence[str], stdout: bytes | None, stderr: bytes | None) -> str:
    parts = [f"command: {shlex.join(argv)}"]
    if stderr:
        parts.append(f"stderr:\n{_text(stderr)}")
    if stdout:
        parts.append(f"stdout:\n{_text(stdout)}")
    return "\n".join(parts)


class CommandFailed(subprocess.CalledProcessError):
    """A command exited non-zero; ``str()`` includes its stderr and stdout."""

    def __str__(self) -> str:
        argv = [str(a) for a in self.cmd]
        return f"exit status {self.returncode}\n" + _describe(argv, self.stdout, self.stderr)


class CommandTimedOut(subprocess.TimeoutExpired):
    """A command ran past its timeout and its process group was killed."""

    def __str__(self) -> str:
        argv = [str(a) for a in self.cmd]
        return (f"timed out after {self.timeout} s (process group killed)\n"
                + _describe(argv, self.stdout, self.stderr))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    check: bool = True,
    input: bytes | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` and return its result with stdout and stderr captured as bytes.

    Raises :class:`CommandTimedOut` after ``timeout`` seconds (always, having
    killed the process group) and :class:`CommandFailed` on a non-zero exit
    when ``check``.
    """
    args = [os.fspath(a) for a in argv]
    # A new session makes the child a process-group leader, so killpg() also
    # reaches whatever it started.
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=None if env is None else dict(env),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            stdout, stderr = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild left the group and holds the pipes
            proc.wait()
            stdout, stderr = b"", b""
        raise CommandTimedOut(args, timeout, stdout, stderr) from None
    except BaseException:
        # KeyboardInterrupt or a test-runner signal: leave nothing behind.
        _kill_group(proc)
        proc.wait()
        raise
    if check and proc.returncode != 0:
        raise CommandFailed(proc.returncode, args, stdout, stderr)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
