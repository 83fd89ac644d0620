# Test helpers of weft's own build:
#   weft_add_mpi_test(NAME SOURCES ... [RANKS 1 2 4 8] [TIMEOUT s] [ARGS ...] [ENV ...])
#     one doctest executable, run by CTest at each rank count (oversubscribed
#     where the machine has fewer cores, ranks yielding when idle).
#   weft_add_compile_fail_test(NAME SOURCE file REGEX message [FIRST_ERROR regex] [DEFINES ...])
#     proves the snippet does NOT compile and that the compiler says `message`;
#     with FIRST_ERROR, also that the first line containing "error:" matches it.
include_guard(GLOBAL)

set(WEFT_TEST_RANKS "1;2;4;8" CACHE STRING "Rank counts at which every MPI test runs")
# A ceiling on the rank counts of weft_add_mpi_test: the runs above it are not
# registered, and a program none of whose runs remain is not built (CI's
# sanitizer variant sets 2; tests registered by hand are left to ctest -E).
set(WEFT_TEST_MAX_RANKS "" CACHE STRING "Highest rank count of weft_add_mpi_test's runs (empty: no limit)")
set(WEFT_MPIEXEC_FLAGS "--oversubscribe;--bind-to;none;--mca;mpi_yield_when_idle;1" CACHE STRING
    "Flags of mpiexec for the tests (Open MPI spellings)")
# OpenMP threads per rank of every test (Kokkos' OpenMP backend reads
# OMP_NUM_THREADS; a test's ENVIRONMENT overrides the caller's, so this is the
# only place where it can be set). CI's kokkos-openmp variant sets 2.
set(WEFT_TEST_OMP_NUM_THREADS 1 CACHE STRING "OMP_NUM_THREADS of every test (Kokkos' OpenMP threads per rank)")
# Running as root needs Open MPI's consent; the variables are harmless otherwise.
set(WEFT_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;OPENBLAS_NUM_THREADS=1;OMP_NUM_THREADS=${WEFT_TEST_OMP_NUM_THREADS};WEFT_TEST_DEADLINE=60")
if(NOT WEFT_TEST_OMP_NUM_THREADS EQUAL 1)
  # Ranks x threads outnumber the 2 cores of a small machine: idle OpenMP
  # threads must sleep, not spin (as idle MPI ranks yield), and must not be
  # pinned (every rank would pin its thread 0 to the same core). Setting
  # OMP_PROC_BIND also silences Kokkos' advice to set it.
  string(APPEND WEFT_TEST_ENV ";OMP_WAIT_POLICY=passive;OMP_PROC_BIND=false")
endif()

function(weft_add_mpi_test name)
  cmake_parse_arguments(T "NO_PCH" "TIMEOUT" "SOURCES;RANKS;ENV;ARGS" ${ARGN})
  if(NOT T_RANKS)
    set(T_RANKS ${WEFT_TEST_RANKS})
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  if(NOT WEFT_TEST_MAX_RANKS STREQUAL "")
    set(_kept)
    foreach(n IN LISTS T_RANKS)
      if(n LESS_EQUAL WEFT_TEST_MAX_RANKS)
        list(APPEND _kept ${n})
      endif()
    endforeach()
    set(T_RANKS ${_kept})
    if(NOT T_RANKS)
      return()
    endif()
  endif()
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE weft_test_harness)
  # NO_PCH: for a test compiled with definitions of its own (the precompiled
  # header was built without them; and g++ 12 reports its -Warray-bounds false
  # positive inside libstdc++'s string concatenation, which it silences as a
  # system header's without the precompiled header, for std::string(MACRO) +
  # "..." in such a test).
  if(TARGET weft_test_pch AND NOT T_NO_PCH)
    target_precompile_headers(${name} REUSE_FROM weft_test_pch)
  endif()
  foreach(n IN LISTS T_RANKS)
    add_test(NAME ${name}.np${n}
             COMMAND ${MPIEXEC_EXECUTABLE} ${WEFT_MPIEXEC_FLAGS} ${MPIEXEC_NUMPROC_FLAG} ${n} $<TARGET_FILE:${name}> ${T_ARGS})
    set_tests_properties(${name}.np${n} PROPERTIES
      PROCESSORS ${n} TIMEOUT ${T_TIMEOUT} LABELS "mpi;np${n}"
      ENVIRONMENT "${WEFT_TEST_ENV};${T_ENV}")
  endforeach()
endfunction()

function(weft_add_compile_fail_test name)
  cmake_parse_arguments(T "" "SOURCE;REGEX;FIRST_ERROR" "DEFINES" ${ARGN})
  set(obj compile_fail_${name})
  add_library(${obj} OBJECT EXCLUDE_FROM_ALL ${T_SOURCE})
  target_link_libraries(${obj} PRIVATE weft::weft)
  target_compile_definitions(${obj} PRIVATE ${T_DEFINES})
  # With Ninja the test runs the target's compile command itself and needs no
  # lock; otherwise builds in the same tree must not run concurrently.
  set(ninja "")
  set(lock RESOURCE_LOCK weft_build_tree)
  if(CMAKE_GENERATOR MATCHES "Ninja")
    set(ninja "${CMAKE_MAKE_PROGRAM}")
    set(lock "")
  endif()
  add_test(NAME compile_fail.${name}
           COMMAND ${CMAKE_COMMAND} -DTARGET=${obj} -DBUILD_DIR=${CMAKE_BINARY_DIR} "-DREGEX=${T_REGEX}"
                   "-DFIRST_ERROR=${T_FIRST_ERROR}" "-DNINJA=${ninja}"
                   -P ${PROJECT_SOURCE_DIR}/cmake/weftCompileFail.cmake)
  set_tests_properties(compile_fail.${name} PROPERTIES LABELS "compile_fail" ${lock} TIMEOUT 300)
endfunction()

# weft_add_expected_failure_test(NAME RANKS n REGEX message [MAX_SECONDS s] COMMAND exe args...)
#   runs exe under mpiexec at n ranks; passes only when it exits non-zero,
#   within MAX_SECONDS, with output matching REGEX. Proves that failures are
#   reported, not that programs work.
function(weft_add_expected_failure_test name)
  cmake_parse_arguments(T "" "RANKS;REGEX;MAX_SECONDS" "COMMAND;ENV" ${ARGN})
  if(NOT T_MAX_SECONDS)
    set(T_MAX_SECONDS 60)
  endif()
  string(REPLACE ";" "|" cmd "${MPIEXEC_EXECUTABLE};${WEFT_MPIEXEC_FLAGS};${MPIEXEC_NUMPROC_FLAG};${T_RANKS};${T_COMMAND}")
  add_test(NAME ${name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}" "-DREGEX=${T_REGEX}" -DMAX_SECONDS=${T_MAX_SECONDS}
                   -P ${PROJECT_SOURCE_DIR}/cmake/weftExpectFailure.cmake)
  set_tests_properties(${name} PROPERTIES PROCESSORS ${T_RANKS} LABELS "mpi;expected_failure"
                       TIMEOUT 300 ENVIRONMENT "${WEFT_TEST_ENV};${T_ENV}")
endfunction()
