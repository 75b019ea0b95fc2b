"""The blocking SDK, derived from the async one so that the two cannot drift.

A blocking class names its async twin and maps each of the twin's public coroutines
to a blocking method in one line::

    class Sandbox(Blocking[AsyncSandbox], twin=AsyncSandbox):
        create = opens(AsyncSandbox.create)                # an async constructor -> a blocking one
        restore_many = opens_each(AsyncSandbox.restore_many)   # ... one making a list of them
        refresh = blocking(AsyncSandbox.refresh)           # await it on this object's private loop
        kill = blocking(AsyncSandbox.kill, closes=True)    # ... and then close that loop
        fork = handing_out(AsyncSandbox.fork, _forks)      # a result holding async objects: wrapped
        port_url = delegated(AsyncSandbox.port_url)        # a plain method: called as it is

:func:`blocking` and :class:`opens` keep the coroutine's parameters for mypy (ParamSpec:
a typo in a keyword is a type error in both APIs) and for ``inspect``/``help``, and its
docstring.  A blocking class that lacks a twin of a public coroutine raises TypeError when
the module is imported, naming the line to add.

Each blocking object drives its async twin on a private event loop (an
:class:`asyncio.Runner`), shared with the objects it hands out (a sandbox's ``commands``
and ``files``); callbacks run on the calling thread.  Use one from one thread at a time,
and not from inside a running event loop (use the async class there).  What runs in the
background of an async object (the reader of a command's output) runs while a call of the
blocking one does: a handle's output arrives, and its callbacks run, during its ``wait()`` or
any other call on that sandbox.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar

from sandbox.core.errors import SandboxError

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B", bound="Part[Any]")
F = TypeVar("F", bound=Callable[..., Any])


class _AsyncContext(Protocol):
    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None: ...


C = TypeVar("C", bound=_AsyncContext)


class Loop:
    """The private event loop of one blocking object (and of the objects it handed out)."""

    def __init__(self) -> None:
        self._runner: asyncio.Runner | None = asyncio.Runner()

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the coroutine ``make()`` returns to completion and return its result (or raise its error).

        Once closed, the async object is closed too, so its coroutine raises
        :class:`~sandbox.sdk.errors.SandboxClosed` (or returns, for a repeated close) without
        any I/O: a throwaway loop runs it, and the async side stays the one that decides.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise SandboxError("the blocking SDK cannot run inside a running event loop (it would block "
                               "that loop): use the Async* classes there")
        if self._runner is None:
            with asyncio.Runner() as once:
                return once.run(make())
        return self._runner.run(make())

    def close(self) -> None:
        """Close the loop (idempotent); the async object must have closed its HTTP session first."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            runner.close()


def _coroutines(cls: type[Any]) -> dict[str, Callable[..., Any]]:
    """The public coroutine functions of ``cls`` (methods, classmethods and staticmethods) by name."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        if inspect.iscoroutinefunction(fn):
            out[name] = fn
    return out


class Part(Generic[A]):
    """A blocking view of the async object ``A``, on a loop it may share with the object that made it.

    Subclasses name their twin (``class Files(Part[AsyncFiles], twin=AsyncFiles)``) and must
    define a blocking twin of every public coroutine it has.
    """

    _twin: ClassVar[type[Any]]  # the async class this one is derived from
    _loop: Loop
    _inner: A

    def __init_subclass__(cls, *, twin: type[Any] | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if twin is None:
            return
        missing = [name for name in _coroutines(twin) if name not in vars(cls)]
        if missing:
            lines = "; ".join(f"{n} = blocking({twin.__name__}.{n})" for n in missing)
            raise TypeError(f"{cls.__name__} lacks blocking twins of {twin.__name__}'s coroutines "
                            f"{', '.join(missing)}: add {lines}")
        cls._twin = twin

    @classmethod
    def _wrap(cls, loop: Loop, inner: A) -> Self:
        twin = cls.__new__(cls)
        twin._bind(loop, inner)
        return twin

    def _bind(self, loop: Loop, inner: A) -> None:
        """Attach to ``inner`` on ``loop``; a subclass wraps the parts ``inner`` hands out here too."""
        self._loop, self._inner = loop, inner


class Blocking(Part[C]):
    """A blocking object that owns its loop: ``with`` it as its async twin is used with ``async with``."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._loop.run(lambda: self._inner.__aexit__(exc_type, exc, tb))
        finally:
            self._loop.close()


def blocking(method: Callable[Concatenate[A, P], Coroutine[Any, Any, R]], *,
             closes: bool = False) -> Callable[Concatenate[Part[A], P], R]:
    """The blocking twin of the coroutine method ``method``: same parameters, same docstring.

    ``closes``: the method closes the async object (``kill``, ``close``); the loop is closed
    after it, whatever it raised.
    """
    @functools.wraps(method)
    def run(self: Part[A], /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return self._loop.run(lambda: method(self._inner, *args, **kwargs))
        finally:
            if closes:
                self._loop.close()
    return run


class opens(Generic[P, A]):  # noqa: N801  (used as a function in class bodies, like classmethod)
    """The blocking twin of an async constructor (a classmethod or staticmethod returning ``A``).

    On the blocking class it is a callable with the constructor's parameters that runs it on
    a new private loop and returns the blocking class wrapped around the result, on that loop.
    """

    def __init__(self, make: Callable[P, Coroutine[Any, Any, A]]) -> None:
        self._make = make
        self.__doc__ = make.__doc__

    def __get__(self, obj: object, owner: type[B]) -> Callable[P, B]:
        make = self._make

        @functools.wraps(make)
        def open_(*args: P.args, **kwargs: P.kwargs) -> B:
            loop = Loop()
            try:
                return owner._wrap(loop, loop.run(lambda: make(*args, **kwargs)))
            except BaseException:
                loop.close()
                raise
        open_.__signature__ = inspect.signature(make).replace(  # type: ignore[attr-defined]
            return_annotation=owner.__name__)
        return open_


def oneshot(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, R]:
    """The blocking twin of an async function or staticmethod that owns no object: run on a throwaway loop."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        loop = Loop()
        try:
            return loop.run(lambda: fn(*args, **kwargs))
        finally:
            loop.close()
    return run


def handing_out(method: Callable[Concatenate[A, P], Coroutine[Any, Any, R]],
                wrap: Callable[[Loop, R], T]) -> Callable[Concatenate[Part[A], P], T]:
    """The blocking twin of a coroutine method whose result holds async objects it hands out (a
    command's handle, forked sandboxes): ``wrap(loop, result)`` makes their blocking twins, on
    ``loop`` (this object's, for parts of it) or on loops of their own (for objects to close apart).
    """
    @functools.wraps(method)
    def run(self: Part[A], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return wrap(self._loop, self._loop.run(lambda: method(self._inner, *args, **kwargs)))
    return run


def twin_of(method: Callable[..., Any]) -> Callable[[F], F]:
    """For a blocking method written out (an overloaded one, whose overloads say what it returns):
    its async twin's docstring, and its parameters for ``inspect``."""
    def mark(fn: F) -> F:
        functools.update_wrapper(fn, method)
        return fn
    return mark


def delegated(method: Callable[Concatenate[A, P], R]) -> Callable[Concatenate[Part[A], P], R]:
    """The blocking twin of a plain (not async) method: called on the async object as it is."""
    @functools.wraps(method)
    def call(self: Part[A], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(self._inner, *args, **kwargs)
    return call


class opens_each(Generic[P, A]):  # noqa: N801  (used as a function in class bodies, like classmethod)
    """The blocking twin of an async constructor returning a list of ``A`` (several sandboxes at once).

    The constructor runs on a throwaway loop; each object it made gets a private loop of its own
    (so each is closed apart), which requires that none of them has opened its HTTP session yet.
    """

    def __init__(self, make: Callable[P, Coroutine[Any, Any, list[A]]]) -> None:
        self._make = make
        self.__doc__ = make.__doc__

    def __get__(self, obj: object, owner: type[B]) -> Callable[P, list[B]]:
        make = self._make

        @functools.wraps(make)
        def open_each(*args: P.args, **kwargs: P.kwargs) -> list[B]:
            made = oneshot(make)(*args, **kwargs)
            return [owner._wrap(Loop(), inner) for inner in made]
        open_each.__signature__ = inspect.signature(make).replace(  # type: ignore[attr-defined]
            return_annotation=f"list[{owner.__name__}]")
        return open_each
