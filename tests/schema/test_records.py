"""Record and meta layouts: round trips and damage detection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixd.errors import CorruptMetaError, CorruptRecordError, NotAStoreError, SchemaVersionError
from prefixd.schema.meta import SCHEMA_VERSION, StoreMeta, new_meta
from prefixd.schema.records import BlockRecord, Compression

records = st.builds(
    BlockRecord,
    st.sampled_from(list(Compression)),
    st.integers(1, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**63),
    st.integers(0, 2**63),
    st.integers(0, 2**63),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=16, max_size=16),
    st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4]),
)


@given(records)
def test_record_round_trip(record: BlockRecord) -> None:
    assert BlockRecord.decode(record.encode()) == record


@given(records, st.data())
def test_any_damaged_record_byte_is_detected(record: BlockRecord, data: st.DataObject) -> None:
    raw = bytearray(record.encode())
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecordError):
        BlockRecord.decode(bytes(raw))


def test_truncated_record_is_detected() -> None:
    raw = BlockRecord(Compression.NONE, 1, 1, 0, 1, 1, 0, bytes(16), bytes(16), b"abcd").encode()
    for cut in (0, 10, len(raw) - 1):
        with pytest.raises(CorruptRecordError):
            BlockRecord.decode(raw[:cut])


def test_meta_round_trip_and_three_errors() -> None:
    meta = new_meta(123)
    assert StoreMeta.decode(meta.encode()) == meta
    with pytest.raises(NotAStoreError):
        StoreMeta.decode(b"SQLite format 3\x00")
    raw = bytearray(meta.encode())
    raw[len(raw) // 2] ^= 0x40
    with pytest.raises(CorruptMetaError):
        StoreMeta.decode(bytes(raw))
    with pytest.raises(CorruptMetaError):
        StoreMeta.decode(meta.encode()[:12])
    future = StoreMeta(SCHEMA_VERSION + 1, meta.settings).encode()
    with pytest.raises(SchemaVersionError) as caught:
        StoreMeta.decode(future)
    assert caught.value.found == SCHEMA_VERSION + 1
