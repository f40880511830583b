"""The rollout side of the loop (jaxrl.sources.sampler, jaxrl.rollout.speculative.control): the speculation
control is explicit host state with a pure update, it is written under the checkpoint keys existing
runs hold, and a SamplerSource rebuilt from its own checkpoint_state() draws what the original would."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_CONFIG, TINY

from jaxrl.config import load_config
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import init_params, param_logical_axes
from jaxrl.rollout.speculative.calibrate import StepCosts, costs_from_json
from jaxrl.rollout.speculative.control import (
    SpecControl,
    can_ever_pay,
    control_state,
    restored_control,
    speculate_now,
    stays_off,
    updated,
)
from jaxrl.rollout.speculative.steps import SpecStats
from jaxrl.sharding import make_mesh, param_shardings
from jaxrl.sources.sampler import SamplerSource

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


def _stats(acceptance, reuse_acceptance):
    zeros = {f: jnp.int32(0) for f in SpecStats._fields}
    return SpecStats(
        **{**zeros, "acceptance": jnp.float32(acceptance), "reuse_acceptance": jnp.float32(reuse_acceptance)}
    )


def test_control_update_takes_a_rollouts_estimates_and_leaves_the_old_control_alone():
    control = SpecControl(0.7, 0.6, None)
    after = updated(control, _stats(0.25, 0.5))
    assert after == SpecControl(0.25, 0.5, None) and control == SpecControl(0.7, 0.6, None)
    assert updated(control, None) is control  # a plain rollout measured nothing


def test_control_is_saved_under_the_keys_existing_checkpoints_hold():
    spec = load_config(DEFAULT_CONFIG, ["rollout.speculative.enabled=true"]).rollout.speculative
    costs = StepCosts(jnp.asarray([1.5, 2.0], jnp.float32), jnp.float32(0.25))
    saved = json.loads(json.dumps(control_state(SpecControl(0.25, 0.5, costs))))
    assert list(saved) == ["spec_prior", "spec_reuse_prior", "spec_costs"]
    back = restored_control(saved, spec, costs_from_json(saved["spec_costs"]))
    assert (back.prior, back.reuse_prior) == (0.25, 0.5)
    np.testing.assert_array_equal(back.costs.verify_K, [1.5, 2.0])
    assert list(control_state(SpecControl(0.7, 0.7, None))) == ["spec_prior", "spec_reuse_prior"]
    fresh = restored_control({}, spec, None)  # a fresh run starts from the configured prior
    assert (fresh.prior, fresh.reuse_prior) == (spec.initial_acceptance, spec.initial_acceptance)


def test_speculate_now_probes_on_schedule_else_asks_whether_reuse_gains():
    spec = load_config(
        DEFAULT_CONFIG,
        [
            "rollout.speculative.enabled=true",
            "rollout.speculative.drafter=reuse",
            "rollout.speculative.reuse_width=4",
            "rollout.speculative.probe_every=3",
        ],
    ).rollout.speculative

    def no_gather():
        raise AssertionError("the draft lengths are gathered only when the decision needs them")

    control = SpecControl(0.7, 0.7, StepCosts(jnp.ones((4,), jnp.float32), jnp.float32(0.05)))
    assert speculate_now(control, spec, 1, no_gather) and speculate_now(control, spec, 4, no_gather)

    # Reuse only (fallback none): 4 drafted tokens at r = 0.7 expect (1 - 0.7^5) / 0.3 = 2.773 tokens per
    # verify; a verify costing 1 step gains (2.77 > 1), one costing 13 steps does not (0.21).
    def four():
        return np.full((16,), 4, np.int32)

    assert speculate_now(control, spec, 2, four)
    dear = control._replace(costs=StepCosts(jnp.full((4,), 13.0, jnp.float32), jnp.float32(0.05)))
    assert not speculate_now(dear, spec, 2, four)
    assert not speculate_now(control, spec, 2, lambda: np.zeros((16,), np.int32))  # no drafts: nothing to gain


@pytest.fixture(scope="module")
def reuse_setup():
    cfg = load_config(
        DEFAULT_CONFIG,
        TINY
        + [
            "rollout.speculative.enabled=true",
            "rollout.speculative.drafter=reuse",
            "rollout.speculative.reuse_width=4",
            "rollout.speculative.probe_every=1",
            "rollout.speculative.calibrate=false",
        ],
    )
    tokenizer = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    mesh, preset = make_mesh(cfg.mesh)
    params = init_params(model_cfg, jax.random.key(3))
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), params)
    params = jax.device_put(params, param_sh)
    P, n = cfg.data.max_prompt_len, cfg.rollout.prompts_per_step
    prompt_BxP = np.asarray(jax.random.randint(jax.random.key(4), (n, P), 3, tokenizer.vocab_size), np.int32)

    def build(host):
        return SamplerSource(
            cfg, model_cfg, tokenizer, mesh, preset, param_sh, params, jax.random.key(0), host, cost_cache_dir=None
        )

    return build, params, prompt_BxP, np.ones_like(prompt_BxP, bool)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["early_exit", "reuse"])
def test_the_cost_line_says_when_speculation_can_never_pay(drafter):
    """Self-drafting 4 tokens, all accepted, gives 5 tokens for verify_K[3] + 4 * draft steps; reusing
    4 whole drafts gives 5 tokens for verify_K[3]. At 5 tokens for 4.4 steps it pays, at 5.2 never."""
    spec = load_config(
        DEFAULT_CONFIG,
        [
            "rollout.speculative.enabled=true",
            f"rollout.speculative.drafter={drafter}",
            "rollout.speculative.reuse_width=4",
            "rollout.speculative.fallback=none",
            "rollout.speculative.probe_every=7",
        ],
    ).rollout.speculative
    draft = 0.1 if drafter == "early_exit" else 0.0
    for verify, pays in [(4.4 - 4 * draft, True), (5.2 - 4 * draft, False)]:
        costs = StepCosts(jnp.full((4,), verify, jnp.float32), jnp.float32(draft))
        assert can_ever_pay(costs, spec) is pays, (verify, draft)
    assert "plain sampler except one in 7" in stays_off(spec)
    assert "every rollout speculate" in stays_off(dataclasses.replace(spec, probe_every=1))


def test_a_source_rebuilt_from_its_checkpoint_state_draws_what_the_original_would(reuse_setup):
    build, params, prompt_BxP, mask_BxP = reuse_setup
    source = build({})
    source.produce(params, prompt_BxP, mask_BxP, jax.random.key(10), 1)  # fills the draft store
    saved = json.loads(json.dumps(source.checkpoint_state()))  # as the checkpoint's JSON item stores it
    assert list(saved) == ["spec_prior", "spec_reuse_prior", "spec_drafts"]
    resumed = build(saved)
    a, a_metrics = source.produce(params, prompt_BxP, mask_BxP, jax.random.key(11), 2)
    b, b_metrics = resumed.produce(params, prompt_BxP, mask_BxP, jax.random.key(11), 2)
    assert a_metrics["spec/acceptance_rate"] is not None  # the second rollout verified reused drafts
    assert a_metrics == b_metrics
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert source.checkpoint_state() == resumed.checkpoint_state()
    # Without its state (a fresh source) the same call drafts nothing: the state is what made them equal.
    _, fresh_metrics = build({}).produce(params, prompt_BxP, mask_BxP, jax.random.key(11), 2)
    assert fresh_metrics["spec/acceptance_rate"] is None
