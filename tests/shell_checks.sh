# shell_checks.sh - text checks for the shell tests, sourced; right under
# `set -o pipefail`.
#
# Never `echo "$text" | grep -q PATTERN` in a test that sets pipefail:
# grep -q exits at its first match while echo may still be writing (bash's
# stdout is line-buffered, so echo writes a multi-line text a line at a
# time), echo then dies of SIGPIPE (status 141), and pipefail turns a text
# that holds the pattern into a failed check. That was issue 22: "/metrics
# lacks moetrain_steps_total" on a page that had it, about one run in a
# dozen on a busy machine. These helpers start no writer process: the text
# goes to grep as a here-string, which bash writes completely before grep
# starts, so the status is grep's alone.

# has TEXT STRING: TEXT contains the fixed string STRING.
has() { grep -qF -- "$2" <<< "$1"; }

# has_line TEXT REGEX: a line of TEXT matches the basic regular expression.
has_line() { grep -q -- "$2" <<< "$1"; }
