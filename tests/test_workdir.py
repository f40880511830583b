"""The run directory rules (jaxrl.train.workdir), without training: what is refused, what a refusal
leaves on disk (nothing changed), what an allowed config change records, and the lock."""

import dataclasses
import json

import pytest

from jaxrl.config import Config, to_dict
from jaxrl.train import workdir as wd


def _cfg(d_model=32, steps=6, progress=False) -> Config:
    c = Config()
    return dataclasses.replace(
        c,
        model=dataclasses.replace(c.model, d_model=d_model),
        train=dataclasses.replace(c.train, steps=steps, progress=progress),
    )


def _fake_run(path, cfg: Config, steps=(2, 4)):
    """A run directory as `jaxrl train` leaves it (config.json + finished step folders)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    for s in steps:
        (path / "checkpoints" / str(s)).mkdir(parents=True)
    return path


def test_new_run_writes_config_and_lock(tmp_path):
    run = tmp_path / "a" / "b"
    with wd.open_run(_cfg(), run):
        assert json.loads((run / "config.json").read_text())["model"]["d_model"] == 32
        assert "pid" in (run / wd.LOCK).read_text()


def test_changed_model_is_refused_before_anything_is_written(tmp_path):
    run = _fake_run(tmp_path / "run", _cfg(d_model=32))
    before = (run / "config.json").read_bytes()
    with pytest.raises(wd.WorkdirError, match=r"model\.d_model 32 -> 64"):
        with wd.open_run(_cfg(d_model=64), run, allow_change=True):  # never allowed, even with the flag
            pass
    assert (run / "config.json").read_bytes() == before
    assert not (run / wd.LOCK).exists() and not (run / wd.HISTORY).exists()


def test_changed_steps_needs_the_flag_and_names_the_schedule(tmp_path):
    run = _fake_run(tmp_path / "run", _cfg(steps=6))
    before = (run / "config.json").read_bytes()
    with pytest.raises(wd.WorkdirError, match=r"train\.steps 6 -> 8.*learning-rate schedule.*--allow-config-change"):
        with wd.open_run(_cfg(steps=8), run):
            pass
    assert (run / "config.json").read_bytes() == before


def test_allowed_change_is_recorded_only_after_the_restore(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", _cfg(steps=6))
    before = (run / "config.json").read_bytes()
    with wd.open_run(_cfg(steps=8), run, allow_change=True) as record:
        assert (run / "config.json").read_bytes() == before  # not yet: the restore may still fail
        record.commit(4)
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 8
    (entry,) = map(json.loads, (run / wd.HISTORY).read_text().splitlines())
    assert entry["until_step"] == 4 and entry["changed"] == {"train.steps": [6, 8]}
    assert entry["config"]["train"]["steps"] == 6
    assert "train.steps 6 -> 8" in capsys.readouterr().err


def test_free_fields_change_without_the_flag(tmp_path):
    run = _fake_run(tmp_path / "run", _cfg(progress=False))
    with wd.open_run(_cfg(progress=True), run):
        pass
    assert json.loads((run / "config.json").read_text())["train"]["progress"] is True


def test_a_run_without_checkpoints_takes_the_new_config(tmp_path):
    run = _fake_run(tmp_path / "run", _cfg(d_model=32), steps=())
    with wd.open_run(_cfg(d_model=64), run):
        pass
    assert json.loads((run / "config.json").read_text())["model"]["d_model"] == 64


def test_field_missing_from_an_older_config_counts_as_its_default(tmp_path):
    saved = to_dict(_cfg())
    del saved["rollout"]["speculative"]["probe_every"]  # as written before the field existed
    assert wd.config_changes(saved, _cfg()) == {}
    assert wd.config_changes(
        saved,
        dataclasses.replace(
            _cfg(),
            rollout=dataclasses.replace(
                Config().rollout, speculative=dataclasses.replace(Config().rollout.speculative, probe_every=3)
            ),
        ),
    ) == {"rollout.speculative.probe_every": (10, 3)}


def test_a_superseded_default_matches_its_new_spelling():
    saved = to_dict(_cfg())
    saved["train"]["memory_budget_gib"] = 2.0  # the automatic microbatch budget's default before 0 = "from the device"
    assert _cfg().train.memory_budget_gib == 0.0 and wd.config_changes(saved, _cfg()) == {}
    saved["train"]["memory_budget_gib"] = 3.0  # a budget the user chose is still a change
    assert wd.config_changes(saved, _cfg()) == {"train.memory_budget_gib": (3.0, 0.0)}
    saved = to_dict(_cfg())
    saved["train"]["remat"] = "none"  # the default before "auto" (which is "none" on CPU without a budget)
    assert _cfg().train.remat == "auto" and wd.config_changes(saved, _cfg()) == {}
    saved["train"]["remat"] = "full"
    assert wd.config_changes(saved, _cfg()) == {"train.remat": ("full", "auto")}


def test_second_holder_is_refused_naming_the_first(tmp_path):
    run = tmp_path / "run"
    with wd.open_run(_cfg(), run):
        with pytest.raises(wd.WorkdirError, match=r"in use by another jaxrl train \(pid \d+ on host"):
            with wd.open_run(_cfg(), run):
                pass
    with wd.open_run(_cfg(), run):  # released at the end of the first
        pass


def test_torn_config_json_names_the_file(tmp_path):
    run = _fake_run(tmp_path / "run", _cfg())
    (run / "config.json").write_text('{"model": {"d_model": 3')
    with pytest.raises(wd.WorkdirError, match=r"config\.json: not valid JSON"):
        wd.read_run_config(run)


def test_empty_checkpoints_folder_is_a_new_run(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # what an Orbax manager leaves on a new path
    with wd.open_run(_cfg(), tmp_path / "run"):
        pass
