"""`jaxrl train|eval|serve|convert|variants|plan|reward-model` — the command line. User mistakes exit with one line on
stderr, code 2; a run that cannot go on (no checkpoint restores, the loss went NaN) with one line, code 1.
Ctrl-C: one line, code 130 (128 + SIGINT, the shell's code for an interrupted command, so
`jaxrl train ... && next` stops there); `jaxrl train` first finishes and saves its step (a second Ctrl-C
skips that). SIGTERM (a scheduler's preemption) saves the same way and exits 0; `jaxrl serve` drains its
requests in flight and exits 0."""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys

from jaxrl.config import ConfigError, load_config
from jaxrl.config.errors import RunError


class UserError(Exception):
    """A mistake in what the user asked for (bad data, bad workdir); printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    """The `jaxrl` command line's parser (tests/test_docs.py checks the documented commands with it)."""
    p = argparse.ArgumentParser(prog="jaxrl", description="JAX-native RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (or resume) a run from a config file")
    t.add_argument("config", help="a config file, e.g. configs/grpo_arithmetic.py")
    t.add_argument(
        "--workdir",
        default=None,
        help="run directory (default: runs/<config stem>/); resumes if it holds checkpoints (same config, "
        "see --allow-config-change)",
    )
    t.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="a.b=value",
        help="override a config field; may be repeated",
    )
    t.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a run whose config differs from its config.json (model.* excepted); the old "
        "config is kept in config_history.jsonl",
    )
    t.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="multi-process run: process 0's address (env JAXRL_COORDINATOR)",
    )
    t.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="multi-process run: how many processes (env JAXRL_NUM_PROCESSES)",
    )
    t.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="I",
        help="multi-process run: this process, 0..N-1 (env JAXRL_PROCESS_ID)",
    )
    t.add_argument(
        "--cluster",
        default=None,
        choices=("auto",),
        help="multi-process run: take the process count, this process and the coordinator from the cluster "
        "environment (SLURM, Cloud TPU VM, Open MPI, Kubernetes) as jax.distributed.initialize() detects it "
        "(env JAXRL_CLUSTER)",
    )
    t.add_argument(
        "--init-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help="give up (nonzero exit) if not all processes joined by then (env JAXRL_INIT_TIMEOUT, default 300)",
    )
    _add_convert_parser(sub)
    _add_eval_parser(sub)
    _add_serve_parser(sub)
    _add_plan_parser(sub)
    _add_reward_model_parser(sub)
    v = sub.add_parser("variants", help="list the loss presets: paper, parts, config file")
    v.add_argument(
        "config", nargs="?", default=None, help="a config file, loaded first: the presets it registers are listed too"
    )
    v.add_argument(
        "--configs",
        default=None,
        help="directory searched for <preset>_arithmetic.py (default: the repository's configs/)",
    )
    return p


def _add_reward_model_parser(sub) -> None:
    """`jaxrl reward-model train CONFIG --workdir W`: a reward model from preference pairs (jaxrl.rewards)."""
    r = sub.add_parser("reward-model", help="train a scalar reward model from preference pairs (Bradley-Terry)")
    rsub = r.add_subparsers(dest="action", required=True)
    t = rsub.add_parser("train", help="train (or resume) a reward model; its workdir is then reward_model.workdir")
    t.add_argument("config", help="a config file: its model.*, data.* and reward_model.* sections")
    t.add_argument("--workdir", required=True, help="where the checkpoints, metrics.jsonl and reward_model.json go")
    t.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="override a config field"
    )


def _reward_model(args) -> int:
    """`jaxrl reward-model train`: train, then say where the model is and its held-out accuracy."""
    cfg = load_config(args.config, args.overrides)
    from jaxrl.rewards.train import train_reward_model

    rows = train_reward_model(cfg, pathlib.Path(args.workdir))
    accuracy = next((r["rm/test_accuracy"] for r in reversed(rows) if "rm/test_accuracy" in r), None)
    said = f"; held-out pair accuracy {accuracy:.4f}" if accuracy is not None else " (already trained)"
    print(
        f"jaxrl: reward model in {args.workdir}{said}; use it with --set reward_model.workdir={args.workdir}",
        file=sys.stderr,
    )
    return 0


def _add_convert_parser(sub) -> None:
    """`jaxrl convert`: HF -> jaxrl (--from-hf/--to) or a checkpoint / run -> HF (--from/--to-hf)."""
    c = sub.add_parser(
        "convert",
        help="convert checkpoints: Hugging Face -> jaxrl (--from-hf/--to) or jaxrl -> Hugging Face (--from/--to-hf)",
    )
    c.add_argument("--from-hf", dest="from_hf", default=None, metavar="DIR", help="a Hugging Face checkpoint directory")
    c.add_argument("--to", default=None, metavar="DIR", help="where the jaxrl checkpoint goes (use as model.hf_path)")
    c.add_argument(
        "--from",
        dest="from_",
        default=None,
        metavar="DIR",
        help="a `convert --from-hf` output, or a run directory (its newest checkpoint)",
    )
    c.add_argument("--to-hf", dest="to_hf", default=None, metavar="DIR", help="where the Hugging Face checkpoint goes")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="--to-hf tensor dtype")
    c.add_argument(
        "--max-shard-mb",
        type=int,
        default=0,
        metavar="MB",
        help="--to-hf: split the safetensors into shards of at most this size (0: one file)",
    )
    c.add_argument(
        "--peft-adapter",
        dest="peft_adapter",
        default=None,
        metavar="DIR",
        help="a LoRA run only: write its adapters here as a PEFT adapter directory; --to-hf then gets the frozen "
        "base they apply to (without this flag --to-hf gets the merged weights)",
    )


def _add_eval_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="greedy accuracy, pass@k and maj@k of a checkpoint (or an HF checkpoint) on the task's test split",
    )
    e.add_argument("config", help="the config the policy was trained with (its task, model, rollout settings)")
    e.add_argument("--workdir", default=None, help="a run directory: its newest checkpoint (or --step)")
    e.add_argument(
        "--checkpoint", default=None, metavar="DIR", help="a checkpoint step directory, or a checkpoints root"
    )
    e.add_argument("--hf", default=None, metavar="DIR", help="a Hugging Face checkpoint directory, before any training")
    e.add_argument("--step", type=int, default=None, metavar="N", help="a saved step of --workdir / --checkpoint")
    e.add_argument("--samples", type=int, default=1, metavar="K", help="sampled completions per prompt (default 1)")
    e.add_argument("--prompts", type=int, default=None, metavar="N", help="the first N test prompts (default: all)")
    e.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: rollout.temperature)"
    )
    e.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    e.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="the JSON report (default: <run>/eval/step_<N>.json for --workdir or a --checkpoint inside a run, "
        "else runs/eval/<config stem>_<hf|checkpoint|initial>[_<dir name>][_step_<N>].json)",
    )
    e.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="override a config field"
    )


def _add_serve_parser(sub) -> None:
    """`jaxrl serve`'s flags; jaxrl/serve/server.py runs it."""
    s = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API (docs/serve.md)")
    s.add_argument("path", metavar="CHECKPOINT_OR_WORKDIR", help="a run directory, a checkpoint, or an HF checkpoint")
    s.add_argument("--config", default=None, help="the config file (default: the run's config.json)")
    s.add_argument("--step", type=int, default=None, metavar="N", help="a saved step of the run (default: newest)")
    s.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="override a config field"
    )
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine)")
    s.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: a free one)")
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every request")
    s.add_argument("--model-name", default=None, help="the model's name in the API (default: PATH as given)")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="default: data.max_prompt_len")
    s.add_argument(
        "--max-tokens", type=int, default=None, help="the max_tokens limit (default: rollout.max_new_tokens)"
    )
    s.add_argument("--max-n", type=int, default=8, help="the most choices per request (default 8)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    s.add_argument("--slots", type=int, default=16, help="sequences decoding at once (default 16)")
    s.add_argument(
        "--chunk", type=int, default=8, help="decode steps between two publications while every slot is busy (8)"
    )
    s.add_argument("--seed", type=int, default=0, help="the engine's key for requests without a seed")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get at shutdown")


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="compile a run's programs on abstract shapes (nothing runs, no weights, no data) and print per-device "
        "FLOPs, bytes, memory, collectives and layout, one JSON line per program",
    )
    pl.add_argument("config", help="a config file, e.g. configs/grpo_arithmetic.py")
    pl.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="plan for N fake CPU devices (sets --xla_force_host_platform_device_count before JAX starts); "
        "default: the devices JAX sees",
    )
    pl.add_argument(
        "--programs",
        default=None,
        metavar="A,B",
        help="which of update, rollout, engine_chunk, eval, teacher (default: the run's update, rollout or engine "
        "chunk, eval, and its distill.teacher's forward)",
    )
    pl.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="override a config field"
    )


REPO_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def distributed_args(args) -> dict | None:
    """--coordinator / --num-processes / --process-id (or JAXRL_* env) -> init_distributed kwargs,
    --cluster auto -> init_distributed_auto kwargs; None for a single-process run.
    Inconsistent values are a UserError naming the flag."""
    env = os.environ

    def pick(flag: str, name: str, value, cast):
        if value is not None:
            return value
        raw = env.get(name)
        if raw in (None, ""):
            return None
        try:
            return cast(raw)
        except ValueError:
            raise UserError(f"{name}={raw!r} ({flag}): expected an integer") from None

    coordinator = pick("--coordinator", "JAXRL_COORDINATOR", args.coordinator, str)
    n = pick("--num-processes", "JAXRL_NUM_PROCESSES", args.num_processes, int)
    pid = pick("--process-id", "JAXRL_PROCESS_ID", args.process_id, int)
    timeout = pick("--init-timeout", "JAXRL_INIT_TIMEOUT", args.init_timeout, int)
    if timeout is not None and timeout < 1:
        raise UserError(f"--init-timeout {timeout}: expected a positive number of seconds")
    cluster = pick("--cluster", "JAXRL_CLUSTER", args.cluster, str)
    if cluster is not None:
        return _cluster_args(cluster, coordinator, n, pid, timeout or 300)
    if coordinator is None and n is None and pid is None:
        return None
    if coordinator is None or n is None or pid is None:
        raise UserError(
            "--coordinator, --num-processes and --process-id go together (or JAXRL_COORDINATOR, "
            f"JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID); got coordinator={coordinator!r}, "
            f"num_processes={n}, process_id={pid}"
        )
    if ":" not in coordinator:
        raise UserError(f"--coordinator {coordinator!r}: expected host:port")
    if n < 1:
        raise UserError(f"--num-processes {n}: expected a positive integer")
    if not 0 <= pid < n:
        raise UserError(f"--process-id {pid}: expected 0..{n - 1} for --num-processes {n}")
    return {"coordinator": coordinator, "num_processes": n, "process_id": pid, "timeout_s": timeout or 300}


def _cluster_args(cluster: str, coordinator, n, pid, timeout: int) -> dict:
    """--cluster auto: jax.distributed.initialize() finds everything; explicit values would fight it."""
    if cluster != "auto":
        raise UserError(f"JAXRL_CLUSTER={cluster!r} (--cluster): expected 'auto'")
    given = [
        f for f, v in (("--coordinator", coordinator), ("--num-processes", n), ("--process-id", pid)) if v is not None
    ]
    if given:
        raise UserError(
            f"--cluster auto takes the process layout from the cluster; drop {', '.join(given)} "
            "(or unset the JAXRL_* variable)"
        )
    from jaxrl.multihost import detect_cluster  # imports jax, touches no device

    found = detect_cluster()
    if found is None:
        raise UserError(
            "--cluster auto: no cluster environment found (SLURM_JOB_ID/SLURM_STEP_NODELIST/SLURM_NTASKS/"
            "SLURM_PROCID/SLURM_LOCALID, a Cloud TPU VM slice, Open MPI or Kubernetes); run under srun, on "
            "every TPU worker, or give --coordinator/--num-processes/--process-id"
        )
    return {"cluster": found, "timeout_s": timeout}


def variants_table(configs_dir: str | pathlib.Path | None = None) -> str:
    """preset | paper | parts | group size | config file, as a Markdown table (one row per preset)."""
    from jaxrl.losses import EXTRAS, PRESETS  # jax import only for this command

    configs_dir = pathlib.Path(configs_dir) if configs_dir is not None else REPO_CONFIGS
    rows = ["| preset | paper | parts | rollout.group_size | config |", "|---|---|---|---|---|"]
    for name, preset in PRESETS.items():
        config = configs_dir / f"{name}_arithmetic.py"
        shown = f"{configs_dir.name}/{config.name}" if config.is_file() else "-"
        try:
            parts = " ; ".join(preset.parts)
        except TypeError:  # a registered factory whose parameters have no defaults
            parts = "(built from its parameters)"
        rows.append(f"| {name} | {preset.paper} | {parts} | {preset.group} | {shown} |")
    rows.append("")
    rows.append('Options every preset takes (loss.options="name=value,..."): ' + ", ".join(EXTRAS))
    return "\n".join(rows)


def _one_line(e: BaseException) -> str:
    """The message on one line (an exception quoted inside it may span several)."""
    return " ".join(str(e).split())


def _eval(args) -> int:
    """`jaxrl eval`: score the located policy, print the table, write the report."""
    from jaxrl.eval import run as evaluation

    request = evaluation.EvalRequest(
        args.config, args.samples, args.prompts, args.temperature, args.seed, args.out, tuple(args.overrides)
    )
    evaluation.check_request(request)
    located = evaluation.locate(args.workdir, args.checkpoint, args.hf, args.step)
    cfg = load_config(args.config, args.overrides)
    report, path = evaluation.run_eval(cfg, request, located)
    print(evaluation.format_table(report))
    print(f"jaxrl: wrote {path}", file=sys.stderr)
    return 0


def _convert(args) -> int:
    """`jaxrl convert`: check the direction, convert, and say what was written where."""
    from jaxrl.policy import convert

    if (
        bool(args.from_hf) == bool(args.from_)
        or bool(args.from_hf) != bool(args.to)
        or bool(args.from_) != bool(args.to_hf)
    ):
        raise UserError("convert: give either --from-hf DIR --to DIR, or --from DIR --to-hf DIR")
    if args.peft_adapter and args.from_hf:
        raise UserError("convert: --peft-adapter goes with --from RUN --to-hf DIR (a LoRA run's export)")
    if args.from_hf:
        model = convert.convert_from_hf(args.from_hf, args.to)
        print(
            f"jaxrl: converted {args.from_hf} ({convert.describe(model)}) to {args.to}; "
            f"train from it with --set model.hf_path={args.to}",
            file=sys.stderr,
        )
    else:
        model = convert.convert_to_hf(
            args.from_, args.to_hf, args.dtype, args.max_shard_mb * 2**20, peft_dir=args.peft_adapter
        )
        if not args.peft_adapter:
            print(
                f"jaxrl: wrote {args.from_} ({convert.describe(model)}) to {args.to_hf} as a Hugging "
                f"Face checkpoint ({args.dtype}); load it with AutoModelForCausalLM.from_pretrained",
                file=sys.stderr,
            )
        else:
            print(
                f"jaxrl: wrote the frozen base to {args.to_hf} and the PEFT adapter to {args.peft_adapter} "
                "(PeftModel.from_pretrained(base, adapter))",
                file=sys.stderr,
            )
    return 0


def _train_or_lose_a_peer(train, cfg, workdir: pathlib.Path, allow_config_change: bool) -> None:
    """`train`; in a multi-process run a collective that fails because another process is gone (killed,
    crashed) ends this one at once with one error line and exit code 1, instead of the runtime's
    traceback and, at exit, JAX's shutdown barrier waiting for the lost process until it aborts."""
    import jax

    try:
        train(cfg, workdir, allow_config_change=allow_config_change)
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        line = (
            f"process {jax.process_index()} of {jax.process_count()}: the run lost another process "
            f"({_one_line(e)[:300]}); restart every process with the same command: the run resumes from its "
            f"last checkpoint in {workdir}"
        )
        print(f"jaxrl: error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # skips JAX's exit-time shutdown, which would wait for the lost process


def _fake_devices(n: int) -> None:
    """Make JAX (not yet imported) start with n CPU devices; checked once JAX has started (`_plan`)."""
    if n < 1:
        raise UserError(f"--devices {n}: expected a positive number of devices")
    if "jax" in sys.modules:
        return  # too late to choose; _plan refuses a device count that does not match
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def _plan(args) -> int:
    """`jaxrl plan`: one JSON line per program on stdout, a summary line each on stderr."""
    import json

    if args.devices is not None:
        _fake_devices(args.devices)
    cfg = load_config(args.config, args.overrides)
    import jax

    from jaxrl.train.plan import parse_programs, plan, summary_line

    if args.devices is not None and jax.device_count() != args.devices:
        raise UserError(
            f"--devices {args.devices}: JAX had already started in this process with {jax.device_count()} "
            "device(s); run `jaxrl plan` in a fresh process"
        )
    programs = parse_programs(args.programs) if args.programs is not None else None
    for record in plan(cfg, programs):
        print(json.dumps(record), flush=True)
        print(summary_line(record), file=sys.stderr, flush=True)
    return 0


def _serve(args) -> int:
    from jaxrl.serve.server import serve_command  # FastAPI and uvicorn only for this command

    return serve_command(args)


COMMANDS = {"eval": _eval, "serve": _serve, "convert": _convert, "plan": _plan, "reward-model": _reward_model}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = load_config(args.config, args.overrides)
            workdir = pathlib.Path(args.workdir or pathlib.Path("runs") / pathlib.Path(args.config).stem)
            dist = distributed_args(args)
            if dist is not None:  # before anything touches devices
                from jaxrl.multihost import init_distributed, init_distributed_auto

                if "cluster" in dist:
                    init_distributed_auto(**dist)
                else:
                    init_distributed(**dist)
            from jaxrl.train.loop import train  # heavy imports only once the config is known good

            _train_or_lose_a_peer(train, cfg, workdir, args.allow_config_change)
            return 0
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        if args.command == "variants":
            if args.config is not None:
                load_config(args.config)  # runs the file: its register_preset calls
            print(variants_table(args.configs))
            return 0
    except (ConfigError, UserError) as e:
        print(f"jaxrl: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RunError as e:  # no checkpoint restores, the loss went NaN: nothing the user typed was wrong
        print(f"jaxrl: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # train's Interrupted says what it saved; a bare one (a second Ctrl-C,
        # or one outside the step loop) saved nothing since the last checkpoint
        lost = "; the steps after its last checkpoint are not saved" if args.command == "train" else ""
        print(f"jaxrl: {_one_line(e) or 'interrupted' + lost}", file=sys.stderr)
        # What is left is the interpreter's exit (JAX's atexit clean-up): one more Ctrl-C there would only
        # print a traceback after the line above.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
