"""The mapped-ram bitmap's runs (sandbox/backends/vm/qemu.py ``_bit_runs``), against a page-by-page reading of
the same bits written here from the definition: bit ``i & 7`` of byte ``i >> 3`` is page ``i``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sandbox.backends.vm.qemu import _bit_runs


def _runs_by_page(bits: list[bool], value: bool) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for page, bit in enumerate(bits):
        if bit != value:
            continue
        if out and out[-1][0] + out[-1][1] == page:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((page, 1))
    return out


def _bitmap(bits: list[bool]) -> bytes:
    raw = bytearray((len(bits) + 7) // 8)
    for page, bit in enumerate(bits):
        if bit:
            raw[page >> 3] |= 1 << (page & 7)
    return bytes(raw)


# runs of equal bits, so whole 0x00/0xff bytes and mixed ones both occur
_BITS = st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=30).map(
    lambda runs: [b for b, n in runs for _ in range(n)])


@given(_BITS, st.booleans())
def test_runs_match_a_page_by_page_reading(bits: list[bool], value: bool) -> None:
    assert list(_bit_runs(_bitmap(bits), len(bits), value)) == _runs_by_page(bits, value)


def test_bits_beyond_the_page_count_are_not_pages() -> None:
    # 10 pages in a 2-byte bitmap whose spare bits are set: they are no pages
    assert list(_bit_runs(b"\xff\xff", 10, True)) == [(0, 10)]
    assert list(_bit_runs(b"\x00\xfc", 10, False)) == [(0, 10)]
