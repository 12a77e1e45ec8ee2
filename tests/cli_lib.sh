# cli_lib.sh: helpers shared by the command-line tests (sourced, not run).
# The sourcing script sets T (a temporary directory) first, or calls cli_setup.

# cli_setup NAME ARGS...: for a test run as `script.sh <path-to-colibri>`: checks
# the argument, sets BIN (absolute path) and T (a temporary directory removed at exit).
cli_setup() {
  local name=$1
  shift
  if [ $# -ne 1 ]; then
    echo "usage: $0 <path-to-colibri>" >&2
    exit 2
  fi
  BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
  [ -x "$BIN" ] || { echo "FAIL: $1 is not an executable" >&2; exit 1; }
  T=$(mktemp -d "${TMPDIR:-/tmp}/colibri-$name.XXXXXX")
  trap 'rm -rf "$T"' EXIT
}
CHECKS=0
step() { echo "== $*"; }
pass() { CHECKS=$((CHECKS + 1)); echo "   ok: $*"; }
fail() {
  echo "FAIL: $*" >&2
  if [ -s "$T/out" ]; then echo "--- stdout (last 20 lines):" >&2; tail -n 20 "$T/out" >&2; fi
  if [ -s "$T/err" ]; then echo "--- stderr (last 20 lines):" >&2; tail -n 20 "$T/err" >&2; fi
  exit 1
}

# run CMD...: runs the command with stdout in $T/out, stderr in $T/err and its
# exit status in RC; never stops the script itself.
RC=0
run() {
  set +e
  "$@" >"$T/out" 2>"$T/err"
  RC=$?
  set -e
}
# expect_rc WANT WHAT CMD...: runs CMD and requires exit status WANT.
expect_rc() {
  local want=$1 what=$2
  shift 2
  run "$@"
  [ "$RC" -eq "$want" ] || fail "$what: exit status $RC, expected $want (command: $*)"
  pass "$what (exit $want)"
}
# out_has TEXT / err_has TEXT: fixed-string search in the last command's output.
out_has() { grep -qF -- "$1" "$T/out" || fail "stdout lacks '$1'"; }
err_has() { grep -qF -- "$1" "$T/err" || fail "stderr lacks '$1'"; }
