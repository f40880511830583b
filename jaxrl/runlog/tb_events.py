"""TensorBoard scalar events, written without TensorFlow, tensorboardX or protobuf.

tensorboardX's package `__init__` imports torch whenever torch is installed; we write scalars only.
An event file is a sequence of TFRecords (uint64 length, uint32 masked CRC-32C of the length bytes, the
data, uint32 masked CRC-32C of the data; little-endian), each a serialized `tensorflow.Event`: the first
carries `file_version = "brain.Event:2"`, the others a `Summary` of `simple_value` scalars, as
tensorboardX's `add_scalar` writes them. Only the protobuf wire types these messages need are encoded;
tests/test_tensorboard_events.py reads the file back with tensorboardX's classes.
"""

from __future__ import annotations

import itertools
import math
import os
import pathlib
import re
import socket
import struct
import time
from collections.abc import Mapping


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits and add a constant."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # an int64 field: negatives as their two's complement, ten bytes
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    """Event{wall_time = 1 (double), step = 2 (int64)} followed by `body` (its other fields)."""
    return _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step) + body


def file_version_event(wall_time: float) -> bytes:
    return _event(wall_time, 0, _length_delimited(3, b"brain.Event:2"))  # Event.file_version = 3


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32's range: infinite, as protobuf's float field would store it
        return struct.pack("<f", math.copysign(math.inf, value))


def clean_tag(name: str) -> str:
    """The tag tensorboardX gives a metric name (its `_clean_tag`): characters TensorBoard's node names
    do not allow become "_" (engine/staleness_2+ -> engine/staleness_2_), no leading "/"."""
    return re.sub(r"[^-/\w\.]", "_", name).lstrip("/")


def scalars_event(wall_time: float, step: int, scalars: Mapping[str, float]) -> bytes:
    """Event.summary (5): Summary.value (1) repeated, each Value{tag = 1, simple_value = 2 (float)}."""
    values = b"".join(
        _length_delimited(1, _length_delimited(1, clean_tag(name).encode()) + _key(2, 5) + _float32(value))
        for name, value in scalars.items()
    )
    return _event(wall_time, step, _length_delimited(5, values))


_WRITERS = itertools.count()


class ScalarEventWriter:
    """One new event file in `logdir` per writer (TensorBoard merges a directory's files by step, so a
    resumed run's rewritten steps simply come again, as with tensorboardX)."""

    def __init__(self, logdir: pathlib.Path | str):
        logdir = pathlib.Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # tensorboardX's name (TensorBoard wants "tfevents" in it), then the pid and this process's count,
        # as TensorFlow's writers add: two writers never share a file, even in one process in one second
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{next(_WRITERS)}"
        self.path = logdir / name
        self._file = self.path.open("wb")
        self._file.write(tfrecord(file_version_event(now)))
        self._file.flush()

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if scalars:
            self._file.write(tfrecord(scalars_event(time.time(), step, scalars)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
