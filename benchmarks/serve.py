"""`jaxrl serve` end to end: a real server process on bench-small, driven by concurrent streaming
`openai.AsyncOpenAI` clients, against the same requests through the in-process `ServingEngine`.

The script writes its own checkpoint (bench-small, random init, a Hugging Face directory with a
word-level tokenizer of one token per id: nothing downloaded) and starts `jaxrl serve` on it on a free
127.0.0.1 port. The in-process engine is built by the server's own `build` (jaxrl/serve/server.py)
from the same flags, so both sides hold the same params, slots, chunk and seed.

Phase 1, overhead: --clients concurrent clients, each sending its --requests-per-client requests one
after another (a prompt of --prompt-len random token ids, --new-tokens tokens, temperature 1 with a
seed of its own, so both sides draw exactly the same tokens; the script checks it). Every request
streams. The in-process side runs the same clients as asyncio tasks reading `Handle.aevents()` (what
the server's stream reads). --repeats rounds, server and in-process interleaved, after one untimed
warm-up round of each (compiles). Tokens/s = tokens / wall time of the round; time to first token =
from sending a request to its first token; inter-token latency = the gaps between a request's
consecutive tokens (a chunk of tokens arrives at once, so the median gap is near 0 and the p99 is about
one chunk's decode time). `serve_overhead` = in-process tokens/s / server tokens/s (median rounds).

Phase 2, stress: --stress-clients requests at once (random prompt lengths, half greedy, half seeded
temperature 1, --stress-tokens tokens each); a random --disconnect-fraction of the clients close their
stream after a few tokens. Every request must end completed (its tokens equal to the in-process output
of the same request: greedy and seeded requests draw the same tokens whatever else decodes alongside)
or cancelled by its own client; `lost_requests` counts the others (an error, a wrong output, a stream
ending early, no end within --stress-timeout). --stress-rounds rounds; the server's resident memory
(/proc/PID/status VmRSS) is sampled before the first and after every round, and /stats must show every
slot free and nothing queued or active at the end.

Last line: one JSON object (see `main`).

    PYTHONPATH=. python benchmarks/serve.py --small     # tiny model and shapes (the test)
    PYTHONPATH=. python benchmarks/serve.py             # bench-small, 16 clients (README), CPU: minutes
    PYTHONPATH=. python benchmarks/serve.py --profile /tmp/serve.prof   # the server under cProfile

cProfile sees the server's main thread only: the event loop (HTTP, JSON, detokenization), not the
engine's decode thread. Read it with `pstats.Stats(PATH).sort_stats("tottime").print_stats(30)`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import bench_small, emit, load_average, tiny  # noqa: E402
from jaxrl.config import ModelConfig  # noqa: E402

MODEL = "bench"
PAD, BOS, EOS = 0, 1, 2


# ---- the checkpoint ---------------------------------------------------------------------------------


def write_checkpoint(directory: pathlib.Path, cfg: ModelConfig) -> None:
    """A random-init Hugging Face checkpoint of `cfg` in `directory`, with a word-level tokenizer whose
    token i (3..V-1) decodes to " t{i}" (0, 1, 2: pad, BOS, EOS), so every id the model draws has text."""
    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxrl.models import hf
    from jaxrl.models.transformer import init_params

    directory.mkdir(parents=True, exist_ok=True)
    specials = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    vocab = {**specials, **{f"t{i}": i for i in range(3, cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    tok.add_special_tokens(list(specials))
    tok.save(str(directory / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": "</s>"}))
    params = init_params(cfg, jax.random.PRNGKey(0))
    hf.save(directory, params, cfg, dtype="float32", eos_token_id=EOS, pad_token_id=PAD, bos_token_id=BOS)


def serve_flags(args, checkpoint: pathlib.Path) -> list[str]:
    """`jaxrl serve` arguments (after `serve`): the same for the server process and the in-process engine."""
    flags = [str(checkpoint), "--model-name", MODEL, "--port", "0", "--max-n", "1"]
    flags += ["--slots", str(args.slots), "--chunk", str(args.chunk), "--seed", str(args.seed)]
    flags += [
        "--max-prompt-tokens",
        str(args.prompt_len),
        "--max-tokens",
        str(max(args.new_tokens, args.stress_tokens)),
    ]
    flags += ["--set", "model.dtype=float32", "--set", f"model.max_seq_len={args.prompt_len + args.new_tokens + 64}"]
    return flags


# ---- the workloads ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int
    leave_after: int | None = None  # stress: the client closes its stream after this many tokens


@dataclasses.dataclass
class Trace:
    """What one client saw of one request."""

    sent: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)  # perf_counter of each token's arrival
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    left: bool = False  # the client closed the stream itself


def overhead_jobs(args, vocab: int) -> list[list[Job]]:
    """Per client, its requests (seeded temperature 1: both sides draw the same tokens)."""
    rng = np.random.default_rng(args.seed)
    out = []
    for c in range(args.clients):
        jobs = []
        for r in range(args.requests_per_client):
            prompt = tuple(int(t) for t in rng.integers(3, vocab, args.prompt_len))
            jobs.append(Job(prompt, args.new_tokens, 1.0, 1000 * c + r))
        out.append(jobs)
    return out


def stress_jobs(args, vocab: int) -> list[Job]:
    """The stress requests, one per client: half greedy, half seeded; a random --disconnect-fraction
    leave after 1..stress_tokens/2 tokens."""
    rng = np.random.default_rng(args.seed + 1)
    jobs = []
    for c in range(args.stress_clients):
        prompt = tuple(int(t) for t in rng.integers(3, vocab, int(rng.integers(1, args.prompt_len + 1))))
        leaves = rng.random() < args.disconnect_fraction
        leave = int(rng.integers(1, max(2, args.stress_tokens // 2))) if leaves else None
        jobs.append(Job(prompt, args.stress_tokens, 0.0 if c % 2 == 0 else 1.0, 50_000 + c, leave))
    return jobs


# ---- the two sides ----------------------------------------------------------------------------------


async def _server_request(client, job: Job, trace: Trace) -> None:
    trace.sent = time.perf_counter()
    stream = await client.completions.create(
        model=MODEL,
        prompt=list(job.prompt),
        max_tokens=job.max_tokens,
        temperature=job.temperature,
        seed=job.seed,
        stream=True,
    )
    try:
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                new = (choice.model_extra or {}).get("token_ids") or []
                trace.tokens += new
                trace.times += [now] * len(new)
                if choice.finish_reason is not None:
                    trace.finish = choice.finish_reason
            if job.leave_after is not None and len(trace.tokens) >= job.leave_after and trace.finish is None:
                trace.left = True
                return
    finally:
        await stream.close()


async def _engine_request(engine, job: Job, trace: Trace) -> None:
    from jaxrl.serve.requests import Done, Request, Token

    trace.sent = time.perf_counter()
    request = Request(job.prompt, job.max_tokens, temperature=job.temperature, seed=job.seed)
    async for event in engine.submit(request).aevents():
        if isinstance(event, Token):
            trace.tokens.append(event.token)
            trace.times.append(time.perf_counter())
        elif isinstance(event, Done):
            trace.finish = event.reason


async def _guarded(coro, trace: Trace, timeout: float) -> None:
    try:
        await asyncio.wait_for(coro, timeout)
    except Exception as e:  # noqa: BLE001  (counted: a request that errs or hangs is lost)
        trace.error = f"{type(e).__name__}: {e}"


async def run_clients(one, per_client: list[list[Job]], timeout: float) -> tuple[float, list[list[Trace]]]:
    """Each client runs its jobs one after another via `one(job, trace)`; all clients at once.
    -> (wall seconds, traces per client)."""
    traces = [[Trace() for _ in jobs] for jobs in per_client]

    async def client(c: int) -> None:
        for job, trace in zip(per_client[c], traces[c]):
            await _guarded(one(job, trace), trace, timeout)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(len(per_client))))
    return time.perf_counter() - start, traces


def latency(traces: list[Trace], wall: float) -> dict:
    """tokens/s, time to first token and inter-token gaps (p50, p99, seconds) of one round."""
    done = [t for t in traces if t.times]
    ttft = [t.times[0] - t.sent for t in done]
    gaps = [b - a for t in done for a, b in zip(t.times, t.times[1:])]
    tokens = sum(len(t.tokens) for t in traces)

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else None

    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "errors": sum(t.error is not None for t in traces),
    }


# ---- the server process -----------------------------------------------------------------------------


def start_server(flags: list[str], profile: str | None) -> tuple[subprocess.Popen, str]:
    """`jaxrl serve FLAGS` (under cProfile when `profile` is a path) -> (process, base URL .../v1)."""
    head = [sys.executable] + (["-m", "cProfile", "-o", profile] if profile else []) + ["-m", "jaxrl.cli", "serve"]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    server = subprocess.Popen([*head, *flags], env=env, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()  # blocks until the server prints its URL (or exits)
    found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
    if found is None:
        server.kill()
        raise RuntimeError(f"jaxrl serve printed no URL (exit {server.wait()}): {line!r}")
    return server, found.group(1)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; all its threads)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` (Linux /proc)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


async def server_stats(url: str, settle_s: float = 30.0) -> dict:
    """/stats once nothing is queued or active (or after `settle_s`)."""
    import httpx2 as httpx  # the HTTP client the openai package uses

    deadline = time.monotonic() + settle_s
    async with httpx.AsyncClient() as http:
        while True:
            stats = (await http.get(url.removesuffix("/v1") + "/stats")).json()
            if (stats["active"] == 0 and stats["queued"] == 0) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.05)


# ---- the phases -------------------------------------------------------------------------------------


async def overhead_phase(args, client, engine, server: subprocess.Popen, per_client: list[list[Job]]) -> dict:
    """Interleaved rounds of the server and the in-process engine on the same jobs."""
    timeout = args.stress_timeout

    def server_round():
        return run_clients(lambda job, trace: _server_request(client, job, trace), per_client, timeout)

    def engine_round():
        return run_clients(lambda job, trace: _engine_request(engine, job, trace), per_client, timeout)

    await server_round()  # warm-up: both sides compile
    await engine_round()
    rounds: dict[str, list[dict]] = {"server": [], "in_process": []}
    same = True
    for _ in range(args.repeats):
        for side, run in (("server", server_round), ("in_process", engine_round)):
            c0, s0 = time.process_time(), cpu_s(server.pid)
            wall, traces = await run()
            flat = [t for ts in traces for t in ts]
            cpu = {"client_cpu_s": time.process_time() - c0, "server_cpu_s": cpu_s(server.pid) - s0}
            rounds[side].append({**latency(flat, wall), **cpu})
            r = rounds[side][-1]
            print(
                f"{side:>10}: {r['tokens_per_s']:7.1f} tok/s, ttft p50 {r['ttft_p50_s']:.3f} s "
                f"p99 {r['ttft_p99_s']:.3f} s, itl p99 {r['itl_p99_s']:.3f} s",
                flush=True,
            )
            if side == "server":
                server_tokens = [t.tokens for t in flat]
            else:
                same = same and server_tokens == [t.tokens for t in flat]
    med = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in rounds.items()}
    # CPU seconds per token: the server process (+ the clients), against this process serving in-process
    cpu = {
        "server": statistics.median((r["server_cpu_s"] + r["client_cpu_s"]) / r["tokens"] for r in rounds["server"]),
        "in_process": statistics.median(r["client_cpu_s"] / r["tokens"] for r in rounds["in_process"]),
    }
    return {
        "server_tokens_per_s": med["server"],
        "in_process_tokens_per_s": med["in_process"],
        "serve_overhead": med["in_process"] / med["server"],
        "overhead_per_round": [
            i["tokens_per_s"] / s["tokens_per_s"] for s, i in zip(rounds["server"], rounds["in_process"])
        ],
        "cpu_s_per_token": cpu,
        "cpu_overhead": cpu["server"] / cpu["in_process"],
        "same_tokens": same,
        "rounds": rounds,
    }


async def stress_phase(args, client, engine, server: subprocess.Popen, url: str) -> dict:
    jobs = stress_jobs(args, engine.spec.cfg.vocab_size)
    _, ref = await run_clients(lambda job, trace: _engine_request(engine, job, trace), [[j] for j in jobs], 600)
    expected = [r[0].tokens for r in ref]
    rss = [rss_mib(server.pid)]
    rounds, cancelled0 = [], (await server_stats(url))["cancelled"]
    for _ in range(args.stress_rounds):
        wall, traces = await run_clients(
            lambda job, trace: _server_request(client, job, trace), [[j] for j in jobs], args.stress_timeout
        )
        flat = [t[0] for t in traces]
        completed = [i for i, t in enumerate(flat) if not t.left and t.error is None and t.finish is not None]
        correct = sum(flat[i].tokens == expected[i] for i in completed)
        left = sum(t.left and t.error is None for t in flat)
        lost = len(flat) - left - correct
        stats = await server_stats(url)
        rss.append(rss_mib(server.pid))
        server_cancelled, cancelled0 = stats["cancelled"] - cancelled0, stats["cancelled"]
        print(
            f"    stress: {len(completed)} completed ({correct} correct), {left} left "
            f"({server_cancelled} cancelled in the server), {lost} lost, {wall:.1f} s, server RSS {rss[-1]:.0f} MiB",
            flush=True,
        )
        rounds.append(
            {
                "seconds": wall,
                "completed": len(completed),
                "correct": correct,
                "cancelled_by_client": left,
                "server_cancelled": server_cancelled,  # left while decoding (the others had finished)
                "lost_requests": lost,
                "errors": [t.error for t in flat if t.error][:3],
                "stats": stats,
            }
        )
    last = rounds[-1]["stats"]
    return {
        "stress_clients": args.stress_clients,
        "lost_requests": sum(r["lost_requests"] for r in rounds),
        "server_rss_mib": rss,
        "all_slots_free": last["free_slots"] == args.slots and last["active"] == 0 and last["queued"] == 0,
        "stress_rounds": rounds,
    }


async def drive(args, url: str, engine, server: subprocess.Popen) -> dict:
    import openai

    vocab = engine.spec.cfg.vocab_size
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=args.stress_timeout)
    try:
        out = await overhead_phase(args, client, engine, server, overhead_jobs(args, vocab))
        out["stress"] = await stress_phase(args, client, engine, server, url)
    finally:
        await client.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model and shapes (seconds)")
    ap.add_argument("--model", choices=("bench-small", "tiny"), default="bench-small", help="--small: tiny")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds of each side (interleaved)")
    ap.add_argument("--stress-clients", type=int, default=256)
    ap.add_argument("--stress-tokens", type=int, default=32)
    ap.add_argument("--stress-rounds", type=int, default=2)
    ap.add_argument("--disconnect-fraction", type=float, default=0.25)
    ap.add_argument("--stress-timeout", type=float, default=300.0, help="seconds one request may take")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temporary directory)")
    ap.add_argument("--profile", default=None, metavar="PATH", help="profile the server's event loop to PATH")
    args = ap.parse_args(argv)
    if args.small:
        args.model = "tiny"
        args.clients, args.requests_per_client, args.prompt_len, args.new_tokens = 4, 2, 8, 12
        args.slots, args.chunk, args.repeats = 4, 4, 1
        args.stress_clients, args.stress_tokens, args.stress_rounds = 24, 16, 1
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = pathlib.Path(args.workdir or tmp) / "bench_checkpoint"
        write_checkpoint(checkpoint, tiny() if args.model == "tiny" else bench_small())
        flags = serve_flags(args, checkpoint)
        from jaxrl.cli import build_parser
        from jaxrl.serve.server import build

        _, engine, _ = build(build_parser().parse_args(["serve", *flags]))
        engine.start()
        server, url = start_server(flags, args.profile)
        try:
            load_before = load_average()
            out = asyncio.run(drive(args, url, engine, server))
        finally:
            engine.stop()
            server.terminate()
            server.wait(timeout=120)
    out.update(
        config=args.model,
        load_average_before=load_before,
        load_average_after=load_average(),
        args=vars(args),
    )
    print(
        f"server {out['server_tokens_per_s']:.0f} tok/s, in-process {out['in_process_tokens_per_s']:.0f} tok/s, "
        f"overhead {out['serve_overhead']:.3f}; stress lost {out['stress']['lost_requests']}, "
        f"server RSS {out['stress']['server_rss_mib']} MiB"
    )
    emit(out)
    return out


if __name__ == "__main__":
    main()
