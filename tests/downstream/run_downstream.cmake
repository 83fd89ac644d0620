# Run by CTest (cmake -P): installs weft from WEFT_BUILD_DIR into a scratch
# prefix under WORK_DIR, then configures, builds and runs the project in
# SOURCE_DIR against that prefix, at 2 ranks with MPIEXEC (a list: launcher,
# its flags, the rank-count flag). CXX and GENERATOR match weft's build.
# KOKKOS_DIR, KOKKOSKERNELS_DIR and KOKKOS_VERSION are those of weft's build:
# the project is pointed at them and must use them. KOKKOS_CORE_LIB is the
# Kokkos core library of weft's build; when it is a shared library, the
# program must load it and no other Kokkos core library. USER_MODEL_SOURCE
# (optional) is a user's model program (examples/custom_model.cpp): it is
# built against the package too, and its loss curve at 2 ranks (pp=2, the
# zero-bubble schedule) must follow its one-rank curve.
foreach(v WEFT_BUILD_DIR SOURCE_DIR WORK_DIR CXX GENERATOR MPIEXEC KOKKOS_DIR KOKKOSKERNELS_DIR KOKKOS_VERSION KOKKOS_CORE_LIB)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run_downstream.cmake: -D${v}=... is required")
  endif()
endforeach()

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "downstream test: ${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "downstream test: ${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")

# Refresh the build tree first: a header added since it was configured would
# be missing from the install rules (they come from a configure-time glob).
step("refresh weft's build tree" ${CMAKE_COMMAND} "${WEFT_BUILD_DIR}")
step("cmake --install into ${prefix}" ${CMAKE_COMMAND} --install "${WEFT_BUILD_DIR}" --prefix "${prefix}")
# Only the scratch prefix may provide weft: not the build tree, not a package registry.
step("configure against the installed package"
     ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${build}" -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=Release
     -DCMAKE_CXX_COMPILER=${CXX} "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
     "-DKokkos_DIR=${KOKKOS_DIR}" "-DKokkosKernels_DIR=${KOKKOSKERNELS_DIR}"
     "-DWEFT_USER_MODEL_SOURCE=${USER_MODEL_SOURCE}")
set(configure_output "${step_output}")
string(REGEX MATCH "weft [0-9.]+ found at ([^\n]*)" _ "${step_output}")
file(REAL_PATH "${prefix}" real_prefix)
if(NOT CMAKE_MATCH_1 MATCHES "^${real_prefix}/" AND NOT CMAKE_MATCH_1 MATCHES "^${prefix}/")
  message(FATAL_ERROR "downstream test: weft was found at '${CMAKE_MATCH_1}', not in the scratch prefix ${prefix}")
endif()
if(NOT configure_output MATCHES "downstream Kokkos ([^ ]*) at ([^\n]*)")
  message(FATAL_ERROR "downstream test: the project did not report its Kokkos:\n${configure_output}")
endif()
file(REAL_PATH "${CMAKE_MATCH_2}" found_kokkos_dir)
file(REAL_PATH "${KOKKOS_DIR}" weft_kokkos_dir)
if(NOT found_kokkos_dir STREQUAL weft_kokkos_dir OR NOT CMAKE_MATCH_1 VERSION_EQUAL KOKKOS_VERSION)
  message(FATAL_ERROR "downstream test: the project found Kokkos ${CMAKE_MATCH_1} at ${CMAKE_MATCH_2}, "
                      "not weft's Kokkos ${KOKKOS_VERSION} at ${KOKKOS_DIR}")
endif()
step("build" ${CMAKE_COMMAND} --build "${build}")
# Which Kokkos core library the program loads: exactly one, weft's.
if(KOKKOS_CORE_LIB MATCHES "\\.so(\\.|$)")
  step("ldd" ldd "${build}/downstream")
  string(REGEX MATCHALL "[^\n]*kokkoscore[^\n]*" core_libs "${step_output}")
  list(LENGTH core_libs n_core)
  if(NOT n_core EQUAL 1)
    message(FATAL_ERROR "downstream test: the program loads ${n_core} Kokkos core libraries, not one:\n${step_output}")
  endif()
  string(REGEX MATCH "=> ([^ ]+)" _ "${core_libs}")
  file(REAL_PATH "${CMAKE_MATCH_1}" loaded)
  file(REAL_PATH "${KOKKOS_CORE_LIB}" expected)
  if(NOT loaded STREQUAL expected)
    message(FATAL_ERROR "downstream test: the program loads ${loaded}, not weft's Kokkos core library ${expected}")
  endif()
  message(STATUS "downstream test: the program loads weft's Kokkos core library ${expected}")
else()
  message(STATUS "downstream test: Kokkos' core library is static (${KOKKOS_CORE_LIB}); checked through KOKKOS_VERSION only")
endif()
step("run at 2 ranks" ${MPIEXEC} 2 "${build}/downstream")
message(STATUS "${step_output}")
if(NOT step_output MATCHES "all_reduce correct")
  message(FATAL_ERROR "downstream test: the program did not report a correct all_reduce")
endif()
# KOKKOS_VERSION is major * 10000 + minor * 100 + patch.
string(REGEX MATCH "KOKKOS_VERSION ([0-9]+)" _ "${step_output}")
set(program_macro "${CMAKE_MATCH_1}")
string(REGEX MATCHALL "[0-9]+" parts "${KOKKOS_VERSION}")
list(GET parts 0 maj)
list(GET parts 1 min)
list(GET parts 2 pat)
math(EXPR expected_macro "${maj} * 10000 + ${min} * 100 + ${pat}")
if(NOT program_macro EQUAL expected_macro)
  message(FATAL_ERROR "downstream test: the program was compiled with KOKKOS_VERSION '${program_macro}', "
                      "not weft's Kokkos ${KOKKOS_VERSION} (${expected_macro})")
endif()

# A user's model of declared blocks on the toolkit, from the installed package:
# the one-rank run records the curve, the pipelined run must follow it.
if(USER_MODEL_SOURCE)
  set(_um "${build}/user_model")
  set(_um_flags --batch 8 --microbatches 4 --steps 3)
  step("user model at 1 rank" ${MPIEXEC} 1 "${_um}" ${_um_flags} --record "${WORK_DIR}/user_model_ref.json")
  if(NOT step_output MATCHES "step 2 loss [0-9.]+")
    message(FATAL_ERROR "downstream test: the user model did not print its steps:\n${step_output}")
  endif()
  step("user model at 2 ranks, pp=2, zero-bubble" ${MPIEXEC} 2 "${_um}" ${_um_flags} --mesh pp=2 --schedule zb
       --baseline "${WORK_DIR}/user_model_ref.json")
  if(NOT step_output MATCHES "the loss curve follows")
    message(FATAL_ERROR "downstream test: the pipelined user model does not follow its one-rank curve:\n${step_output}")
  endif()
  message(STATUS "downstream test: the user model built against the package follows its one-rank curve at pp=2")
endif()
