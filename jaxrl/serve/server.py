"""`jaxrl serve PATH`: a checkpoint behind the OpenAI-compatible API (app.py) on a `ServingEngine`.

PATH is a run directory (its newest checkpoint, or --step N), one checkpoint step directory, a
checkpoints root, or a Hugging Face checkpoint directory; the policy is loaded as `jaxrl eval` loads
it (jaxrl/eval/sources.py). The config is the run's own config.json (next to the checkpoint), else
--config FILE (an HF directory without --config: the default config with model.hf_path=PATH); --set
overrides either. The limits default to what the policy was trained with: prompts of
data.max_prompt_len tokens (BOS included), completions of rollout.max_new_tokens.

The server listens on --host (127.0.0.1 unless asked) and --port (0: a free port) and prints
`jaxrl: serving MODEL at http://HOST:PORT/v1` on stdout once it accepts connections. SIGTERM or Ctrl-C:
it stops accepting connections, lets the requests in flight finish (at most --drain-timeout seconds,
then they are cancelled), stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import signal
import sys

from jaxrl.config import Config, ConfigError, load_config
from jaxrl.eval.sources import Located, locate, saved_steps


def locate_path(path: str, step: int | None) -> Located:
    """What PATH holds: a run, a checkpoint (step directory or root) or an HF checkpoint."""
    directory = pathlib.Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"serve: {path}: directory not found")
    if (directory / "checkpoints").is_dir():
        return locate(path, None, None, step)
    if (directory / "state").is_dir() or saved_steps(directory):
        return locate(None, path, None, step)
    if (directory / "config.json").is_file() or (directory / "model_config.json").is_file():
        if step is not None:
            raise ConfigError(f"serve: --step {step}: {path} is a Hugging Face checkpoint, it has no steps")
        return locate(None, None, path, None)
    raise ConfigError(
        f"serve: {path} is neither a run directory (checkpoints/), a checkpoint (state/ or numbered step "
        "folders) nor a Hugging Face checkpoint (config.json)"
    )


def serve_config(located: Located, config: str | None, overrides: list[str]) -> Config:
    """The config the policy is read with (see the module docstring)."""
    from jaxrl.config.load import apply_overrides
    from jaxrl.eval.sources import run_model

    if config is not None:
        return run_model(load_config(config, overrides), located, overrides)
    if located.run_dir is not None:
        from jaxrl.policy.lora_run import run_config

        return apply_overrides(run_config(located.run_dir), overrides).validate()
    if located.kind == "hf":
        cfg = dataclasses.replace(Config(), model=dataclasses.replace(Config().model, hf_path=str(located.path)))
        return apply_overrides(cfg, overrides).validate()
    raise ConfigError(
        f"serve: {located.step_dir} has no config.json of its run next to it (expected in {located.path}/../..); "
        "give the config it was trained with: --config FILE"
    )


def build(args: argparse.Namespace):
    """-> (app, engine, model name) for the parsed `jaxrl serve` flags."""
    import jax
    import jax.numpy as jnp

    from jaxrl.eval.sources import load_policy
    from jaxrl.models.transformer import rollout_params
    from jaxrl.serve.app import create_app
    from jaxrl.serve.engine import ServingEngine
    from jaxrl.serve.schema import Limits
    from jaxrl.serve.service import EngineService, chat_template_of
    from jaxrl.sharding import make_mesh

    located = locate_path(args.path, args.step)
    cfg = serve_config(located, args.config, args.overrides)
    try:
        limits = Limits(
            max_prompt_tokens=args.max_prompt_tokens or cfg.data.max_prompt_len,
            max_tokens=args.max_tokens or cfg.rollout.max_new_tokens,
            max_n=args.max_n,
            max_body_bytes=args.max_body_bytes,
            api_key=args.api_key,
        )
    except ValueError as e:
        raise ConfigError(f"serve: {e}") from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"serve: --port {args.port}: expected 0..65535 (0: a free port)")
    if args.max_n > args.slots:
        raise ConfigError(
            f"serve: --max-n {args.max_n} is more than --slots {args.slots} (a request's choices decode at once)"
        )
    mesh, preset = make_mesh(cfg.mesh)
    policy = load_policy(cfg, located, mesh, preset, None, progress=False)
    params = policy.params
    if jnp.dtype(policy.model_cfg.dtype) != jnp.float32:  # every forward is a rollout's: cast once, as eval does
        params = jax.jit(rollout_params, static_argnames="cfg")(params, policy.model_cfg)
    engine = ServingEngine(
        params,
        policy.model_cfg,
        eos_id=policy.tokenizer.eos_id,
        pad_id=policy.tokenizer.pad_id,
        slots=args.slots,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_new_tokens=limits.max_tokens,
        max_n=limits.max_n,
        chunk=args.chunk,
        rng=jax.random.PRNGKey(args.seed),
        version=located.step or 0,
    )
    name = args.model_name or args.path
    service = EngineService(engine, policy.tokenizer, name, chat_template_of(policy.tokenizer))
    print(f"jaxrl: loaded {policy.origin} ({name})", file=sys.stderr, flush=True)
    return create_app(service, limits), engine, name


# Seconds an idle keep-alive connection stays open: longer than clients keep one idle in their pools
# (httpx, so the openai client: 5 s; load balancers: 60 s), so that a client never sends a request on a
# connection the server is closing at that moment (uvicorn's default is 5 s as well: at 256 clients
# such a request was lost now and then, benchmarks/serve.py).
KEEP_ALIVE_S = 65


def uvicorn_config(app, host: str, port: int, drain_timeout: float):
    """uvicorn's settings for `jaxrl serve`."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(drain_timeout),
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def run_server(app, host: str, port: int, drain_timeout: float, on_ready) -> None:
    """uvicorn on host:port until SIGTERM / SIGINT; `on_ready(host, port)` once it accepts connections.
    uvicorn drains the connections in flight, then re-raises the signal it caught: it lands on a handler
    that ignores it, so the process ends normally (exit 0) after the caller's clean-up."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                on_ready(bound[0], bound[1])

    server = Server(uvicorn_config(app, host, port, drain_timeout))
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit:  # uvicorn's answer to an address it cannot bind (after logging the OS error)
        if server.started:
            raise
    finally:  # a Ctrl-C from here on (while the engine drains) interrupts as usual
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise ConfigError(
            f"serve: --host {host} --port {port}: cannot listen there (the port is in use, or the address is "
            "not this machine's)"
        )


def serve_command(args: argparse.Namespace) -> int:
    """`jaxrl serve`: load, listen, drain at SIGTERM, exit 0."""
    app, engine, name = build(args)
    engine.start()

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"jaxrl: serving {name} at http://{shown}:{port}/v1", flush=True)

    try:
        run_server(app, args.host, args.port, args.drain_timeout, ready)
    finally:
        drained = engine.drain(timeout=args.drain_timeout)
        engine.stop()
    stats = engine.stats()
    print(
        f"jaxrl: stopped ({'drained' if drained else 'drain timed out'}; "
        + ", ".join(f"{k} {v}" for k, v in stats.items())
        + ")",
        file=sys.stderr,
        flush=True,
    )
    return 0
