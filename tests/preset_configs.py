"""Shared by test_preset_configs_*.py: train a `configs/<preset>_arithmetic.py` for 2 steps in-process.

Split over three test files (FILES) only to keep each under 90 s on 2 busy cores: a preset's update
step is its own XLA program, and compiling it dominates. Cost control: one warm
start (cached for the session by `in_process_cache`), conftest.TINY, 2 steps, 4 eval prompts, XLA's
persistent compilation cache (the rollout and evaluation programs are the same for every preset of a
group size, so they compile once: checked, only the update compiles per preset), the one-pass update
forward (see `overrides`) and `jax_disable_most_optimizations` (about half the compile time for
programs that run twice).
"""

import math
import pathlib

import pytest
from conftest import REPO, TINY

from jaxrl.config import load_config
from jaxrl.losses import PRESETS

GROUP = {"mc_grpo": 3, "sao": 1, "ppo": 1}  # G+1 = 3 (odd) for MC-GRPO; a single rollout for SAO and PPO
# test_preset_configs_<key>.py trains these; together they are every preset (checked there).
FILES = {
    "normalisers": ["grpo", "dr_grpo", "bnpo", "dapo", "async_const_norm", "rloo", "reinforce_pp"],
    "batch_parts": ["mc_grpo", "gdpo", "gd2po", "m2po", "sao", "mu_grpo", "ppo"],
    "objectives": ["gspo", "gspo_token", "pnpo", "gmpo", "cispo", "sapo", "tbpo"],
    "distill": ["distill"],  # test_distill.py: it needs a teacher run, which that test trains first
}


TWO_EPOCHS = {"dapo", "m2po", "cispo"}  # one per file, as shipped


def config_path(preset: str) -> pathlib.Path:
    return REPO / "configs" / f"{preset}_arithmetic.py"


def overrides(preset: str) -> list[str]:
    tiny = [t for t in TINY if not t.startswith(("rollout.group_size=", "train.eval_"))]
    # The update's shared-prefix forward (train.share_prefix, on by default) hands the loss the same
    # log-probs as the one-pass forward (test_shared_prefix.py) but costs ~50% more to compile, and the
    # update is compiled anew for every preset. Only the default config (grpo) keeps it, so the
    # shipped default path is still trained here; the other presets' losses see the same numbers.
    share_prefix = "true" if preset == "grpo" else "false"
    # The shipped preset configs take two PPO epochs (the second off-policy); one preset per file keeps
    # them, the others train one epoch: the second epoch's update is a longer compile, and the two-epoch
    # update is checked exactly elsewhere (test_steps, test_shared_prefix, test_minibatches).
    epochs = [] if preset in TWO_EPOCHS else ["train.ppo_epochs=1"]
    return [
        *tiny,
        *epochs,
        f"rollout.group_size={GROUP.get(preset, 4)}",
        "rollout.prompts_per_step=4",
        "train.steps=2",
        "train.eval_every=0",
        "train.eval_prompts=4",
        "checkpoint.every=0",
        f"train.share_prefix={share_prefix}",
    ]


def check_config_trains_two_steps(preset: str, workdir: pathlib.Path, extra: tuple = ()) -> None:
    from jaxrl.train.loop import train

    path = config_path(preset)
    shipped = load_config(path)  # the file as shipped validates, and is the preset it is named after
    assert shipped.loss.preset == preset
    PRESETS[preset].check_group_size(shipped.rollout.group_size, preset)
    rows = train(load_config(path, [*overrides(preset), *extra]), workdir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        for key in (
            "loss",
            "grad_norm",
            "ratio",
            "ratio_min",
            "ratio_max",
            "entropy",
            "mismatch_abs_logp",
            "rows_dropped",
        ):
            assert math.isfinite(row[key]), (key, row[key])
        assert "kl" not in row  # no KL term in the shipped configs: no reference policy, no kl metric
        # synchronous loop: the sampler's log-probs are the trainer's up to float error
        assert row["mismatch_abs_logp"] < 0.05
    if preset == "mc_grpo":  # one pivot per group of 3 leaves the loss
        assert rows[1]["rows_dropped"] == pytest.approx(1 / 3)
    for preset_, key in (
        ("m2po", "m2po_masked"),
        ("mu_grpo", "vetoed"),
        ("sapo", "gate"),
        ("ppo", "critic/value_loss"),
    ):
        if preset == preset_:
            assert key in rows[1]
    assert "eval/accuracy" in rows[-1]
