#!/usr/bin/env bash
# Submit `jaxrl train` to SLURM GPU nodes with scripts/slurm_train.sbatch.
PROG=launch_slurm.sh
USAGE="usage: scripts/$PROG --workdir DIR [options] CONFIG [jaxrl train args...]

Submits scripts/slurm_train.sbatch: one \`jaxrl train CONFIG --workdir DIR ARGS --cluster auto\` process
per node, each with all GPUs of its node; jax.distributed.initialize() takes the coordinator, the
process count and each process's id from the SLURM environment.

options:
  --workdir DIR        the run directory, an absolute path on a file system every node sees (required;
                       a relative one gets a warning). CONFIG must exist here (else an error)
  --nodes N            nodes (default 2)
  --gpus-per-node G    GPUs per node (default 8)
  --partition P        SLURM partition
  --account A          SLURM account
  --time T             time limit, e.g. 24:00:00 (default: the template's)
  --job-name NAME      (default: jaxrl)
  --jaxrl CMD          the jaxrl command on the nodes (default: jaxrl), e.g. \"/shared/venv/bin/jaxrl\"
  --init-timeout S     give up if not every node joined within S seconds (default 300)
  --dry-run            print the sbatch command and the srun line the job runs, submit nothing
  -h, --help           this text"
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/lib.sh"

WORKDIR="" DRY_RUN=0 JAXRL_CMD=jaxrl INIT_TIMEOUT=300
split_dry_run "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
SBATCH=(sbatch --ntasks-per-node=1)
NODES=2 GPUS=8
while [ $# -gt 0 ]; do
    case "$1" in
        --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
        --nodes) need_value "$@"; need_int "$1" "$2"; NODES=$2; shift 2 ;;
        --gpus-per-node) need_value "$@"; need_int "$1" "$2"; GPUS=$2; shift 2 ;;
        --partition | --account | --time | --job-name) need_value "$@"; SBATCH+=("$1=$2"); shift 2 ;;
        --jaxrl) need_value "$@"; JAXRL_CMD=$2; shift 2 ;;
        --init-timeout) need_value "$@"; need_int "$1" "$2"; INIT_TIMEOUT=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) echo "$USAGE"; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ -n "$WORKDIR" ] || die "--workdir is required (a path every node sees)"
[ $# -ge 1 ] || die "no CONFIG given (e.g. configs/grpo_arithmetic.py)"
check_config "$1"
check_workdir "$WORKDIR" nodes
SBATCH+=(--nodes="$NODES" --gpus-per-node="$GPUS")
JOB_ARGS=("$1" --workdir "$WORKDIR" --init-timeout "$INIT_TIMEOUT" "${@:2}")

run env JAXRL_BIN="$JAXRL_CMD" "${SBATCH[@]}" "$HERE/slurm_train.sbatch" "${JOB_ARGS[@]}"
if [ "$DRY_RUN" = 1 ]; then  # what the job will run on its nodes
    JAXRL_DRY_RUN=1 JAXRL_BIN="$JAXRL_CMD" bash "$HERE/slurm_train.sbatch" "${JOB_ARGS[@]}"
fi
