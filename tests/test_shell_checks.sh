#!/usr/bin/env bash
# test_shell_checks.sh - the text checks of the shell tests (shell_checks.sh)
# find what a text holds, however long the text and wherever the match
# sits, under `set -euo pipefail` (issue 22).
#
# The race of issue 22 needs a reader that stops at its first match while
# the writer still has text to write. A /metrics page of 6 KiB leaves that
# to the scheduler (about 1 check in 500 failed, more under load); a page
# longer than a pipe buffer (64 KiB) with the match on its first line makes
# it certain: the writer blocks on the full pipe, the reader matches and
# exits, the writer's next write gets SIGPIPE. With `echo "$page" | grep -q`
# as the check, every round below fails.
#
#   test_shell_checks.sh
set -euo pipefail
. "$(dirname "$0")/shell_checks.sh"

fail() { echo "FAIL: $*" >&2; exit 1; }

# ~1 MiB of sample lines, the wanted ones first and last
filler=$(printf 'moetrain_filler_total{n="%d"} 1\n' $(seq 30000))
page="moetrain_steps_total 5
$filler
moetrain_last_gauge 1"
[ ${#page} -gt $((4 * 65536)) ] || fail "the page is only ${#page} bytes, not past four pipe buffers"

for round in $(seq 10); do
  has "$page" 'moetrain_steps_total ' || fail "round $round: has missed the first line"
  has_line "$page" '^moetrain_steps_total [0-9]*$' || fail "round $round: has_line missed the first line"
  has "$page" 'moetrain_last_gauge 1' || fail "round $round: has missed the last line"
done

# and they can fail: absent text, a line that does not match as a whole
has "$page" 'moetrain_absent_total' && fail "has found an absent string"
has_line "$page" '^steps_total' && fail "has_line matched inside a line"
# a pattern starting with '-' is a pattern, not an option
has "a -x b" '-x' || fail "has took '-x' for an option"
echo "shell checks: found every match in 10 rounds on a ${#page}-byte page"
