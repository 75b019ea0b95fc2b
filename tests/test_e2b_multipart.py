"""envd's multipart upload bodies, parsed as they arrive (sandbox/edge/e2b/multipart.py).

aiohttp's own StreamReader is fed the body in pieces, split anywhere (hypothesis), and what the
parser hands out is compared with the standard library's parse of the whole body (email's MIME
parser, which shares no code with ours).  The hostile cases are refused with a 400 naming the
body, never read past a bound."""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import re
import socket

import pytest
from aiohttp import StreamReader
from aiohttp.base_protocol import BaseProtocol
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sandbox.core.errors import InvalidField
from sandbox.edge.e2b.multipart import (
    MAX_HEADERS,
    MAX_PREAMBLE,
    MultipartStream,
    boundary_of,
    media_type,
)

BOUNDARY = "b0undary-xyz"


def body_of(parts: list[tuple[str, str | None, bytes]], *, preamble: bytes = b"", epilogue: bytes = b"",
            padding: bytes = b"") -> bytes:
    out = preamble + (b"\r\n" if preamble else b"")
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += (f"--{BOUNDARY}".encode() + padding + b"\r\n" + f"Content-Disposition: {disp}\r\n".encode()
                + b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n")
    return out + f"--{BOUNDARY}--".encode() + epilogue


def well_formed(data: bytes) -> bool:
    """A client picks a boundary its data does not hold (RFC 2046): only such bodies are well-formed."""
    return f"\r\n--{BOUNDARY}".encode() not in b"\r\n" + data


def oracle_agrees(data: bytes) -> bool:
    """The stdlib's parser takes a lone CR or LF for a line break (RFC 2046 wants CRLF): data with
    one before the boundary's text is a case where it, not ours, is wrong."""
    return re.search(rb"[\r\n]--" + re.escape(BOUNDARY.encode()), b"\n" + data) is None


def oracle(body: bytes) -> list[tuple[str | None, str | None, bytes]]:
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n".encode() + body)
    return [(p.get_param("name", header="content-disposition"), p.get_filename(), p.get_payload(decode=True))
            for p in msg.iter_parts()]


async def reader() -> tuple[StreamReader, socket.socket]:
    """aiohttp's StreamReader over a connected transport (a socket pair's end), as a request's."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    protocol = BaseProtocol(loop)
    await loop.connect_accepted_socket(lambda: protocol, ours)
    return StreamReader(protocol, 1 << 16, loop=loop), theirs


async def parse(body: bytes, cuts: list[int], *, size: int = 1 << 20, boundary: str = BOUNDARY
                ) -> list[tuple[str | None, str | None, bytes]]:
    content, peer = await reader()

    async def feed() -> None:
        at = 0
        for cut in sorted({c % (len(body) + 1) for c in cuts}) + [len(body)]:
            content.feed_data(body[at:cut])
            at = cut
            await asyncio.sleep(0)  # the parser runs between the pieces
        content.feed_eof()

    feeder = asyncio.ensure_future(feed())
    try:
        stream = MultipartStream(content, boundary_of(f"multipart/form-data; boundary={boundary}"))
        out = []
        while (part := await stream.next_part()) is not None:
            data = b""
            while piece := await stream.read(size):
                assert len(piece) <= size
                data += piece
            out.append((part.name, part.filename, data))
        return out
    finally:
        await feeder
        peer.close()


def run(body: bytes, cuts: list[int] = (), **kw: object) -> list[tuple[str | None, str | None, bytes]]:
    return asyncio.run(parse(body, list(cuts), **kw))  # type: ignore[arg-type]


# bytes that look like the delimiter's start are the hard part of the body
tricky = st.lists(st.sampled_from([b"\r", b"\n", b"-", b"--", b"\r\n--", b"\r\n--b0undary-xy", b"b0undary-xyz",
                                   b"x", b"\x00", b"payload"]), max_size=40).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(datas=st.lists(tricky, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 10_000), max_size=12),
       size=st.integers(1, 64), preamble=st.sampled_from([b"", b"a preamble\r\nof two lines"]),
       epilogue=st.sampled_from([b"", b"\r\nthe epilogue"]), padding=st.sampled_from([b"", b"  \t"]))
def test_every_split_of_a_body_gives_the_parts_the_stdlib_parser_finds(datas: list[bytes], cuts: list[int], size: int,
                                                                        preamble: bytes, epilogue: bytes,
                                                                        padding: bytes) -> None:
    assume(all(well_formed(d) for d in datas))
    parts = [("file", f"/home/user/f{i}", d) for i, d in enumerate(datas)]
    body = body_of(parts, preamble=preamble, epilogue=epilogue, padding=padding)
    got = run(body, cuts, size=size)
    assert got == [(n, f, d) for n, f, d in parts]
    if all(oracle_agrees(d) for d in datas):
        assert got == oracle(body)


@settings(max_examples=200, deadline=None)
@example(chunks=[b"\r--b0undary-xyz"], cuts=[], size=1)  # a CR, not CRLF, before the boundary's text: data
@given(chunks=st.lists(st.one_of(st.binary(min_size=1, max_size=3000), tricky), min_size=1, max_size=12),
       cuts=st.lists(st.integers(0, 40_000), max_size=24), size=st.integers(1, 8192))
def test_long_parts_handed_out_as_the_connection_gave_them_are_the_stdlib_parsers(
        chunks: list[bytes], cuts: list[int], size: int) -> None:
    """Chunks with no delimiter in them go out as they came (no copy): long bodies, split anywhere,
    with CRs and pieces of the delimiter near the cuts, still give exactly the parts."""
    datas = [b"".join(chunks), b"".join(reversed(chunks))]
    assume(all(well_formed(d) for d in datas))
    parts = [("file", f"/home/user/f{i}", d) for i, d in enumerate(datas)]
    body = body_of(parts)
    got = run(body, cuts, size=size)
    assert got == [(n, f, d) for n, f, d in parts]
    if all(oracle_agrees(d) for d in datas):
        assert got == oracle(body)


def test_a_large_part_comes_in_pieces_of_the_size_asked() -> None:
    data = bytes(range(256)) * (40 << 10)  # 10 MiB
    body = body_of([("file", "/tmp/big", data), ("other", None, b"skipped"), ("file", "/tmp/small", b"s")])
    got = run(body, list(range(0, len(body), 65536)), size=1 << 20)
    assert got == oracle(body)
    assert [len(d) for _, _, d in got] == [len(data), 7, 1]


def test_a_part_not_read_is_skipped_by_the_next() -> None:
    async def go() -> list[str | None]:
        content, peer = await reader()
        content.feed_data(body_of([("a", None, b"x" * 5000), ("file", "/f", b"kept")]))
        content.feed_eof()
        stream = MultipartStream(content, BOUNDARY.encode())
        first = await stream.next_part()
        second = await stream.next_part()  # the first's body never read
        assert second is not None
        assert await stream.read(100) == b"kept"
        assert await stream.read(100) == b""
        assert await stream.next_part() is None
        peer.close()
        return [first.name if first else None, second.filename]

    assert asyncio.run(go()) == ["a", "/f"]


@pytest.mark.parametrize(("body", "what"), [
    (body_of([("file", "/f", b"data")])[:-len(f"\r\n--{BOUNDARY}--")], "ends inside a part"),
    (b"no delimiter at all\r\n", "ends in its preamble"),
    (b"x" * (MAX_PREAMBLE + 10) + b"\r\n", "preamble longer"),
    ((b"p\r\n" * (MAX_PREAMBLE // 2)), f"no multipart boundary in the first {MAX_PREAMBLE}"),
    (f"--{BOUNDARY}\r\nX-Long: ".encode() + b"h" * (MAX_HEADERS + 1) + b"\r\n\r\n", "part headers longer"),
    (f"--{BOUNDARY}\r\n".encode() + b"X-Short: h\r\n" * (MAX_HEADERS // 10) + b"\r\n", "part headers longer"),
    (f"--{BOUNDARY}\r\nno colon here\r\n\r\nx\r\n--{BOUNDARY}--".encode(), "malformed header line"),
    (f"--{BOUNDARY}junk\r\n\r\nx\r\n--{BOUNDARY}--".encode(), "ends in its preamble"),
    (f"--{BOUNDARY}\r\n\r\nx\r\n--{BOUNDARY}junk\r\n\r\ny\r\n--{BOUNDARY}--".encode(), "followed by more than blanks"),
])
def test_a_malformed_body_is_refused_naming_the_body(body: bytes, what: str) -> None:
    with pytest.raises(InvalidField) as err:
        run(body, [7, 100, 5000])
    assert err.value.field == "body"
    assert what in str(err.value)


@pytest.mark.parametrize("content_type", ["multipart/form-data", "multipart/form-data; boundary=",
                                          "multipart/form-data; boundary=" + "b" * 71,
                                          "multipart/form-data; boundary=\"ends in space \"",
                                          "multipart/form-data; boundary=bad\x00char"])
def test_a_missing_or_bad_boundary_names_the_content_type(content_type: str) -> None:
    with pytest.raises(InvalidField) as err:
        boundary_of(content_type)
    assert err.value.field == "Content-Type"


def test_a_quoted_boundary_with_spaces_is_taken() -> None:
    assert boundary_of('multipart/form-data; boundary="a b:c"') == b"a b:c"


@given(kind=st.sampled_from(["multipart/form-data", "Multipart/Form-Data", "application/octet-stream",
                             "APPLICATION/OCTET-STREAM", "multipart/mixed", "text/plain", "application/json"]),
       space=st.sampled_from(["", " ", "  "]),
       params=st.lists(st.tuples(st.sampled_from(["boundary", "charset", "x"]),
                                 st.text(alphabet="abcXYZ019-_.", min_size=1, max_size=20)), max_size=3))
def test_the_media_type_is_aiohttps(kind: str, space: str, params: list[tuple[str, str]]) -> None:
    """The upload's media type, read without the email package, is the one aiohttp's parser gives."""
    from aiohttp.helpers import parse_content_type

    raw = space + kind + space + "".join(f";{space}{k}={v}" for k, v in params)
    assert media_type(raw) == parse_content_type(raw)[0]


def test_no_content_type_is_octet_stream_as_aiohttp_says() -> None:
    from aiohttp.helpers import parse_content_type

    assert media_type("") == parse_content_type("")[0] == "application/octet-stream"
