"""The tail benchmark's policy: bench-small (31M params) after a short supervised warm start on long
addition, so its next-token distribution is far from uniform.

How it is made (all of it is part of what `benchmarks/speculative.py --part tail` measures):
  data   `jaxrl.data.long_addition` problems of up to DIGITS digits (a fixed seed), each sequence
         BOS + prompt + worked solution + EOS, right-padded to WIDTH tokens; the loss covers the
         solution and EOS only.
  loss   next-token cross-entropy of the full model plus EXIT_WEIGHT x the same loss of its early
         exit (the first `draft_layers` blocks, then the model's own final norm and head: exactly
         the engine's early-exit drafter). This is LayerSkip's early-exit loss (arXiv 2404.16710)
         at one exit; without it the first blocks are never trained to predict and the drafter's
         acceptance says little (the benchmark reports both, see `exit_weight`).
  opt    Adam, learning rate LR after a 10-step linear warm-up, global-norm clip 1.0, BATCH rows.

The params are written once under `root` (a file per recipe) and read back by every later run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

DIGITS = 6  # longest operand: solutions of up to 61 characters + EOS
WIDTH = 80  # BOS + 13 prompt characters + 61 + EOS = 76 <= 80
BATCH = 8
LR = 2e-3


def recipe(steps: int, draft_layers: int, exit_weight: float) -> dict:
    return {
        "digits": DIGITS,
        "width": WIDTH,
        "batch": BATCH,
        "lr": LR,
        "steps": steps,
        "draft_layers": draft_layers,
        "exit_weight": exit_weight,
        "seed": 0,
    }


def early_exit_view(params, cfg, n_layers: int):
    """(params, cfg) of the model cut after its first n_layers blocks (final norm and head kept)."""
    import jax

    blocks = jax.tree.map(lambda x: x[:n_layers], params["blocks"])
    return dict(params, blocks=blocks), dataclasses.replace(cfg, n_layers=n_layers)


def _batches(tok, steps: int, seed: int):
    """steps x (tokens_BxW, mask_BxW: 1 on real tokens, target_BxW: 1 where the next token is scored)."""
    import numpy as np

    from jaxrl.data.long_addition import generate_splits

    records = generate_splits(DIGITS, "+", steps * BATCH, 1, seed)["train"]
    tokens = np.full((len(records), WIDTH), tok.pad_id, np.int32)
    mask, target = np.zeros_like(tokens), np.zeros_like(tokens)
    for i, r in enumerate(records):
        prompt = [tok.bos_id] + tok.encode(r["prompt"])
        seq = prompt + tok.encode(r["answer"]) + [tok.eos_id]
        tokens[i, : len(seq)], mask[i, : len(seq)] = seq, 1
        target[i, len(prompt) - 1 : len(seq) - 1] = 1  # position t predicts token t + 1: the solution and EOS
    for s in range(steps):
        sl = slice(s * BATCH, (s + 1) * BATCH)
        yield tokens[sl], mask[sl], target[sl]


def _loss_fn(cfg, draft_layers: int, exit_weight: float):
    import jax
    import jax.numpy as jnp

    from jaxrl.models.transformer import forward

    def nll(params, model_cfg, tokens_BxW, mask_BxW, target_BxW):
        logp_BxWxV = jax.nn.log_softmax(forward(params, model_cfg, tokens_BxW, mask_BxW), axis=-1)
        next_BxW = jnp.roll(tokens_BxW, -1, axis=1)
        logp_BxW = jnp.take_along_axis(logp_BxWxV, next_BxW[..., None], axis=-1)[..., 0]
        return -jnp.sum(logp_BxW * target_BxW) / jnp.sum(target_BxW)

    def loss(params, tokens_BxW, mask_BxW, target_BxW):
        full = nll(params, cfg, tokens_BxW, mask_BxW, target_BxW)
        exit_ = nll(*early_exit_view(params, cfg, draft_layers), tokens_BxW, mask_BxW, target_BxW)
        return full + exit_weight * exit_, (full, exit_)

    return loss


def train_tail_policy(cfg, tok, steps: int, draft_layers: int, exit_weight: float, log=print):
    """-> (params, [(step, full-model loss, early-exit loss)] every 10 steps)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxrl.models.transformer import init_params

    params = init_params(cfg, jax.random.PRNGKey(0))
    sched = optax.linear_schedule(0.0, LR, 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))
    opt_state = opt.init(params)
    grad_fn = jax.value_and_grad(_loss_fn(cfg, draft_layers, exit_weight), has_aux=True)

    @jax.jit
    def step(params, opt_state, tokens, mask, target):
        (_, (full, exit_)), grads = grad_fn(params, tokens, mask, target)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, full, exit_

    curve, t0 = [], time.perf_counter()
    for i, (tokens, mask, target) in enumerate(_batches(tok, steps, 0)):
        params, opt_state, full, exit_ = step(
            params, opt_state, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(target)
        )
        if (i + 1) % 10 == 0 or i + 1 == steps:
            curve.append((i + 1, float(full), float(exit_)))
            log(
                f"    warm start step {i + 1}/{steps}: loss {float(full):.3f}, early exit {float(exit_):.3f} "
                f"({time.perf_counter() - t0:.0f} s)"
            )
    return params, curve


def tail_policy(root: pathlib.Path, cfg, tok, steps: int, draft_layers: int, exit_weight: float, log=print):
    """The recipe's params (trained now and written under root the first time) -> (params, info)."""
    import jax
    from flax import serialization

    from jaxrl.models.transformer import abstract_params

    rec = recipe(steps, draft_layers, exit_weight)
    key = json.dumps({**rec, "model": dataclasses.asdict(cfg)}, sort_keys=True)
    path = pathlib.Path(root) / f"tail_policy_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (path / "params.msgpack").exists():
        template = abstract_params(cfg)
        params = serialization.from_bytes(template, (path / "params.msgpack").read_bytes())
        return jax.tree.map(jax.numpy.asarray, params), json.loads((path / "info.json").read_text())
    t0 = time.perf_counter()
    params, curve = train_tail_policy(cfg, tok, steps, draft_layers, exit_weight, log)
    info = {"recipe": rec, "loss_curve": curve, "train_seconds": time.perf_counter() - t0}
    path.mkdir(parents=True, exist_ok=True)
    (path / "params.msgpack").write_bytes(serialization.to_bytes(params))
    (path / "info.json").write_text(json.dumps(info))
    return params, info
