"""scripts/readme_figures.py: the figures it reports are read from the runs' metrics (a finished run is
read back, never retrained), the default run's plot is copied, and a wrong config name is an error."""

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import readme_figures  # noqa: E402


def _finished(root, name, evals, wall=123.0):
    run = root / name
    run.mkdir(parents=True)
    rows = [{"step": s, "loss": 0.1} | ({"eval/accuracy": a} if a is not None else {}) for s, a in evals]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "figures_wall_seconds.json").write_text(json.dumps({"wall_seconds": wall, "load_average": [1.5, 1, 1]}))
    (run / "progress.png").write_bytes(b"png of " + name.encode())


def test_figures_come_from_the_runs_metrics(tmp_path, capsys, monkeypatch):
    root = tmp_path / "root"
    _finished(root, "grpo_arithmetic", [(0, 0.38), (5, None), (10, 0.672), (100, 0.776)])
    _finished(root, "grpo_countdown", [(0, 0.2), (10, 0.25), (20, 0.3)], wall=60.0)
    monkeypatch.setattr(readme_figures.subprocess, "run", None)  # nothing may train: both runs are finished
    out, plot = tmp_path / "figures.json", tmp_path / "progress.png"
    argv = ["--configs", "grpo_arithmetic,grpo_countdown", "--root", str(root), "--out", str(out), "--plot", str(plot)]
    monkeypatch.setattr(readme_figures, "_commit", lambda: "abc1234")
    result = readme_figures.main(argv)
    assert json.loads(out.read_text()) == result == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    default = result["runs"]["grpo_arithmetic"]
    assert (default["accuracy_step0"], default["accuracy_step10"], default["accuracy_last"]) == (0.38, 0.672, 0.776)
    assert default["last_step"] == 100 and default["wall_seconds"] == 123.0 and result["commit"] == "abc1234"
    assert result["runs"]["grpo_countdown"]["accuracy_last"] == 0.3
    assert plot.read_bytes() == b"png of grpo_arithmetic"


def test_an_unknown_config_is_an_error(capsys):
    with pytest.raises(SystemExit):
        readme_figures.main(["--configs", "grpo_nope"])
    assert "--configs: no configs/grpo_nope.py" in capsys.readouterr().err
