#!/usr/bin/env bash
# Runs an MPI job, injects a fault into one of its ranks, and checks how the
# job ends. Every process the test starts runs in a session of its own, and
# the whole session (the launcher and every rank, stopped ones included) is
# killed when the script exits, on success, failure or timeout alike.
#
#   run_fault.sh [--signal STOP|KILL --rank R --when REGEX] --max-seconds S
#                [--expect REGEX]... [--once REGEX]... -- mpiexec args...
#
#   --signal, --rank  send SIG to world rank R (found by OMPI_COMM_WORLD_RANK
#                     or PMIX_RANK in its environment) once the output matches
#                     --when; without --signal no fault is injected.
#   --max-seconds     the job must end within S seconds of the fault (of the
#                     start without one), every rank with it, exit non-zero.
#   --expect          the output must match the (extended) regex.
#   --once            the output must match the regex on exactly one line.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/../job.sh"

signal="" rank="" when="" max=""
expect=() once=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --signal) signal="$2"; shift 2 ;;
    --rank) rank="$2"; shift 2 ;;
    --when) when="$2"; shift 2 ;;
    --max-seconds) max="$2"; shift 2 ;;
    --expect) expect+=("$2"); shift 2 ;;
    --once) once+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "run_fault.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -n "$max" && $# -gt 0 ]] || { echo "run_fault.sh: need --max-seconds and a command after --" >&2; exit 2; }

log="$(mktemp)"
job=""
ranks=()

cleanup() {
  [[ -z "$job" ]] || kill_job_tree "$job" "${ranks[@]}"
  rm -f "$log"
}
trap cleanup EXIT
trap 'exit 3' INT TERM

elapsed_ms() { echo $(( $(now) - $1 )); }
seconds() { printf '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 )); }

# A session of its own (setsid execs the launcher: its pid is the group id).
setsid "$@" > "$log" 2>&1 &
job=$!
t_start=$(now)

if [[ -n "$signal" ]]; then
  # Wait (at most 120 s) for the moment to inject the fault.
  until grep -Eq -- "$when" "$log"; do
    kill -0 "$job" 2> /dev/null || fail "the job ended before its output matched /$when/"
    (( $(elapsed_ms "$t_start") > 120000 )) && fail "the output did not match /$when/ within 120 s"
    sleep 0.1
  done
  target=""
  for p in $(descendants "$job"); do
    ranks+=("$p")
    env_of="$(tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null)"
    if grep -Eq "^(OMPI_COMM_WORLD_RANK|PMIX_RANK)=$rank\$" <<< "$env_of"; then target="$p"; fi
  done
  [[ -n "$target" ]] || fail "found no process of world rank $rank among the job's processes (${ranks[*]})"
  kill "-$signal" "$target" || fail "could not send SIG$signal to rank $rank (pid $target)"
  echo "sent SIG$signal to world rank $rank (pid $target) after $(seconds "$(elapsed_ms "$t_start")") s"
else
  sleep 0.5
  ranks=($(descendants "$job"))
fi
t_fault=$(now)

# The job must end within max seconds of the fault.
while kill -0 "$job" 2> /dev/null; do
  if (( $(elapsed_ms "$t_fault") > max * 1000 )); then
    fail "the job was still running $max s after the fault"
  fi
  sleep 0.1
done
wait "$job"
rc=$?
took=$(seconds "$(elapsed_ms "$t_fault")")
# Every rank must have ended with it (a stopped one included).
for p in "${ranks[@]}"; do
  state="$(awk '{print $3}' "/proc/$p/stat" 2> /dev/null)"
  [[ -z "$state" || "$state" == Z ]] || fail "process $p of the job (state $state) outlived its launcher"
done
job=""
echo "the job ended ${took} s after the fault, exit status $rc"
[[ $rc -ne 0 ]] || fail "the job exited 0; a fault must end it with an error"
check_output
echo "----- output of the job -----"
cat "$log"
echo "PASS"
