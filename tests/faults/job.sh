# Shell functions the fault scripts share (runtime/run_fault.sh and
# cli/small_fs.sh source this file). fail and check_output read the
# caller's $log (the job's output) and its arrays expect and once.

# Every descendant of a process, depth first.
descendants() {
  local c
  for c in $(ps -o pid= --ppid "$1" 2> /dev/null); do
    echo "$c"
    descendants "$c"
  done
}

# kill_job_tree JOB [PID...]: SIGKILLs a job started with setsid (its pid is
# its session's process group id: the launcher and its ranks, stopped ones
# included), every descendant of it and the PIDs given (processes found
# earlier that may have left the group), then reaps the job.
kill_job_tree() {
  local job="$1" p
  shift
  local all=("$@" $(descendants "$job"))
  kill -KILL -- "-$job" 2> /dev/null
  for p in "${all[@]}"; do kill -KILL "$p" 2> /dev/null; done
  wait "$job" 2> /dev/null
}

# Prints FAIL with the reason and the job's output, and exits 1.
fail() {
  echo "FAIL: $*"
  echo "----- output of the job -----"
  cat "$log"
  exit 1
}

now() { date +%s%3N; }  # milliseconds

# Fails unless the output matches every (extended) regex of `expect`, and
# each regex of `once` on exactly one line.
check_output() {
  local re n
  for re in "${expect[@]}"; do
    grep -Eq -- "$re" "$log" || fail "the output does not match /$re/"
  done
  for re in "${once[@]}"; do
    n=$(grep -Ec -- "$re" "$log")
    [[ $n -eq 1 ]] || fail "the output matches /$re/ on $n lines, expected exactly one"
  done
}
