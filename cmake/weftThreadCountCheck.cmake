# Runs a program twice, with OMP_NUM_THREADS=1 and =${THREADS}, each writing a
# run record (--record FILE appended), and requires the "loss" arrays of the
# two records to be equal character for character. weft's kernels sum in an
# order that does not depend on the thread count, so any difference is a
# race (a deliberate one in ops::bias_backward moved the losses by 1e-8,
# which the 1e-5 parity tests let through; docs/build.md).
#   cmake -DCMD=a|b|c -DTHREADS=2 -DDIR=<scratch dir> -P weftThreadCountCheck.cmake
string(REPLACE "|" ";" cmd "${CMD}")
file(MAKE_DIRECTORY "${DIR}")
set(losses "")
foreach(t 1 ${THREADS})
  set(ENV{OMP_NUM_THREADS} ${t})
  execute_process(COMMAND ${cmd} --record "${DIR}/threads_${t}.json" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the run with OMP_NUM_THREADS=${t} failed (${rc}):\n${out}")
  endif()
  file(STRINGS "${DIR}/threads_${t}.json" line REGEX "^ *\"loss\": \\[")
  if(NOT line)
    message(FATAL_ERROR "${DIR}/threads_${t}.json has no \"loss\" array")
  endif()
  list(APPEND losses "${line}")
endforeach()
list(GET losses 0 one)
list(GET losses 1 many)
if(NOT one STREQUAL many)
  message(FATAL_ERROR "the losses differ between 1 and ${THREADS} OpenMP threads (a race in a kernel?):\n"
                      "  1 thread:   ${one}\n  ${THREADS} threads: ${many}")
endif()
message(STATUS "the losses are identical at 1 and ${THREADS} OpenMP threads: ${one}")
