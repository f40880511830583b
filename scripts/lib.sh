# Shared by the launchers (sourced, not run): errors, warnings, argument checks, and --dry-run.
# Every printed command is shell-quoted: pasting it into a shell runs exactly that argv.

die() {  # one line on stderr naming the problem, exit 2 (as `jaxrl` does for a user mistake)
    echo "$PROG: error: $*" >&2
    exit 2
}

warn() {  # one line on stderr; the launch goes on
    echo "$PROG: warning: $*" >&2
}

check_config() {  # check_config CONFIG: the file must exist here (the job reads it by the same path)
    [ -f "$1" ] || die "config file $1 not found"
}

check_workdir() {  # check_workdir DIR HOSTS: a relative run directory means something else on each host
    [[ "$1" == /* ]] || warn "--workdir $1 is relative: each of the $2 resolves it from its own working" \
        "directory; give an absolute path that every one of them sees"
}

repo_config() {  # repo_config REPO CONFIG: CONFIG's path inside REPO (printed), for a job that runs in its
    # own copy of REPO; a warning if CONFIG lies outside REPO or is not committed as it is here
    local dir abs repo rel
    dir=$(cd "$(dirname "$2")" && pwd -P) && repo=$(cd "$1" && pwd -P)
    abs="$dir/$(basename "$2")"
    if [[ "$abs" != "$repo"/* ]]; then
        warn "config $2 is outside the repository $1: the job reads it by that path on each host" \
            "(--sync copies the repository's committed files only)"
        echo "$2"
        return
    fi
    rel=${abs#"$repo"/}
    if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
        if ! git -C "$repo" ls-files --error-unmatch -- "$rel" >/dev/null 2>&1 \
            || ! git -C "$repo" diff --quiet HEAD -- "$rel"; then
            warn "config $rel is not committed as it is here: --sync copies the committed files (HEAD) only"
        fi
    fi
    echo "$rel"
}

need_value() {  # need_value "$@" (at an option): it must be followed by a value, not by another option
    [ $# -ge 2 ] && [[ "$2" != --* ]] || die "$1 needs a value"
}

need_int() {  # need_int OPTION VALUE: a positive integer
    [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 $2: expected a positive integer"
}

quote() {  # one word for a POSIX shell: as is if it is safe, else in single quotes (' as '\'')
    if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

quoted() {  # the argv as one shell-quoted line
    local word line=""
    for word in "$@"; do
        line+="${line:+ }$(quote "$word")"
    done
    echo "$line"
}

split_dry_run() {  # --dry-run anywhere on the line sets DRY_RUN=1 (never passed on: `jaxrl train` has
    # no such flag, and a --dry-run typed after CONFIG must not launch the job); ARGS: the other words
    ARGS=()
    local word
    for word in "$@"; do
        if [ "$word" = --dry-run ]; then DRY_RUN=1; else ARGS+=("$word"); fi
    done
}

run() {  # run the argv, or only print it under --dry-run
    if [ "${DRY_RUN:-0}" = 1 ]; then
        quoted "$@"
    else
        "$@"
    fi
}
