#!/usr/bin/env bash
# Reproduce the loss-variant study: every preset's configs/<preset>_arithmetic.py trained with several seeds.
PROG=reproduce_variants.sh
USAGE="usage: scripts/$PROG [options] [-- benchmarks/variants.py args...]

Lists the presets (\`jaxrl variants\`), then runs benchmarks/variants.py: one \`jaxrl train
configs/<preset>_arithmetic.py\` per preset and seed (train.seed = the seed), plus the MC-GRPO G=2 arms,
each in its own checkpointed workdir under --root, so an interrupted study resumes where it stopped.
Writes OUT.md (tables), OUT.json (every run) and OUT.png (accuracy by step). The defaults are the
study in benchmarks/README.md (21 presets x 3 seeds x 60 steps, ~1 h on 2 CPU cores).

options:
  --seeds N         seeds per preset (default 3)
  --steps N         RL steps per run (default 60)
  --presets LIST    comma-separated preset names (default: all)
  --root DIR        where the run workdirs live (default: variants.py's, ~/.cache/jaxrl/bench_variants)
  --out PATH        output path without suffix (default: variants.py's, benchmarks/results/variants)
  --no-mc-study     skip the MC-GRPO G=2 arms
  --set FIELD=VAL   a config override for every run (repeatable)
  --python PY       the interpreter (default: .venv/bin/python of the repository, else python3)
  --dry-run         print the commands instead of running them
  -h, --help        this text"
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

SEEDS=3 STEPS=60 PRESETS=all DRY_RUN=0 PYTHON=""
split_dry_run "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seeds) need_value "$@"; need_int "$1" "$2"; SEEDS=$2; shift 2 ;;
        --steps) need_value "$@"; need_int "$1" "$2"; STEPS=$2; shift 2 ;;
        --presets) need_value "$@"; PRESETS=$2; shift 2 ;;
        --root | --out | --set) need_value "$@"; EXTRA+=("$1" "$2"); shift 2 ;;
        --no-mc-study) EXTRA+=("$1"); shift ;;
        --python) need_value "$@"; PYTHON=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) echo "$USAGE"; exit 0 ;;
        --) shift; EXTRA+=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
if [ -z "$PYTHON" ]; then
    PYTHON=python3
    [ -x "$REPO/.venv/bin/python" ] && PYTHON=$REPO/.venv/bin/python
fi

cd "$REPO"
run env PYTHONPATH="$REPO" "$PYTHON" -m jaxrl.cli variants
run env PYTHONPATH="$REPO" "$PYTHON" benchmarks/variants.py --presets "$PRESETS" --seeds "$SEEDS" --steps "$STEPS" \
    "${EXTRA[@]}"
