"""The TensorBoard events a run writes (jaxrl/runlog/tb_events.py, no torch import) read back with
tensorboardX's own protobuf classes and CRC-32C, and hold what tensorboardX's SummaryWriter would write."""

import math
import struct

import numpy as np
from tensorboardX import SummaryWriter
from tensorboardX.crc32c import crc32c as reference_crc32c
from tensorboardX.proto.event_pb2 import Event

from jaxrl.runlog.metrics import MetricsLog


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path) -> list[Event]:
    """TFRecord framing checked record by record (length, both CRCs); each record parsed as an Event."""
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[at + 8 : at + 12])
        assert length_crc == _masked(reference_crc32c(header)), at
        payload = data[at + 12 : at + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[at + 12 + length : at + 16 + length])
        assert payload_crc == _masked(reference_crc32c(payload)), at
        events.append(Event.FromString(payload))
        at += 16 + length
    assert at == len(data), "a torn record at the end"
    return events


def scalars(events: list[Event]) -> dict[tuple[int, str], float]:
    return {(e.step, v.tag): v.simple_value for e in events if e.HasField("summary") for v in e.summary.value}


ROWS = [
    {"step": 0, "eval/accuracy": 0.25, "eval/pass@4": 0.5, "wall_time": 1.7e9},
    {
        "step": 1,
        "loss": np.float32(-0.125),  # numpy scalars, as the trainer's metrics come
        "reward/mean": 0.75,
        "rollout/samples": 16,
        "engine/staleness_2+": 3,
        "kl": float("nan"),  # non-finite: logged as None in the JSONL, no scalar
        "agent/success": True,  # a bool is no scalar
        "note": "text",
        "huge": 1e39,  # beyond float32: +inf, as protobuf stores it
    },
]


def test_a_runs_events_read_back_as_tensorboardx_writes_them(tmp_path):
    (tmp_path / "run").mkdir()  # the trainer's workdir
    log = MetricsLog(tmp_path / "run", resume_step=None)
    for row in ROWS:
        log.write(row)
    log.close()
    (ours,) = (tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*")
    events = read_events(ours)
    assert events[0].file_version == "brain.Event:2"
    assert all(e.wall_time > 1e9 for e in events)
    got = scalars(events)

    reference = SummaryWriter(str(tmp_path / "reference"))
    for row in log.rows:  # the JSONL rows (non-finite -> None), as MetricsLog filtered them before
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                reference.add_scalar(k, v, row["step"])
    reference.close()
    (theirs,) = (tmp_path / "reference").glob("events.out.tfevents.*")
    assert got == scalars(read_events(theirs))
    assert got[(1, "engine/staleness_2_")] == 3 and got[(0, "eval/pass_4")] == 0.5  # tensorboardX's tags
    assert got[(1, "loss")] == -0.125 and math.isinf(got[(1, "huge")]) and (1, "kl") not in got

    # A resumed session writes a file of its own; the first session's stays readable as it was.
    resumed = MetricsLog(tmp_path / "run", resume_step=0)
    resumed.write({"step": 1, "loss": 0.5})
    resumed.close()
    files = sorted((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2 and ours in files
    assert scalars(read_events(ours)) == got
    (second,) = (f for f in files if f != ours)
    assert scalars(read_events(second)) == {(1, "loss"): 0.5}


def test_a_process_that_does_not_write_makes_no_event_file(tmp_path):
    log = MetricsLog(tmp_path / "run", resume_step=None, write=False)
    log.write({"step": 0, "loss": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


def test_a_session_that_logs_nothing_adds_no_event_file(tmp_path):
    """Rerunning a finished run writes no row: its tensorboard/ must not gain an empty file each time."""
    (tmp_path / "run").mkdir()
    first = MetricsLog(tmp_path / "run", resume_step=None)
    first.write({"step": 0, "loss": 1.0})
    first.close()
    before = sorted((tmp_path / "run" / "tensorboard").iterdir())
    for _ in range(2):
        rerun = MetricsLog(tmp_path / "run", resume_step=0)
        rerun.flush()
        rerun.close()
    assert sorted((tmp_path / "run" / "tensorboard").iterdir()) == before and len(before) == 1
