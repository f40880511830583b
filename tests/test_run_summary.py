"""The run's own account of itself: the line a resumed or finished run prints first, and the closing
summary's status, step count and newest evaluation (tests/test_resume.py checks them on real runs)."""

import pathlib

from jaxrl.runlog.summary import last_eval, start_line, summary

RUN = pathlib.Path("runs/x")


def test_start_line_for_fresh_resumed_and_finished_runs():
    assert start_line(RUN, 0, 100) is None
    assert start_line(RUN, 40, 100) == "jaxrl: resuming runs/x from step 40 of 100"
    done = start_line(RUN, 100, 100)
    assert done is not None and "already complete (step 100 of 100); nothing to train" in done
    assert "train.steps" in done and "--allow-config-change" in done


def test_summary_status_and_the_newest_eval_from_any_session():
    rows = [
        {"step": 0, "eval/accuracy": 0.25, "eval/reward": 0.3},
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": 0.4, "eval/accuracy": 0.5, "eval/reward": 0.6},
        {"step": 3, "loss": 0.3},
    ]
    assert last_eval(rows) == {"step": 2, "eval/accuracy": 0.5, "eval/reward": 0.6}
    assert last_eval(rows[1:2]) == {}
    stopped = summary(RUN, "base", 3, 10, "SIGTERM", rows)
    assert stopped["status"] == "stopped by SIGTERM after step 3; rerun the same command to resume"
    assert (stopped["steps_done"], stopped["steps"], stopped["final_eval"]["step"]) == (3, 10, 2)
    assert summary(RUN, "base", 10, 10, None, rows)["status"] == "complete"
    assert summary(RUN, "base", 10, 10, "SIGTERM", rows)["status"] == "complete"  # the signal came with the last step
    assert summary(RUN, "base", 0, 0, None, [])["final_eval"] == {}
