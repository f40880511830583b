# Shared by the launchers (sourced, not run): errors, argument checks, and --dry-run.
# Every printed command is shell-quoted: pasting it into a shell runs exactly that argv.

die() {  # one line on stderr naming the problem, exit 2 (as `jaxrl` does for a user mistake)
    echo "$PROG: error: $*" >&2
    exit 2
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
