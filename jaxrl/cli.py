"""`jaxrl train|variants` — the command line. User mistakes exit with one line on stderr, code 2."""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxrl.config import ConfigError, load_config


class UserError(Exception):
    """A mistake in what the user asked for (bad data, bad workdir); printed as one line."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxrl", description="JAX-native RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (or resume) a run from a config file")
    t.add_argument("config", help="a config file, e.g. configs/grpo_arithmetic.py")
    t.add_argument("--workdir", default=None, help="run directory (default: runs/<config stem>/); resumes if it holds checkpoints")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a config field; may be repeated")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = load_config(args.config, args.overrides)
            workdir = pathlib.Path(args.workdir or pathlib.Path("runs") / pathlib.Path(args.config).stem)
            from jaxrl.train.loop import train  # heavy imports only once the config is known good

            train(cfg, workdir)
            return 0
    except (ConfigError, UserError) as e:
        print(f"jaxrl: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
