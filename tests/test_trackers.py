"""log.backends: W&B (offline files) and MLflow (a file store) get every metrics.jsonl key of every step,
the config once, and a resumed run continues the same tracker run; the error for a missing library, a
tracker that fails mid-run, and the defaults (no tracker, nothing network-bound)."""

import json
import math
import pathlib
import struct

import pytest
from conftest import DEFAULT_CONFIG, TINY, jaxrl_cmd
from harness import child_env, run_python

from jaxrl.config import Config, ConfigError, LogConfig
from jaxrl.runlog import trackers
from jaxrl.runlog.metrics import MetricsLog
from jaxrl.train.workdir import check_changes

# --- the two libraries' offline stores, read back ------------------------------------------------------------

WANDB_BLOCK = 32768  # a .wandb file is a LevelDB-style log: 32 KiB blocks of (crc32, length, type) records


def _wandb_records(path: pathlib.Path):
    """Every record of a W&B offline `.wandb` file, as wandb's own protobuf `Record` (wandb ships no reader)."""
    from wandb.proto import wandb_internal_pb2  # pyright: ignore[reportMissingImports]

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B log file"
    pos, parts = 7, b""  # the file header: ':W&B', magic (2 bytes), version (1)
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero-filled tail
            pos += left
            continue
        body, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = body if kind in (1, 2) else parts + body  # FULL / FIRST start a record; MIDDLE / LAST add
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_sessions(workdir: pathlib.Path, run_id: str) -> list[dict]:
    """Each offline session of W&B run `run_id`, oldest first: its run id, config and history rows."""
    sessions = []
    for d in sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}")):
        session = {"config": {}, "history": []}
        for record in _wandb_records(d / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session["id"] = record.run.run_id
                session["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                session["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                items = record.history.item  # a key with a '/' may come as nested_key parts
                session["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
        sessions.append(session)
    return sessions


def _same(logged: float, row_value) -> bool:
    return math.isnan(logged) if row_value is None else logged == pytest.approx(float(row_value), rel=1e-6)


def _jsonl(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _expected_config(workdir: pathlib.Path, **changed) -> dict:
    flat = trackers.flat_config(json.loads((workdir / "config.json").read_text()))
    return {**flat, **changed}


@pytest.mark.slow
def test_wandb_offline_and_mlflow_file_store_get_every_key_the_config_once_and_one_run_across_a_resume(
    tmp_path, cache_env, monkeypatch
):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient  # pyright: ignore[reportMissingImports]

    workdir, uri = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    env = child_env(cache_env, MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true")
    env.pop("WANDB_MODE", None)  # offline comes from log.wandb_mode, the default
    args = [*sum((["--set", t] for t in TINY), []), "--set", "checkpoint.every=1"]
    args += ["--set", "log.backends=jsonl,tensorboard,wandb,mlflow", "--set", f"log.mlflow_tracking_uri={uri}"]
    for steps in (2, 3):  # the second session resumes from the first's step-2 checkpoint, one more step
        cmd = jaxrl_cmd("train", str(DEFAULT_CONFIG), "--workdir", str(workdir), *args)
        run_python([*cmd[1:], "--set", f"train.steps={steps}", "--allow-config-change"], env)

    rows = _jsonl(workdir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    ids = json.loads((workdir / trackers.IDS).read_text())
    config = _expected_config(workdir, **{"train.steps": 2})  # logged once: by the first session

    # W&B: two offline sessions of one run id (`wandb sync` uploads them as one run)
    sessions = _wandb_sessions(workdir, ids["wandb"]["id"])
    assert len(sessions) == 2 and {s["id"] for s in sessions} == {ids["wandb"]["id"]}
    first_config = {k: v for k, v in sessions[0]["config"].items() if k != "_wandb"}
    assert first_config == config
    assert {k for k in sessions[1]["config"] if k != "_wandb"} == set()  # the config is not logged again
    history = {h["step"]: h for s in sessions for h in s["history"]}
    assert sorted(history) == [0, 1, 2, 3]
    for row in rows:
        logged = history[row["step"]]
        assert set(row) <= set(logged), f"step {row['step']}: W&B lacks {sorted(set(row) - set(logged))}"
        for k, v in row.items():
            assert _same(float(logged[k]), v), (row["step"], k, logged[k], v)

    # MLflow: one run, each key's history has every step with the row's value; the params are the config
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read a file store
    client = MlflowClient(uri)
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert run.data.params == {k: str(v) for k, v in config.items()}
    for key in sorted({k for r in rows for k in r}):
        metric = client.get_metric_history(run.info.run_id, trackers.mlflow_key(key))
        by_step = {m.step: m.value for m in metric}
        want = {r["step"]: r[key] for r in rows if key in r}
        assert sorted(by_step) == sorted(want), (key, sorted(by_step), sorted(want))
        for step, v in want.items():
            assert _same(by_step[step], v), (key, step, by_step[step], v)


# --- no training: the config section, the missing library, a failing tracker ---------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("backends", ("jsonl", "neptune"), "log.backends"),
        ("backends", ("tensorboard",), "'jsonl'"),
        ("backends", ("jsonl", "jsonl"), "each name once"),
        ("wandb_mode", "cloud", "log.wandb_mode"),
        ("project", " ", "log.project"),
    ],
)
def test_log_config_mistakes_name_the_field(field, value, words):
    import dataclasses

    with pytest.raises(ConfigError, match=words):
        dataclasses.replace(Config(), log=LogConfig(**{field: value})).validate()


def test_a_backend_without_its_library_is_a_config_error_before_the_workdir_is_touched(tmp_path, monkeypatch):
    from jaxrl.train import loop

    monkeypatch.setitem(trackers.LIBRARIES, "wandb", ("jaxrl_no_such_package", "pip install 'jaxrl[wandb]'"))
    cfg = Config(log=LogConfig(backends=("jsonl", "wandb")))
    with pytest.raises(ConfigError, match=r"log\.backends: 'wandb' needs .*pip install 'jaxrl\[wandb\]'"):
        loop.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_defaults_open_no_tracker_and_keep_tensorboard(tmp_path):
    assert LogConfig().backends == ("jsonl", "tensorboard") and LogConfig().wandb_mode == "offline"
    assert trackers.open_trackers(LogConfig(), tmp_path, {}) == []
    log = MetricsLog(tmp_path, None, tensorboard=False)  # log.backends without "tensorboard"
    log.write({"step": 0, "x": 1.0})
    log.close()
    assert not (tmp_path / "tensorboard").exists() and _jsonl(tmp_path) == [{"step": 0, "x": 1.0}]


class _Recorder:
    """A stand-in tracker backend: records what it is given; raises at the step it is told to."""

    seen: list = []
    fail_at: int | None = None

    def __init__(self, log_cfg, workdir, config):
        self.seen.append(("config", config))

    def log(self, step, values):
        if step == self.fail_at:
            raise RuntimeError("the tracker's server went away")
        self.seen.append((step, values))

    def close(self):
        self.seen.append("closed")


def test_a_failing_tracker_is_reported_once_and_every_step_still_reaches_metrics_jsonl(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(trackers.OPENERS, "mlflow", _Recorder)
    monkeypatch.setattr(_Recorder, "seen", [])
    monkeypatch.setattr(_Recorder, "fail_at", 2)
    opened = trackers.open_trackers(LogConfig(backends=("jsonl", "mlflow")), tmp_path, {"train": {"steps": 4}})
    log = MetricsLog(tmp_path, None, trackers=opened)
    for step in range(5):
        log.write({"step": step, "loss": 0.5 * step, "kl": None, "note": "text"})
    log.close()
    assert [r["step"] for r in _jsonl(tmp_path)] == [0, 1, 2, 3, 4]
    assert _Recorder.seen[0] == ("config", {"train": {"steps": 4}})
    assert [s for s, _ in _Recorder.seen[1:]] == [0, 1]  # nothing after the failure, not even close
    assert _Recorder.seen[1][1]["loss"] == 0.0 and math.isnan(_Recorder.seen[1][1]["kl"])
    assert "note" not in _Recorder.seen[1][1]  # strings stay in metrics.jsonl only
    warnings = [line for line in capsys.readouterr().err.splitlines() if "log.backends" in line]
    assert len(warnings) == 1 and "'mlflow' failed at step 2" in warnings[0] and "went away" in warnings[0]


def test_only_the_writing_process_logs_to_trackers(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.OPENERS, "wandb", _Recorder)
    monkeypatch.setattr(_Recorder, "seen", [])
    opened = trackers.open_trackers(LogConfig(backends=("jsonl", "wandb")), tmp_path, {})
    log = MetricsLog(tmp_path, None, write=False, trackers=opened)  # a process other than 0
    log.write({"step": 0, "loss": 1.0})
    log.close()
    assert _Recorder.seen == [] and log.rows == [{"step": 0, "loss": 1.0}]


def test_mlflow_keys_and_the_flattened_config():
    assert trackers.mlflow_key("engine/staleness_2+") == "engine/staleness_2_"
    assert trackers.mlflow_key("reward/mean") == "reward/mean"
    flat = trackers.flat_config({"model": {"d_model": 32, "lora": {"targets": ["q", "v"]}}, "loss": {"options": ""}})
    assert flat == {"model.d_model": 32, "model.lora.targets": '["q", "v"]', "loss.options": ""}


def test_changing_log_fields_on_resume_is_free(tmp_path):
    check_changes(tmp_path, {"log.backends": (["jsonl"], ("jsonl", "wandb"))}, allow_change=False)  # no raise


@pytest.mark.slow
def test_the_training_path_imports_neither_tracker_library():
    probe = (
        "import sys, jaxrl.cli, jaxrl.train.loop; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'mlflow'}))"
    )
    assert run_python(["-c", probe], child_env()).stdout.strip() == "[]"
