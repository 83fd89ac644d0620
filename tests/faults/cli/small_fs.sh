#!/usr/bin/env bash
# Runs one command against a file system of its own that is small, read-only
# or full: a tmpfs mounted in a private mount namespace (unshare --mount), so
# that it vanishes with the test however the test ends, and nothing outside
# sees it. Mounting needs root (CAP_SYS_ADMIN); where a mount namespace or a
# tmpfs cannot be made, the test is skipped with exit status 77 (ctest's
# SKIP_RETURN_CODE) and the reason. Permissions cannot stand in for this:
# root writes through any chmod.
#
#   small_fs.sh [--size BYTES] [--mkdir NAME]... [--read-only] [--fill-on-stop]
#               --exit STATUS --max-seconds S [--expect REGEX]... [--once REGEX]...
#               [--absent REGEX] [--gone PATH]... [--present PATH]... -- command...
#
#   @FS@ in the command and in the paths stands for the mount point.
#   --size          the tmpfs' size (default 1M)
#   --mkdir         a directory made in it first (before --read-only)
#   --read-only     remount it read-only before the command
#   --fill-on-stop  when a process of the command stops itself (SIGSTOP; e.g.
#                   WEFT_CHECKPOINT_STOP_AT in a checkpoint save), fill the
#                   file system to its last byte, then continue the process:
#                   the disk fills during the run, after the checks before step 0
#   --exit          the exit status the command must return
#   --max-seconds   it must end within S seconds
#   --expect        its output (stdout and stderr) must match the extended regex
#   --once          its output must match the regex on exactly one line
#   --absent        its output must not match the regex
#   --gone          no file may match the glob afterwards (nothing left behind)
#   --present       a file must match the glob afterwards
set -u
source "$(dirname "${BASH_SOURCE[0]}")/../job.sh"

if [[ "${WEFT_SMALL_FS_INSIDE:-}" != 1 ]]; then
  if ! why="$(unshare --mount --propagation private true 2>&1)"; then
    echo "SKIP: cannot make a private mount namespace for a file system of the test's own (unshare --mount: ${why:-failed}); needs root with CAP_SYS_ADMIN"
    exit 77
  fi
  WEFT_SMALL_FS_INSIDE=1 exec unshare --mount --propagation private "$0" "$@"
fi

size=1M read_only=0 fill=0 exit_want="" max=""
mkdirs=() expect=() once=() absent=() gone=() present=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --size) size="$2"; shift 2 ;;
    --mkdir) mkdirs+=("$2"); shift 2 ;;
    --read-only) read_only=1; shift ;;
    --fill-on-stop) fill=1; shift ;;
    --exit) exit_want="$2"; shift 2 ;;
    --max-seconds) max="$2"; shift 2 ;;
    --expect) expect+=("$2"); shift 2 ;;
    --once) once+=("$2"); shift 2 ;;
    --absent) absent+=("$2"); shift 2 ;;
    --gone) gone+=("$2"); shift 2 ;;
    --present) present+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "small_fs.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -n "$exit_want" && -n "$max" && $# -gt 0 ]] || { echo "small_fs.sh: need --exit, --max-seconds and a command after --" >&2; exit 2; }

mnt="$(mktemp -d /tmp/weft-small-fs.XXXXXX)"
log="$(mktemp)"
job=""
cleanup() {
  [[ -z "$job" ]] || kill_job_tree "$job"
  umount "$mnt" 2> /dev/null
  rmdir "$mnt" 2> /dev/null
  rm -f "$log"
}
trap cleanup EXIT
trap 'exit 3' INT TERM

if ! why="$(mount -t tmpfs -o "size=$size,mode=0755" weft-small-fs "$mnt" 2>&1)"; then
  echo "SKIP: cannot mount a tmpfs of $size for the test (mount: $why); needs root with CAP_SYS_ADMIN"
  exit 77
fi
for d in "${mkdirs[@]}"; do mkdir -p "${d//@FS@/$mnt}"; done
if [[ $read_only -eq 1 ]] && ! why="$(mount -o remount,ro "$mnt" 2>&1)"; then
  echo "SKIP: cannot make the test's tmpfs read-only (mount -o remount,ro: $why)"
  exit 77
fi


cmd=()
for a in "$@"; do cmd+=("${a//@FS@/$mnt}"); done
echo "file system: tmpfs of $size at $mnt$([[ $read_only -eq 1 ]] && echo ', read-only')"
echo "command: ${cmd[*]}"
t0=$(now)
setsid "${cmd[@]}" > "$log" 2>&1 &
job=$!
filled=0
while kill -0 "$job" 2> /dev/null; do
  (( $(now) - t0 > max * 1000 )) && fail "the command was still running $max s after its start"
  if [[ $fill -eq 1 && $filled -eq 0 ]]; then
    for p in $(descendants "$job"); do
      [[ "$(awk '{print $3}' "/proc/$p/stat" 2> /dev/null)" == T ]] || continue
      cat /dev/zero > "$mnt/.filler" 2> /dev/null
      free="$(stat -f -c %a "$mnt")"
      [[ "$free" == 0 ]] || fail "could not fill the file system: $free blocks still free"
      echo "process $p stopped itself: the file system is now full; continuing it"
      kill -CONT "$p"
      filled=1
    done
  fi
  sleep 0.05
done
wait "$job"
rc=$?
job=""
echo "the command ended after $(( ($(now) - t0) / 1000 )) s, exit status $rc"
[[ $fill -eq 0 || $filled -eq 1 ]] || fail "no process of the command stopped itself, so the file system was never filled"
[[ "$rc" == "$exit_want" ]] || fail "expected exit status $exit_want, got $rc"
check_output
for re in "${absent[@]}"; do
  ! grep -Eq -- "$re" "$log" || fail "the output must not match /$re/"
done
shopt -s nullglob dotglob
for g in "${gone[@]}"; do
  left=(${g//@FS@/$mnt})
  [[ ${#left[@]} -eq 0 ]] || fail "left behind: ${left[*]}"
done
for g in "${present[@]}"; do
  there=(${g//@FS@/$mnt})
  [[ ${#there[@]} -gt 0 ]] || fail "missing afterwards: ${g//@FS@/$mnt}"
done
echo "----- output of the command -----"
cat "$log"
echo "PASS"
