"""PyTorch peer of benchmarks/update.py: a plain forward + backward of the same model on the same tokens.

The issue's comparison: torch (CPU) running bench-small (benchmarks/common.py, Qwen2-shaped, float32,
random init, nothing downloaded) through transformers' `Qwen2ForCausalLM`; loss = minus the mean
next-token log-prob over all positions of 64 sequences of 192 tokens, then `loss.backward()`. No
optimizer, no reference model, no advantages: a lower bound on what a PyTorch GRPO step costs.
(Qwen2's q/k/v projections always carry a bias; jaxrl's bench-small has none: 2 x 8 x (512 + 2 x 128)
extra parameters, nothing at this size.)

    PYTHONPATH=. python benchmarks/peers/torch_update.py            # 64 x 192 tokens
    PYTHONPATH=. python benchmarks/peers/torch_update.py --small    # tiny model, seconds (tests)

Timing: one untimed warm-up call, then the median of `--repeats` calls (wall and process CPU seconds).
`tokens_per_s` counts every token of the batch (batch x seq), as update.py's trained tokens do.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common


def qwen2_config(cfg):
    """The transformers Qwen2Config of a jaxrl ModelConfig (same widths, heads, vocab, RoPE, eps)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        use_cache=False,
        torch_dtype="float32",
    )


def next_token_loss(model, tokens_BxS):
    """Minus the mean log-prob of token s+1 given tokens 0..s, over all B x (S-1) positions."""
    import torch

    logits_BxSxV = model(input_ids=tokens_BxS).logits
    logp_BxSxV = torch.log_softmax(logits_BxSxV[:, :-1].float(), dim=-1)
    chosen_BxS = torch.gather(logp_BxSxV, -1, tokens_BxS[:, 1:, None])[..., 0]
    return -chosen_BxS.mean()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--small", action="store_true", help="tiny model and shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import Qwen2ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.small:
        cfg = common.tiny()
        args.batch, args.seq, args.repeats = 8, 24, min(args.repeats, 2)
    else:
        cfg = common.bench_small()
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(qwen2_config(cfg)).float().train()
    n_params = sum(p.numel() for p in model.parameters())
    tokens_BxS = torch.randint(
        0, cfg.vocab_size, (args.batch, args.seq), dtype=torch.long, generator=torch.Generator().manual_seed(args.seed)
    )

    def step():
        model.zero_grad(set_to_none=True)
        loss = next_token_loss(model, tokens_BxS)
        loss.backward()
        return float(loss.detach())

    loss0 = step()  # warm-up
    times, cpu = [], []
    for _ in range(args.repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    seconds, cpu_seconds = statistics.median(times), statistics.median(cpu)
    tokens = args.batch * args.seq
    result = {
        "benchmark": "torch_update",
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "times": times,
        "cpu_seconds": cpu_seconds,
        "cores_used": cpu_seconds / seconds,
        "tokens_per_cpu_s_x_cores": tokens / cpu_seconds * (os.cpu_count() or 1),
        "torch_threads": torch.get_num_threads(),
        "trained_tokens": tokens,
        "loss": loss0,
        "params": n_params,
        "shape": {"batch": args.batch, "seq": args.seq},
        "config": "tiny" if args.small else "bench-small",
        "peak_rss_mib": common.peak_rss_mib(),
        "load_average": common.load_average(),
        "torch": torch.__version__,
    }
    print(
        f"torch_update [{result['config']}] {args.batch} sequences x {args.seq} tokens, forward + backward, "
        f"{n_params / 1e6:.1f}M params, {result['torch_threads']} torch threads"
    )
    print(f"  time            {seconds:.3f} s (median of {args.repeats}: {', '.join(f'{t:.3f}' for t in times)})")
    print(
        f"  cpu             {cpu_seconds:.3f} CPU-s per call ({result['cores_used']:.2f} cores busy); "
        f"{result['tokens_per_cpu_s_x_cores']:.0f} tokens per CPU-s x {os.cpu_count()} cores"
    )
    print(
        f"  throughput      {result['tokens_per_s']:.0f} tokens/s (loss {loss0:.3f}; ln V = "
        f"{__import__('math').log(cfg.vocab_size):.3f})"
    )
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    main()
