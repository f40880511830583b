"""The serving engine against the RL engine on the same samples: generated tokens/s, and the serving
engine's time to first token.

A burst of --requests requests (one prompt of --prompt-len random tokens each, n=1, up to --new-tokens
tokens, temperature 1; with --mixed every request draws with its own temperature / top_p / limit) is
submitted at once to a started `ServingEngine` (jaxrl/serve/engine.py) and read to the end, each handle
by its own thread; the RL `Engine.sample` (jaxrl/rollout/engine/driver.py) draws the same prompts with
the same slots and chunk (with --mixed at top_p 0.9: its nucleus sorts the vocabulary every step, as
the serving engine's does in every step where some slot truncates). Both are timed after an untimed
warm-up of the same workload (compiles). Tokens are counted as generated (EOS included), so the two
sides may differ in count; the figure is tokens per second.

Last line: one JSON object: serve / rl tokens per second, `ratio` (serve / rl), the serving engine's
time to first token (p50, p90 over the requests, seconds) and its chunk count.

    PYTHONPATH=. python benchmarks/serve_engine.py --small     # tiny model, seconds
    PYTHONPATH=. python benchmarks/serve_engine.py             # bench-small (README), CPU: minutes
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import jax
import numpy as np

from jaxrl.config import EngineConfig, ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.serve.engine import ServingEngine
from jaxrl.serve.requests import Request, Token

SMALL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
BENCH_SMALL = ModelConfig(
    vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, mlp_dim=1408, tie_embeddings=False
)


def _requests(args, vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(args.requests):
        prompt = tuple(int(t) for t in rng.integers(1, vocab, args.prompt_len))
        if args.mixed:
            temp, top_p = (0.0, 0.7, 1.0, 1.3)[i % 4], (1.0, 0.9, 0.5)[i % 3]
            out.append(Request(prompt, args.new_tokens - i % 5, temperature=temp, top_p=top_p, seed=i))
        else:
            out.append(Request(prompt, args.new_tokens, temperature=1.0))
    return out


def _serve(engine: ServingEngine, requests: list[Request]) -> tuple[float, int, list[float]]:
    """-> (seconds, tokens, time to first token per request)."""
    start = time.perf_counter()
    handles = [engine.submit(r) for r in requests]
    ttft, counts = [0.0] * len(handles), [0] * len(handles)

    def read(i):
        for event in handles[i].events(timeout=600):
            if isinstance(event, Token):
                if counts[i] == 0:
                    ttft[i] = time.perf_counter() - start
                counts[i] += 1

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(handles))]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    return time.perf_counter() - start, sum(counts), ttft


def _rl(engine: Engine, params, requests: list[Request]) -> tuple[float, int]:
    start = time.perf_counter()
    groups = engine.sample(params, 0, [(i, np.asarray(r.prompt), 1) for i, r in enumerate(requests)])
    jax.block_until_ready(groups[-1].tokens_GxT)
    return time.perf_counter() - start, int(sum(g.completion_mask_GxT.sum() for g in groups))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model and shape (seconds)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mixed", action="store_true", help="per-request temperature / top_p / limit / seed")
    args = ap.parse_args()
    cfg = BENCH_SMALL
    if args.small:
        cfg = SMALL
        args.requests, args.slots, args.prompt_len, args.new_tokens = 16, 4, 8, 16
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    eos = cfg.vocab_size - 1
    requests = _requests(args, cfg.vocab_size)
    serve = ServingEngine(
        params,
        cfg,
        eos_id=eos,
        pad_id=0,
        slots=args.slots,
        max_prompt_tokens=args.prompt_len,
        max_new_tokens=args.new_tokens,
        max_n=1,
        chunk=args.chunk,
    )
    serve.start()
    ecfg = EngineConfig(enabled=True, slots=args.slots, chunk=args.chunk)
    top_p = 0.9 if args.mixed else 1.0
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=top_p, eos_id=eos, pad_id=0)
    rl = Engine(cfg, ecfg, sampling=sp, group_size=1, prompt_len=args.prompt_len, rng=jax.random.PRNGKey(1))
    _serve(serve, requests)  # warm-up: compiles
    _rl(rl, params, requests)
    chunks0 = serve.stats()["chunks"]
    serve_s, serve_tokens, ttft = _serve(serve, requests)
    chunks = serve.stats()["chunks"] - chunks0
    serve.stop()
    rl_s, rl_tokens = _rl(rl, params, requests)
    out = {
        "serve_tokens_per_s": serve_tokens / serve_s,
        "rl_tokens_per_s": rl_tokens / rl_s,
        "ratio": (serve_tokens / serve_s) / (rl_tokens / rl_s),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "serve_chunks": chunks,
        "serve_tokens": serve_tokens,
        "rl_tokens": rl_tokens,
        "args": vars(args),
    }
    print(f"serve {out['serve_tokens_per_s']:.0f} tok/s, rl engine {out['rl_tokens_per_s']:.0f} tok/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
