"""Multi-turn rollouts with a 20 ms environment step: environment steps overlapped with decoding vs
a turn-synchronous loop (jaxrl.rollout.episodes.driver, agent.overlap true / false).

Workload: the `tiny` shape (common.tiny(), random weights) over a 16-character alphabet with its
final-norm scale zeroed, so every next token is uniform over the 19-token vocab: the end-of-turn
token "]" comes with probability 1/19 per step (geometric turns, mean ~19 tokens, a long tail), and
EOS is disabled (its id is out of the vocab) so every episode plays --turns turns unless the budget
--max-new (observations included) runs out. The environment sleeps --env-ms per step (a tool or a
remote service that waits) and answers "<k>". Both modes run the same episodes (same seed: the
engine's per-episode keys make the tokens independent of timing; checked) on the same --slots
slots, --episodes episodes (--groups requests x G=4), each timed after an untimed warm-up run.

Why this shape: on the 2-core CPU a decode step of the tiny model over 16 slots takes a few tenths
of a millisecond, so a turn decodes in a few milliseconds against the 20 ms environment step; the
environment's latency is then what the turn-synchronous loop pays every turn (plus waiting for the
longest turn of its wave), and what overlapping can hide. With bench-small a step costs tens of
milliseconds, a turn far more than 20 ms, and there is little to hide on this machine. More episodes
than slots (8x) is what lets the overlapped engine hide it: while a slot's episode waits on its
environment, the slot decodes another episode (an episode never holds a slot while waiting).

Last line: one JSON object with `speedup_async_env` (episodes/s overlapped / turn-synchronous), and
per mode episodes/s, model tokens/s, seconds, env seconds (sum of step durations), env seconds
exposed (the engine blocked on environments) and hidden (the rest), chunks and place calls; plus
the load average. (Turn-synchronous steps of one wave also run side by side in the pool, so there too
the sum of step durations exceeds the time exposed; only overlapping hides it behind decoding.)

    PYTHONPATH=. python benchmarks/agents.py            # a few minutes at most
    PYTHONPATH=. python benchmarks/agents.py --quick    # seconds (smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

G = 4
ALPHABET = "]<>0123456789abc"


class _NoEosTokenizer:
    """The char tokenizer with EOS moved out of the vocab (never drawn): episodes end by their turns."""

    def __init__(self, base):
        self.base, self.pad_id, self.bos_id = base, base.pad_id, base.bos_id
        self.vocab_size, self.eos_id = base.vocab_size, base.vocab_size

    def encode(self, text):
        return self.base.encode(text)

    def decode(self, ids):
        return self.base.decode([i for i in ids if i != self.base.eos_id])


class SleepyEnv:
    """--turns turns of --env-ms each; the observation says which turn it was."""

    def __init__(self, turns: int, env_s: float):
        self.turns, self.env_s = turns, env_s

    def reset(self, record, rng):
        self.k = 0
        return record["prompt"]

    def step(self, action):
        from jaxrl.agents.env import StepResult

        time.sleep(self.env_s)
        self.k += 1
        return StepResult(f"<{self.k}>", 1.0, self.k >= self.turns, {})


def _mode(overlap: bool, params, cfg, tok, args, requests) -> tuple[dict, list]:
    from jaxrl.config import EngineConfig
    from jaxrl.config.agent import AgentConfig
    from jaxrl.rollout.episodes.driver import EpisodeEngine
    from jaxrl.rollout.sampler import SamplingParams

    agent = AgentConfig(max_turns=args.turns, max_obs_tokens=8, env_workers=args.episodes, overlap=overlap)
    engine = EpisodeEngine(
        cfg,
        EngineConfig(slots=args.slots, chunk=args.chunk),
        agent,
        make_env=lambda: SleepyEnv(args.turns, args.env_ms / 1000),
        tokenizer=tok,
        end_of_turn="]",
        prompt_len=args.prompt_len,
        sampling=SamplingParams(max_new_tokens=args.max_new, eos_id=tok.eos_id, pad_id=tok.pad_id),
        park_batch=args.park_batch,
        place_rows=args.place_rows,
    )
    engine.run(params, 0, requests[: max(1, len(requests) // 4)], G, (1,))  # warm-up: compiles
    for key in engine.stats:
        engine.stats[key] = 0
    start = time.perf_counter()
    groups = engine.run(params, 0, requests, G, (0,))
    seconds = time.perf_counter() - start
    st = engine.stats
    n_eps = len(requests) * G
    model_tokens = int(sum(g.loss_mask_GxT.sum() for g in groups))
    turns = sum(int(g.turns_G.sum()) for g in groups)
    out = {
        "seconds": round(seconds, 3),
        "episodes_per_s": round(n_eps / seconds, 2),
        "tokens_per_s": round(model_tokens / seconds, 1),
        "model_tokens": model_tokens,
        "turns_per_episode": round(turns / n_eps, 2),
        "env_steps": st["env_steps"],
        "env_seconds": round(st["env_seconds"], 3),
        "env_exposed_seconds": round(st["env_exposed_seconds"], 3),
        "env_hidden_seconds": round(st["env_seconds"] - st["env_exposed_seconds"], 3),
        "decode_seconds": round(st["decode_seconds"], 3),
        "place_seconds": round(st["place_seconds"], 3),
        "chunks": st["chunks"],
        "place_calls": st["place_calls"],
    }
    print(f"{'overlap' if overlap else 'turn-sync'}: {out}", flush=True)
    return out, groups


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few episodes, short budget (smoke run)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--groups", type=int, default=32, help="requests; G=4 episodes each")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--env-ms", type=float, default=20.0)
    p.add_argument("--max-new", type=int, default=128, help="token budget per episode, observations included")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--park-batch", type=int, default=4, help="a chunk ends once this many more slots parked")
    p.add_argument("--place-rows", type=int, default=4, help="rows per place call (padded)")
    args = p.parse_args(argv)
    if args.quick:
        args.slots, args.groups, args.max_new, args.turns = 4, 4, 48, 3
    args.episodes = args.groups * G
    import jax
    import numpy as np

    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.models import transformer as tf

    tok = _NoEosTokenizer(CharTokenizer(ALPHABET))
    cfg = dataclasses.replace(common.tiny(), vocab_size=tok.vocab_size, max_seq_len=args.prompt_len + args.max_new)
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    params = dict(params, final_norm=jax.tree.map(lambda x: x * 0.0, params["final_norm"]))  # uniform next token
    rng = np.random.default_rng(0)
    requests = [
        (i, {"id": str(i), "prompt": "".join(rng.choice(list("0123456789abc"), 5))}) for i in range(args.groups)
    ]
    print(
        f"tiny model, vocab {tok.vocab_size}, {args.slots} slots, {args.episodes} episodes x {args.turns} turns, "
        f"env step {args.env_ms} ms, budget {args.max_new}, backend {jax.default_backend()}",
        flush=True,
    )
    sync, sync_groups = _mode(False, params, cfg, tok, args, requests)
    over, over_groups = _mode(True, params, cfg, tok, args, requests)
    same = all(np.array_equal(a.tokens_GxT, b.tokens_GxT) for a, b in zip(sync_groups, over_groups))
    common.emit(
        {
            "benchmark": "agents",
            "config": "quick" if args.quick else "tiny",
            "speedup_async_env": round(over["episodes_per_s"] / sync["episodes_per_s"], 2),
            "overlap": over,
            "turn_sync": sync,
            "same_episodes": bool(same),
            "slots": args.slots,
            "episodes": args.episodes,
            "turns": args.turns,
            "env_ms": args.env_ms,
            "max_new": args.max_new,
            "park_batch": args.park_batch,
            "place_rows": args.place_rows,
            "chunk": args.chunk,
            "backend": jax.default_backend(),
            "load_average": common.load_average(),
        }
    )


if __name__ == "__main__":
    main()
