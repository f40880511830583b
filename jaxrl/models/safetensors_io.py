"""The safetensors file format, read memory-mapped and written, with numpy only.

A file is: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes (offsets relative to
the end of the header). Reading maps the file and returns numpy views, so a tensor's bytes are only
read when (and where) they are used: a loader can fill one device's shard of a parameter without
touching the rest. bfloat16 comes from `ml_dtypes` (a jax dependency), which numpy cannot name.
A file is checked as strictly as the `safetensors` library checks it (`read_file`), so a damaged or
hand-edited file is a CheckpointError naming the file and tensor, never wrong weights.

A checkpoint directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`
({"weight_map": {tensor name: file name}}).
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from jaxrl.config.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit


def _header(raw: np.ndarray, path: pathlib.Path) -> tuple[dict, int]:
    """(header JSON object, byte where the data starts) of a mapped file, checked as the safetensors
    library checks it: an 8-byte length that fits, UTF-8 JSON that is an object."""
    if raw.size < 8:
        raise CheckpointError(f"{path}: not a safetensors file (only {raw.size} bytes)")
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    if n > MAX_HEADER_BYTES or 8 + n > raw.size:
        raise CheckpointError(f"{path}: not a safetensors file (header of {n} bytes exceeds the file of {raw.size})")
    try:
        text = raw[8 : 8 + n].tobytes().decode("utf-8")
        header = json.loads(text) if text.startswith("{") else None
    except ValueError as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: safetensors header is not a JSON object {{name: {{dtype, shape, data_offsets}}}}"
        )
    return header, 8 + n


def _entry(name: str, info, path: pathlib.Path) -> tuple[np.dtype, tuple, int, int]:
    """(dtype, shape, begin, end) of one header entry; CheckpointError naming the tensor otherwise."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{where}: header entry {json.dumps(info)[:60]} is not an object {{dtype, shape, data_offsets}}"
        )
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {missing[0]!r}")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: dtype {info['dtype']!r} is not one of {sorted(DTYPES)}")

    def is_count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(map(is_count, shape)):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_count, offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, but {info['dtype']} of "
            f"shape {tuple(shape)} needs {math.prod(shape) * dtype.itemsize}"
        )
    return dtype, tuple(shape), begin, end


def read_file(path: pathlib.Path) -> dict[str, np.ndarray]:
    """{name: read-only numpy view} of one .safetensors file (memory-mapped; nothing read yet).

    Validated as the `safetensors` library validates (tests/test_hf_safetensors.py checks both agree):
    the tensors' byte ranges, in offset order, tile the data exactly from its start to the end of the
    file (none out of bounds, overlapping, or with a gap), and each holds dtype x shape bytes. Any
    violation is a CheckpointError naming the file and the tensor."""
    path = pathlib.Path(path)
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from e
    header, start = _header(raw, path)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: '__metadata__' is not an object of strings")
    entries = {name: _entry(name, info, path) for name, info in header.items() if name != "__metadata__"}
    covered = 0  # bytes of data tiled so far, in offset order
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        if begin != covered:
            what = "overlaps the tensor before it" if begin < covered else f"leaves bytes {covered}..{begin} unused"
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] {what}")
        if start + end > raw.size:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] run past the end of the "
                f"file ({raw.size - start} data bytes; truncated?)"
            )
        covered = end
    if start + covered != raw.size:
        raise CheckpointError(
            f"{path}: {raw.size - start - covered} bytes after the last tensor's data "
            "(not a safetensors file, or a damaged one)"
        )
    return {
        name: raw[start + begin : start + end].view(dtype).reshape(shape)
        for name, (dtype, shape, begin, end) in entries.items()
    }


def read_dir(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (single file or sharded index), memory-mapped."""
    directory = pathlib.Path(directory)
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text()).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{directory / INDEX}: expected a JSON object with a 'weight_map' ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{directory / INDEX}: 'weight_map' is not an object {{tensor name: shard file}}")
        tensors = {}
        for file in sorted(set(weight_map.values())):
            if not (directory / file).is_file():
                raise CheckpointError(f"{directory / INDEX}: lists shard {file!r}, which is missing")
            shard = read_file(directory / file)
            twice = sorted(set(shard) & set(tensors))
            if twice:
                raise CheckpointError(f"{directory / file}: tensor {twice[0]!r} is also in another shard")
            tensors.update(shard)
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{directory / INDEX}: tensor {missing[0]!r} is listed but in no shard")
        return tensors
    if (directory / SINGLE).is_file():
        return read_file(directory / SINGLE)
    files = sorted(directory.glob("*.safetensors"))
    if len(files) == 1:
        return read_file(files[0])
    raise CheckpointError(f"{directory}: expected {SINGLE} or {INDEX} (found {[f.name for f in files]})")


def write_file(path: pathlib.Path, tensors: Mapping[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write `tensors` (numpy, any of DTYPES) as one .safetensors file."""
    header, offset = {}, 0
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    for name, a in arrays.items():
        if a.dtype not in NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def write_dir(directory: pathlib.Path, tensors: Mapping[str, np.ndarray], max_shard_bytes: int = 0) -> list[str]:
    """Write a checkpoint directory: one `model.safetensors`, or (when the tensors exceed
    `max_shard_bytes` > 0) shards `model-0000i-of-0000n.safetensors` plus the index. Returns the files."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    total = sum(int(a.nbytes) for a in tensors.values())
    meta = {"format": "pt"}
    if not max_shard_bytes or total <= max_shard_bytes:
        write_file(directory / SINGLE, tensors, meta)
        return [SINGLE]
    groups, size = [[]], 0
    for name, a in tensors.items():
        if groups[-1] and size + a.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += a.nbytes
    files, weight_map = [], {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_file(directory / file, {n: tensors[n] for n in names}, meta)
        files.append(file)
        weight_map.update({n: file for n in names})
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return files + [INDEX]
