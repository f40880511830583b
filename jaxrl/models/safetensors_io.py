"""The safetensors file format, read memory-mapped and written, with numpy only.

A file is: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes (offsets relative to
the end of the header). Reading maps the file and returns numpy views, so a tensor's bytes are only
read when (and where) they are used: a loader can fill one device's shard of a parameter without
touching the rest. bfloat16 comes from `ml_dtypes` (a jax dependency), which numpy cannot name.

A checkpoint directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`
({"weight_map": {tensor name: file name}}).
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from typing import Mapping, Optional

import ml_dtypes
import numpy as np

from jaxrl.config import ConfigError

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
NAMES = {v: k for k, v in DTYPES.items()}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ConfigError):
    """A checkpoint file or tensor is missing, malformed or does not fit the model; names which."""


def read_file(path: pathlib.Path) -> dict[str, np.ndarray]:
    """{name: read-only numpy view} of one .safetensors file (memory-mapped; nothing read yet)."""
    path = pathlib.Path(path)
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from e
    if raw.size < 8:
        raise CheckpointError(f"{path}: not a safetensors file (only {raw.size} bytes)")
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    if 8 + n > raw.size:
        raise CheckpointError(f"{path}: not a safetensors file (header of {n} bytes exceeds the file)")
    try:
        header = json.loads(raw[8:8 + n].tobytes())
    except ValueError as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from e
    start = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, expected one of "
                                  f"{sorted(DTYPES)}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > raw.size:
            raise CheckpointError(f"{path}: tensor {name!r} ({info['dtype']}, shape {shape}) has a bad byte range")
        out[name] = raw[start + begin:start + end].view(dtype).reshape(shape)
    return out


def read_dir(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (single file or sharded index), memory-mapped."""
    directory = pathlib.Path(directory)
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{directory / INDEX}: expected JSON with a 'weight_map' ({e})") from e
        tensors = {}
        for file in sorted(set(weight_map.values())):
            if not (directory / file).is_file():
                raise CheckpointError(f"{directory / INDEX}: lists shard {file!r}, which is missing")
            tensors.update(read_file(directory / file))
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


def write_file(path: pathlib.Path, tensors: Mapping[str, np.ndarray], metadata: Optional[dict] = None) -> None:
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
