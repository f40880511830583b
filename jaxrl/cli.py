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
    v = sub.add_parser("variants", help="list the loss presets: paper, parts, config file")
    v.add_argument("--configs", default=None, help="directory searched for <preset>_arithmetic.py "
                   "(default: the repository's configs/)")
    return p


REPO_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def variants_table(configs_dir: str | pathlib.Path | None = None) -> str:
    """preset | paper | parts | group size | config file, as a Markdown table (one row per preset)."""
    from jaxrl.losses import EXTRAS, PRESETS  # jax import only for this command

    configs_dir = pathlib.Path(configs_dir) if configs_dir is not None else REPO_CONFIGS
    rows = ["| preset | paper | parts | rollout.group_size | config |", "|---|---|---|---|---|"]
    for name, preset in PRESETS.items():
        config = configs_dir / f"{name}_arithmetic.py"
        shown = f"{configs_dir.name}/{config.name}" if config.is_file() else "-"
        rows.append(f"| {name} | {preset.paper} | {' ; '.join(preset.parts)} | {preset.group} | {shown} |")
    rows.append("")
    rows.append("Options every preset takes (loss.options=\"name=value,...\"): " + ", ".join(EXTRAS))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = load_config(args.config, args.overrides)
            workdir = pathlib.Path(args.workdir or pathlib.Path("runs") / pathlib.Path(args.config).stem)
            from jaxrl.train.loop import train  # heavy imports only once the config is known good

            train(cfg, workdir)
            return 0
        if args.command == "variants":
            print(variants_table(args.configs))
            return 0
    except (ConfigError, UserError) as e:
        print(f"jaxrl: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
