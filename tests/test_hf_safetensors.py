"""The safetensors reader refuses every malformed file with one CheckpointError naming the file (and the
tensor, where one is to blame), and it accepts and rejects exactly what the `safetensors` library does:
each malformed file below is also refused by `safetensors.safe_open`, and a good file reads the same."""

import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.config.errors import CheckpointError
from jaxrl.models import safetensors_io

A = np.arange(6, dtype=np.float32).reshape(2, 3)  # 24 bytes at [0, 24)
B = np.array([1.0, -2.0, 0.5, 3.0], ml_dtypes.bfloat16)  # 8 bytes at [24, 32)


def _header():
    return {
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
        "__metadata__": {"format": "pt"},
    }


def _raw(header, data=None) -> bytes:
    data = A.tobytes() + B.tobytes() if data is None else data
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def _edited(edit):
    h = _header()
    edit(h)
    return _raw(h)


# name -> (file bytes, the error's text after "<path>: ")
MALFORMED = {
    "truncated": (
        _raw(_header())[:-5],
        r"tensor 'b': data_offsets \[24, 32\] run past the end of the file "
        r"\(27 data bytes; truncated\?\)",
    ),
    "header_cut": (_raw(_header())[:20], r"not a safetensors file \(header of \d+ bytes exceeds the file of 20\)"),
    "header_not_json": (_raw(b'{"a": {"dtype": F32}}'), r"unreadable safetensors header"),
    "header_list": (_raw(b"[1, 2, 3]"), r"safetensors header is not a JSON object"),
    "entry_not_object": (
        _edited(lambda h: h.update(a=[0, 24])),
        r"tensor 'a': header entry \[0, 24\] is not an "
        r"object",
    ),
    "missing_data_offsets": (
        _edited(lambda h: h["b"].pop("data_offsets")),
        r"tensor 'b': header entry lacks 'data_offsets'",
    ),
    "missing_dtype": (_edited(lambda h: h["a"].pop("dtype")), r"tensor 'a': header entry lacks 'dtype'"),
    # b re-reads a's last 4 bytes: [20, 28) overlaps [0, 24); the file is 28 data bytes, so nothing else is off.
    "overlapping": (
        _raw(
            json.dumps(
                {"a": _header()["a"], "b": {"dtype": "BF16", "shape": [4], "data_offsets": [20, 24 + 4]}}
            ).encode(),
            A.tobytes() + B.tobytes()[:4],
        ),
        r"tensor 'b': data_offsets \[20, 28\] overlaps the tensor before it",
    ),
    "same_offsets": (
        _raw(json.dumps({"a": _header()["a"], "c": _header()["a"]}).encode(), A.tobytes()),
        r"tensor 'c': data_offsets \[0, 24\] overlaps",
    ),
    "out_of_bounds": (
        _edited(lambda h: h["b"].update(shape=[8], data_offsets=[24, 40])),
        r"tensor 'b': data_offsets \[24, 40\] run past the end of the file \(32 data bytes",
    ),
    "gap": (
        _raw(
            json.dumps({"b": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 16]}}).encode(), bytes(8) + B.tobytes()
        ),
        r"tensor 'b': data_offsets \[8, 16\] leaves bytes 0\.\.8 unused",
    ),
    "bytes_not_dtype_x_shape": (
        _edited(lambda h: h["a"].update(shape=[2, 2])),
        r"tensor 'a': data_offsets \[0, 24\] hold 24 bytes, but F32 of shape \(2, 2\) needs 16",
    ),
    "unknown_dtype": (_edited(lambda h: h["b"].update(dtype="F12")), r"tensor 'b': dtype 'F12' is not one of"),
    "negative_shape": (
        _edited(lambda h: h["b"].update(shape=[-4])),
        r"tensor 'b': shape \[-4\] is not a list of "
        r"non-negative integers",
    ),
    "trailing_bytes": (_raw(_header(), A.tobytes() + B.tobytes() + bytes(3)), r"3 bytes after the last tensor"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_one_line_error_naming_file_and_tensor(tmp_path, case):
    raw, message = MALFORMED[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError) as e:
        safetensors_io.read_file(path)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"{path}: ")
    assert re.match(message, text[len(f"{path}: ") :]), text


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_safetensors_library_refuses_the_same_files(tmp_path, case):
    safetensors = pytest.importorskip("safetensors")
    path = tmp_path / "model.safetensors"
    path.write_bytes(MALFORMED[case][0])
    with pytest.raises(safetensors.SafetensorError):
        with safetensors.safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                f.get_tensor(name)


def test_good_file_reads_as_the_safetensors_library_reads_it(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    path = tmp_path / "model.safetensors"
    path.write_bytes(_raw(_header()))
    ours = safetensors_io.read_file(path)
    np.testing.assert_array_equal(ours["a"], A)
    assert ours["b"].dtype == B.dtype
    np.testing.assert_array_equal(ours["b"].astype(np.float32), [1.0, -2.0, 0.5, 3.0])
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(ours)
        for name in ours:
            np.testing.assert_array_equal(
                np.asarray(f.get_tensor(name)).view(np.uint8), np.asarray(ours[name]).view(np.uint8)
            )
    # ...and our writer's files (8-byte padded header, several dtypes) are valid for the library too.
    written = tmp_path / "w.safetensors"
    safetensors_io.write_file(written, {"x": A, "y": B, "empty": np.zeros((0, 3), np.int32)}, {"format": "pt"})
    with safetensors.safe_open(str(written), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("x"), A)
        assert f.get_tensor("empty").shape == (0, 3)
    assert set(safetensors_io.read_file(written)) == {"x", "y", "empty"}


def test_malformed_index_is_named(tmp_path):
    (tmp_path / safetensors_io.INDEX).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"index\.json: expected a JSON object with a 'weight_map'"):
        safetensors_io.read_dir(tmp_path)
    (tmp_path / safetensors_io.INDEX).write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match=r"'weight_map' is not an object"):
        safetensors_io.read_dir(tmp_path)
    for shard in ("s1.safetensors", "s2.safetensors"):
        safetensors_io.write_file(tmp_path / shard, {"a": A})
    (tmp_path / safetensors_io.INDEX).write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"s2\.safetensors: tensor 'a' is also in another shard"):
        safetensors_io.read_dir(tmp_path)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 32,
}


@pytest.mark.parametrize("case", ["missing_data_offsets", "header_list", "overlapping"])
def test_convert_from_hf_prints_the_error_as_one_line(tmp_path, capsys, case):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(TINY_LLAMA))
    (src / "model.safetensors").write_bytes(MALFORMED[case][0])
    assert main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jaxrl: error: {src / 'model.safetensors'}: "), err
    assert not (tmp_path / "out").exists()
