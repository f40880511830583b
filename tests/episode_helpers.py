"""Shared by tests/test_episodes*.py: a tiny model over a small character alphabet (so a random-init
model ends turns and episodes often when sampling), a toy counting environment, and a reference
host loop that plays an episode with the plain sampler turn by turn."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.agents.env import StepResult
from jaxrl.config import EngineConfig, ModelConfig
from jaxrl.config.agent import AgentConfig
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models import transformer as tf
from jaxrl.rollout.episodes.driver import EpisodeEngine
from jaxrl.rollout.sampler import SamplingParams, sample

# 18 tokens: the end of turn "]" and EOS each get ~1/18 of a random model's mass.
TOK = CharTokenizer("]<>0123456789abc")
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
MOE = ModelConfig(
    vocab_size=TOK.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    n_experts=4,
    experts_per_token=2,
    expert_mlp_dim=32,
)
P, T = 8, 28


@functools.cache
def params(cfg=CFG, seed=0):
    return tf.init_params(cfg, jax.random.PRNGKey(seed))


class CountEnv:
    """Prompt = record["prompt"]. Step k (1-based) answers "<k" + the action's length + ">" (a digit or
    two), reward = the number of "a" in the action, done after record["turns"] steps; info has
    shaping 0.5, tool_calls 1 per step and success = done. Options: sleep_s(rng) seconds per step,
    raise at step `fail_at`, or answer `obs` instead."""

    def __init__(self, sleep=None, fail_at=None, obs=None):
        self.sleep, self.fail_at, self.obs = sleep, fail_at, obs

    def reset(self, record, rng):
        self.k, self.turns, self.rng = 0, record["turns"], rng
        return record["prompt"]

    def step(self, action):
        self.k += 1
        if self.sleep is not None:
            time.sleep(self.sleep(self.rng))
        if self.k == self.fail_at:
            raise RuntimeError("the environment broke")
        obs = self.obs if self.obs is not None else f"<{self.k}{len(action)}>"
        done = self.k >= self.turns
        return StepResult(obs, float(action.count("a")), done, {"shaping": 0.5, "tool_calls": 1, "success": done})


RECORDS = [
    {"id": f"r{i}", "prompt": p, "turns": t}
    for i, (p, t) in enumerate([("12a3", 3), ("b0", 2), ("ca1c2", 4), ("7", 1), ("a<b>", 3)])
]


def requests(n=None):
    n = len(RECORDS) if n is None else n
    return [(i, RECORDS[i]) for i in range(n)]


def engine(
    cfg=CFG,
    slots=3,
    chunk=4,
    overlap=True,
    greedy=False,
    temperature=1.0,
    make_env=CountEnv,
    eot="]",
    max_turns=4,
    max_obs_tokens=6,
    workers=4,
    max_new_tokens=T,
    **kw,
):
    agent = AgentConfig(max_turns=max_turns, max_obs_tokens=max_obs_tokens, env_workers=workers, overlap=overlap)
    return EpisodeEngine(
        cfg,
        EngineConfig(slots=slots, chunk=chunk),
        agent,
        make_env=make_env,
        tokenizer=TOK,
        end_of_turn=eot,
        prompt_len=P,
        sampling=SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy, eos_id=TOK.eos_id, pad_id=TOK.pad_id
        ),
        **kw,
    )


def reference_episode(p, cfg, record, eot_id, max_turns, max_obs, temperature=1.0):
    """One greedy episode by the plain sampler, turn by turn: each turn samples from prompt + history
    as one longer prompt (left-padded to P + T; always T new tokens, one compile), cut at the first
    end of turn / EOS or at the budget; the observation is appended as `EpisodeEngine` does.
    -> (tokens_T, loss_mask_T, logp_T, turns)."""
    env = CountEnv()
    prompt = [TOK.bos_id] + TOK.encode(env.reset(record, None))
    hist, loss, logp, turns = [], [], [], 0
    while True:
        ids = prompt + hist
        row = np.zeros((1, P + T), np.int32)
        mask = np.zeros((1, P + T), np.int32)
        row[0, P + T - len(ids) :], mask[0, P + T - len(ids) :] = ids, 1
        out = sample(
            p,
            cfg,
            jnp.asarray(row),
            jnp.asarray(mask),
            jax.random.PRNGKey(0),
            group_size=1,
            sampling=SamplingParams(
                max_new_tokens=T, temperature=temperature, eos_id=TOK.eos_id, pad_id=TOK.pad_id, greedy=True
            ),
        )
        new, new_logp = list(np.asarray(out.tokens_BxT[0])), list(np.asarray(out.logp_BxT[0]))
        stops = [i for i, t in enumerate(new) if t in (eot_id, TOK.eos_id)]
        n = min(stops[0] + 1 if stops else T, T - len(hist))
        turn = new[:n]
        hist, loss, logp, turns = hist + turn, loss + [1.0] * n, logp + new_logp[:n], turns + 1
        if turn[-1] not in (eot_id, TOK.eos_id):
            break  # the budget cut the turn
        res = env.step(TOK.decode(turn[:-1] if turn[-1] == TOK.eos_id else turn))
        if turn[-1] == TOK.eos_id or res.done or turns >= max_turns:
            break
        obs = TOK.encode(res.observation)[:max_obs][: T - len(hist)]
        hist, loss, logp = hist + obs, loss + [0.0] * len(obs), logp + [0.0] * len(obs)
        if len(hist) >= T:
            break

    def pad(xs, fill, dtype):
        return np.array(xs + [fill] * (T - len(xs)), dtype)

    return pad(hist, TOK.pad_id, np.int32), pad(loss, 0.0, np.float32), pad(logp, 0.0, np.float32), turns
