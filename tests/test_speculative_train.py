"""`rollout.speculative.enabled=true` is one switch in a training config: the default GRPO config
trains 2 steps with it, logs the spec/* metrics, and the sampler's log-probs still match the
trainer's (see preset_configs.py for the cost controls)."""

import math

import pytest
from preset_configs import config_path, overrides

from jaxrl.config import load_config

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["rollout.speculative.drafter=int8"],
        ["rollout.speculative.drafter=reuse", "rollout.speculative.reuse_width=4", "rollout.speculative.probe_every=1"],
    ],
    ids=["int8-calibrated", "reuse-every-rollout"],
)
def test_grpo_trains_with_speculative_rollouts(extra, tmp_path, in_process_cache, capsys):
    from jaxrl.train.loop import train

    cfg = load_config(config_path("grpo"), overrides("grpo") + ["rollout.speculative.enabled=true", *extra])
    rows = train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["mismatch_abs_logp"] < 0.05
        for key in ("spec/speculated_frac", "rollout/tokens_per_s"):
            assert math.isfinite(row[key]), key
    # Rollout 1 always speculates (a probe); the others only if speculation can gain, or with
    # probe_every=1. A plain rollout logs speculated_frac 0 and no acceptance estimate.
    assert "spec/acceptance_estimate" in rows[1]
    if "rollout.speculative.probe_every=1" in extra:
        assert "spec/acceptance_estimate" in rows[2]
    if "int8" in extra[0]:  # the control ran on costs measured on this machine
        assert "speculative costs on this machine" in capsys.readouterr().err
