"""MoE routing replay on every rollout path (docs/scale.md): the slot engine (plain rows, partial rollouts
with rows carried across steps and re-prefilled, the speculative tail, dynamic sampling's kept groups)
and multi-turn episodes (observations prefilled between turns) hand the update the experts their rollout
used, as `routing_BxSxLxK`, laid out as the static sampler's; `jaxrl plan` plans that field; black-box
agents record none, and asking to replay with them is a ConfigError naming `train.routing_replay`.

The training-run tests run a tiny MoE `jaxrl train` in this process and catch each step's policy and
update batch on their way into the update: replayed at the rollout's params the update's router agrees
with the recording on every scored token (`moe/routing_mismatch` = 0) and its log-probs are the
rollout's; with the router moved (a later policy) the replayed forward still uses the recorded experts
while the router's own choice differs. Without replay a stale partial row's routing differs after an
update (`moe/routing_mismatch` > 0).
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY

from jaxrl.config import ConfigError, load_config
from jaxrl.rollout.episodes.records import EpisodeGroup
from jaxrl.sources.agents import episode_batch

MOE = ["model.n_layers=2", "model.n_experts=4", "model.experts_per_token=2"]
SMALL = [t for t in TINY if not t.startswith(("model.n_layers=", "train.eval_"))] + [
    "train.eval_every=0",
    "train.eval_prompts=4",
    "checkpoint.every=0",
]
AGENT = [t for t in SMALL if not t.startswith("data.")] + ["data.num_train=200", "data.num_test=20"]
AGENT += ["rollout.engine.slots=8"]


def _episode_group(G: int, P: int, T: int, L: int, K: int, first: int) -> EpisodeGroup:
    """G episodes of P + T slots whose routing numbers every (row, slot, layer, k) uniquely from `first`."""
    zeros_G = np.zeros(G, np.int32)
    loss_GxT = np.tile((np.arange(T) % 3 != 2).astype(np.float32), (G, 1))  # every third token an observation
    routing = first + np.arange(G * (P + T) * L * K, dtype=np.int32).reshape(G, P + T, L, K)
    return EpisodeGroup(
        "tag",
        np.arange(P, dtype=np.int32),
        np.ones(P, np.int32),
        np.ones((G, T), np.int32),
        loss_GxT,
        np.zeros((G, T), np.float32),
        np.where(loss_GxT > 0, 0, -1).astype(np.int32),
        np.ones(G, bool),
        np.zeros(G, bool),
        np.ones(G, np.float32),
        np.zeros(G, np.float32),
        zeros_G,
        zeros_G,
        zeros_G,
        zeros_G,
        zeros_G,
        np.ones(G, bool),
        routing,
    )


def test_episode_batch_carries_the_routing_of_every_slot_observations_included():
    G, P, T, L, K = 3, 4, 6, 2, 2
    groups = [_episode_group(G, P, T, L, K, first) for first in (0, 10_000)]
    rewards = [np.zeros((G, 2), np.float32)] * 2
    batch = episode_batch(groups, rewards)
    assert batch.routing_BxSxLxK is not None and batch.routing_BxSxLxK.shape == (2 * G, P + T, L, K)
    want = np.concatenate([np.asarray(g.routing_GxCxLxK) for g in groups])
    np.testing.assert_array_equal(batch.routing_BxSxLxK, want)
    # row b of the batch is row b of the group order: group_id_B and routing move together
    np.testing.assert_array_equal(batch.group_id_B, [0, 0, 0, 1, 1, 1])
    assert batch.routing_BxSxLxK[G, 0, 0, 0] == 10_000
    dense = [g._replace(routing_GxCxLxK=None) for g in groups]
    assert episode_batch(dense, rewards).routing_BxSxLxK is None


def test_black_box_agents_with_moe_replay_are_a_config_error_naming_the_field():
    from jaxrl.sources import blackbox

    cfg = load_config(REPO / "configs" / "agent_openai_calculator.py", MOE)
    with pytest.raises(ConfigError) as err:
        blackbox.check_blackbox_config(cfg, cfg.data.task)
    assert str(err.value).startswith("train.routing_replay")
    off = load_config(REPO / "configs" / "agent_openai_calculator.py", [*MOE, "train.routing_replay=false"])
    blackbox.check_blackbox_config(off, off.data.task)  # the update routes with its own router: allowed
    dense = load_config(REPO / "configs" / "agent_openai_calculator.py")
    blackbox.check_blackbox_config(dense, dense.data.task)  # a dense policy: nothing to replay
    # the resolved model decides (an HF checkpoint's architecture, unknown to cfg.model): here a MoE one
    with pytest.raises(ConfigError, match="train.routing_replay"):
        blackbox.check_blackbox_config(dense, dense.data.task, cfg.model)


# ---- tiny MoE training runs, caught on their way into the update


def _train(tmp_path, config: str, sets: list[str]) -> tuple[list[dict], list[tuple], object]:
    """`jaxrl train` in this process -> (metrics rows, per step (policy, host batch, update batch) as
    numpy, the run's resolved model config)."""
    from jaxrl import cli
    from jaxrl.sharding import named_sharding
    from jaxrl.train import loop

    caught, model_cfgs = [], []
    produce, assemble, build = loop.produce_scored_groups, loop.assemble_batch, loop.build_base

    def produce_caught(run, state, policy, stream, step):
        state, produced = produce(run, state, policy, stream, step)
        caught.append([jax.tree.map(np.array, policy), produced.host_batch])  # copies: the update donates
        return state, produced

    def assemble_caught(host_batch, routing, mesh, preset, n_rows):
        batch = assemble(host_batch, routing, mesh, preset, n_rows)
        if "routing_BxSxLxK" in batch:  # laid out as the static sampler's, by its name
            assert batch["routing_BxSxLxK"].sharding == named_sharding(mesh, preset, "routing_BxSxLxK")
        caught[-1].append({k: np.array(v) for k, v in batch.items()})
        return batch

    def build_caught(*args, **kw):
        out = build(*args, **kw)  # (tokenizer, the resolved model config, ...)
        model_cfgs.append(out[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "produce_scored_groups", produce_caught)
        mp.setattr(loop, "assemble_batch", assemble_caught)
        mp.setattr(loop, "build_base", build_caught)
        args = sum((["--set", t] for t in sets), [])
        code = cli.main(["train", str(REPO / "configs" / config), *args, "--workdir", str(tmp_path / "run")])
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows[1:], [tuple(c) for c in caught], model_cfgs[0]


def _moved_router(params, seed: int):
    """The params with every router weight moved by unit noise: a later policy whose router chooses differently."""
    rng = np.random.default_rng(seed)

    def move(path, x):
        named = any("router" in str(getattr(p, "key", "")) for p in path)
        return x + rng.normal(size=x.shape).astype(x.dtype) if named else x

    moved = jax.tree_util.tree_map_with_path(move, params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(params)))
    return moved


def _check_replayed(model_cfg, temperature: float, policy, batch: dict) -> None:
    """The update's batch against the policy that drew it: replayed, the update's router agrees with the
    recording on every scored token and its log-probs are the rollout's (fresh tokens); under a moved
    router the replayed forward still uses the recorded experts, the router's own choice differs."""
    from jaxrl.models.transformer import token_logprobs
    from jaxrl.train.steps import make_logp_fn

    routing = batch["routing_BxSxLxK"]
    B, T = batch["tokens_BxT"].shape
    P = batch["prompt_tokens_BxP"].shape[1]
    assert routing.shape == (B, P + T, model_cfg.n_moe_layers, model_cfg.experts_per_token)
    assert routing.dtype == np.int32
    scored_BxT = batch["completion_mask_BxT"] > 0
    logp_BxT, _, ex = jax.jit(make_logp_fn(model_cfg, temperature, routing_replay=True))(policy, batch)
    assert scored_BxT.sum() > 0 and float(np.asarray(ex["moe/routing_mismatch_BxT"])[scored_BxT].max()) == 0.0
    fresh_BxT = scored_BxT & (batch.get("stale_BxT", np.zeros((B, T))) == 0)
    np.testing.assert_allclose(np.asarray(logp_BxT)[fresh_BxT], batch["rollout_logp_BxT"][fresh_BxT], atol=3e-5, rtol=0)

    def forward(params, replay):
        args = (batch["prompt_tokens_BxP"], batch["prompt_mask_BxP"], batch["tokens_BxT"])
        args += (batch["completion_mask_BxT"], temperature)
        return token_logprobs(params, model_cfg, *args, replay, return_moe=True)

    moved = _moved_router(policy, seed=3)
    logp_r, _, moe_r = forward(moved, jnp.asarray(routing))
    logp_o, _, moe_o = forward(moved, None)
    # slot P - 1 + t fed the input that scored completion token t
    used_BxTxLxK = np.transpose(np.asarray(moe_r.experts_LxBxTxK), (1, 2, 0, 3))[:, P - 1 : P - 1 + T]
    np.testing.assert_array_equal(used_BxTxLxK[scored_BxT], routing[:, P - 1 : P - 1 + T][scored_BxT])
    own_BxTxLxK = np.transpose(np.asarray(moe_o.topk_LxBxTxK), (1, 2, 0, 3))[:, P - 1 : P - 1 + T]
    rec = np.sort(routing[:, P - 1 : P - 1 + T], -1)
    assert np.any(np.sort(own_BxTxLxK, -1)[scored_BxT] != rec[scored_BxT])  # the moved router would differ
    assert float(np.abs(np.asarray(logp_r) - np.asarray(logp_o))[scored_BxT].max()) > 1e-4


ENGINE_PATHS = {
    # fill admission, one decode step per chunk and more slots than a step needs: samples carried into the
    # next step, their caches (and routing) re-prefilled under the new params; fresh groups beside them
    "partial_reprefill": [
        "rollout.engine.admission=fill",
        "rollout.engine.chunk=1",
        "rollout.engine.slots=32",
        "rollout.engine.reprefill=true",
        "train.steps=3",
    ],
    # speculation once 4 or fewer slots decode; dynamic sampling drops the groups of one reward
    "speculative_tail_dynamic": [
        "rollout.speculative.enabled=true",
        "rollout.speculative.max_active_rows=4",
        "rollout.speculative.calibrate=false",
        "rollout.engine.dynamic_sampling=true",
        "train.steps=2",
    ],
    # each prompt's samples drawn over several rounds (each a new prefill), one group of them all
    "vigor": ["rollout.engine.allocation=vigor", "train.steps=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(ENGINE_PATHS))
def test_engine_rows_replay_their_recorded_routing_in_the_update(tmp_path, in_process_cache, path):
    from jaxrl.train.plan import engine_routing

    sets = [*SMALL, *MOE, "rollout.engine.enabled=true", *ENGINE_PATHS[path]]
    rows, caught, model_cfg = _train(tmp_path, "grpo_arithmetic.py", sets)
    cfg = load_config(REPO / "configs" / "grpo_arithmetic.py", sets)
    assert [r["moe/routing_mismatch"] for r in rows] == [0.0] * cfg.train.steps
    want = engine_routing(cfg, model_cfg)  # what `jaxrl plan` compiles the update for
    for policy, host_batch, batch in caught:
        np.testing.assert_array_equal(batch["routing_BxSxLxK"], host_batch.routing_BxSxLxK)
        assert (batch["routing_BxSxLxK"].shape, batch["routing_BxSxLxK"].dtype) == (want.shape, want.dtype)
        _check_replayed(model_cfg, cfg.rollout.temperature, policy, batch)
    if path == "partial_reprefill":  # the path was taken: carried rows, re-prefilled
        assert sum(r["engine/reprefilled_samples"] for r in rows) > 0 and max(r["stale_tokens"] for r in rows) > 0
    elif path == "vigor":  # each group's samples from several rounds of draws, concatenated
        assert all(r["engine/vigor_draws"] >= 2 for r in rows)
    else:  # the tail speculated, and groups were dropped
        assert sum(r["engine/drafted"] for r in rows) > 0 and sum(r["engine/dyn_dropped"] for r in rows) > 0


@pytest.mark.slow
def test_agent_episodes_replay_the_routing_of_model_and_observation_tokens(tmp_path, in_process_cache):
    from jaxrl.train.plan import engine_routing

    sets = [*AGENT, *MOE, "train.steps=2"]
    rows, caught, model_cfg = _train(tmp_path, "agent_gridworld.py", sets)
    cfg = load_config(REPO / "configs" / "agent_gridworld.py", sets)
    assert [r["moe/routing_mismatch"] for r in rows] == [0.0] * cfg.train.steps
    assert max(r["agent/turns_mean"] for r in rows) > 1  # observations were prefilled between turns
    want = engine_routing(cfg, model_cfg)
    for policy, _, batch in caught:
        assert (batch["routing_BxSxLxK"].shape, batch["routing_BxSxLxK"].dtype) == (want.shape, want.dtype)
        _check_replayed(model_cfg, cfg.rollout.temperature, policy, batch)


@pytest.mark.slow
def test_without_replay_a_stale_partial_row_is_routed_differently_after_an_update(tmp_path, in_process_cache):
    """No re-prefill: a carried row keeps the routing an older policy drew it with; after an update with
    a large step the update's own router disagrees on some of its tokens."""
    sets = [*SMALL, *MOE, "rollout.engine.enabled=true", *ENGINE_PATHS["partial_reprefill"][:3]]
    sets += ["train.steps=3", "optim.learning_rate=0.03", "optim.warmup_steps=0", "train.routing_replay=false"]
    rows, caught, _ = _train(tmp_path, "grpo_arithmetic.py", sets)
    assert rows[0]["moe/routing_mismatch"] == 0.0  # step 1: nothing stale, the rollout's own policy
    assert max(r["stale_tokens"] for r in rows[1:]) > 0
    assert max(r["moe/routing_mismatch"] for r in rows[1:]) > 0
    assert all("routing_BxSxLxK" in batch for _, _, batch in caught)  # recorded still, for the metric


MULTI = (
    "grpo_arithmetic.py",
    [*SMALL, "rollout.engine.enabled=true", *ENGINE_PATHS["partial_reprefill"][:4], "rollout.prompts_per_step=8"],
)
# Agent episodes reach the update through the same per-process rows -> assemble_batch as the engine's
# (tests/test_engine_multiprocess.py plays them on two processes); one process checks their routing above.


@pytest.mark.slow
def test_two_processes_replay_each_processs_rows(tmp_path, cache_env):
    """Two processes x 4 fake devices, each drawing its own rows on its own engine: the update's global
    routing_BxSxLxK (each process's rows put where its batch rows are) agrees with the router on every
    scored token, and the update's log-probs are the rollout's."""
    from multihost_helpers import device_env, finish, free_port, metric_rows, start_train, without_cluster_vars

    config, sets = MULTI
    sets = [*sets, *MOE, "mesh.preset=data", "train.steps=2"]
    env, port = device_env(without_cluster_vars(cache_env), 4), free_port()
    args = [str(REPO / "configs" / config), *sum((["--set", t] for t in sets), []), "--workdir", str(tmp_path / "r")]
    procs = {
        p: start_train(
            [*args, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(p)],
            env,
            tmp_path / f"stderr{p}.txt",
        )
        for p in (0, 1)
    }
    done = finish(procs, time.time() + 500)
    for p, (code, err, _) in done.items():
        assert code == 0, (p, err[-3000:])
    rows = metric_rows(tmp_path / "r")
    for step in (1, 2):
        assert rows[step]["moe/routing_mismatch"] == 0.0, rows[step]  # logged only when the batch has routing
        assert rows[step]["mismatch_abs_logp_fresh"] < 1e-4, rows[step]
    assert rows[2]["engine/reprefilled_samples"] > 0 and rows[2]["stale_tokens"] > 0  # carried, re-prefilled


def _plan_update(config: str, sets: list[str], capsys) -> dict:
    """`jaxrl plan --programs update` in this process -> the update's record."""
    from jaxrl import cli

    args = sum((["--set", t] for t in [*sets, "mesh.preset=single"]), [])
    assert cli.main(["plan", str(REPO / "configs" / config), *args, "--programs", "update"]) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return next(r for r in records if r["program"] == "update")


@pytest.mark.slow
def test_plan_compiles_the_update_with_the_engines_and_the_episodes_routing(capsys, in_process_cache):
    """The planned update takes routing_BxSxLxK from the engine as from the static sampler (whose struct
    the plan takes from the sampler itself): the engine's compiled arguments exceed the static sampler's
    by exactly its own two fields, group_id_B and stale_BxT; episodes' batches carry it too."""
    big = [*SMALL, *MOE, "rollout.prompts_per_step=32"]  # big enough for the record's 1e-3 MiB rounding
    static = _plan_update("grpo_arithmetic.py", big, capsys)
    engine = _plan_update("grpo_arithmetic.py", [*big, "rollout.engine.enabled=true"], capsys)
    assert "routing_BxSxLxK" in static["inputs"]
    assert set(engine["inputs"]) == {*static["inputs"], "group_id_B", "stale_BxT"}
    assert engine["inputs"]["routing_BxSxLxK"] == static["inputs"]["routing_BxSxLxK"]
    cfg = load_config(REPO / "configs" / "grpo_arithmetic.py", big)
    B, T = cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.rollout.max_new_tokens
    grown = engine["memory_mib"]["argument"] - static["memory_mib"]["argument"]
    assert grown == pytest.approx((B * 4 + B * T * 4) / 2**20, abs=2e-3)  # the routing alone: 0.025 MiB
    agents = _plan_update("agent_gridworld.py", [*AGENT, *MOE], capsys)
    assert agents["inputs"]["routing_BxSxLxK"] == agents["inputs"]["tokens_BxT"]  # laid out as the rows
