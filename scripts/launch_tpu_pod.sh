#!/usr/bin/env bash
# Run the same `jaxrl train` on every worker of a Cloud TPU VM slice.
PROG=launch_tpu_pod.sh
USAGE="usage: scripts/$PROG --name NAME --zone ZONE --workdir DIR [options] CONFIG [jaxrl train args...]

Runs \`jaxrl train CONFIG --workdir DIR --cluster auto ARGS\` on all workers of the TPU VM slice NAME at
once (gcloud compute tpus tpu-vm ssh NAME --worker=all). Each worker is one process; JAX's Cloud TPU
detection (jax.distributed.initialize() with no arguments) finds the process count, each worker's id
and the coordinator (worker 0), so no address or id is passed.

options:
  --name NAME         the TPU VM slice (required)
  --zone ZONE         its zone (required)
  --project PROJECT   GCP project (default: gcloud's configured one)
  --workdir DIR       the run directory, the same absolute path on every worker: an NFS mount or a
                      bucket mounted with gcsfuse (required; checkpoints are written by all workers
                      together). CONFIG must exist here; it is passed as its path inside the repository
  --repo-dir DIR      the repository on the workers, relative to the home directory (default: jaxrl)
  --sync              first copy this checkout's HEAD (git archive: committed files only) to --repo-dir
  --install           first create REPO_DIR/.venv on every worker and pip install the repository
                      with its tpu and hf extras (jax[tpu], the tokenizer library)
  --init-timeout S    give up if not every worker joined within S seconds (default 300)
  --dry-run           print the commands instead of running them
  -h, --help          this text"
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NAME="" ZONE="" PROJECT="" WORKDIR="" REPO_DIR=jaxrl SYNC=0 INSTALL=0 INIT_TIMEOUT=300 DRY_RUN=0
split_dry_run "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while [ $# -gt 0 ]; do
    case "$1" in
        --name) need_value "$@"; NAME=$2; shift 2 ;;
        --zone) need_value "$@"; ZONE=$2; shift 2 ;;
        --project) need_value "$@"; PROJECT=$2; shift 2 ;;
        --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
        --repo-dir) need_value "$@"; REPO_DIR=$2; shift 2 ;;
        --init-timeout) need_value "$@"; need_int "$1" "$2"; INIT_TIMEOUT=$2; shift 2 ;;
        --sync) SYNC=1; shift ;;
        --install) INSTALL=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) echo "$USAGE"; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ -n "$NAME" ] || die "--name is required (the TPU VM slice)"
[ -n "$ZONE" ] || die "--zone is required"
[ -n "$WORKDIR" ] || die "--workdir is required (a path every worker sees)"
[ $# -ge 1 ] || die "no CONFIG given (e.g. configs/grpo_arithmetic.py)"
check_config "$1"
check_workdir "$WORKDIR" workers
CONFIG=$(repo_config "$REPO" "$1")  # the workers run in their copy of the repository (--repo-dir)
shift

TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
[ -n "$PROJECT" ] && WHERE+=(--project "$PROJECT")
on_all_workers() {  # on_all_workers REMOTE_COMMAND: the same shell command on every worker, at once
    run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command "$1"
}

if [ "$SYNC" = 1 ]; then
    ARCHIVE=${TMPDIR:-/tmp}/jaxrl-src-$$.tar.gz
    run git -C "$REPO" archive --format=tar.gz -o "$ARCHIVE" HEAD
    run "${TPU[@]}" scp "$ARCHIVE" "$NAME:jaxrl-src.tar.gz" "${WHERE[@]}" --worker=all
    on_all_workers "$(quoted mkdir -p "$REPO_DIR") && $(quoted tar -xzf jaxrl-src.tar.gz -C "$REPO_DIR")"
fi
if [ "$INSTALL" = 1 ]; then
    on_all_workers "cd $(quoted "$REPO_DIR") && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu,hf]'"
fi
TRAIN=(.venv/bin/jaxrl train "$CONFIG" --workdir "$WORKDIR" --cluster auto --init-timeout "$INIT_TIMEOUT" "$@")
on_all_workers "cd $(quoted "$REPO_DIR") && $(quoted "${TRAIN[@]}")"
