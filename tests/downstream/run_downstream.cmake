# Run by CTest (cmake -P): installs weft from WEFT_BUILD_DIR into a scratch
# prefix under WORK_DIR, then configures, builds and runs the project in
# SOURCE_DIR against that prefix, at 2 ranks with MPIEXEC (a list: launcher,
# its flags, the rank-count flag). CXX and GENERATOR match weft's build.
foreach(v WEFT_BUILD_DIR SOURCE_DIR WORK_DIR CXX GENERATOR MPIEXEC)
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
     -DCMAKE_CXX_COMPILER=${CXX} "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
string(REGEX MATCH "weft [0-9.]+ found at ([^\n]*)" _ "${step_output}")
file(REAL_PATH "${prefix}" real_prefix)
if(NOT CMAKE_MATCH_1 MATCHES "^${real_prefix}/" AND NOT CMAKE_MATCH_1 MATCHES "^${prefix}/")
  message(FATAL_ERROR "downstream test: weft was found at '${CMAKE_MATCH_1}', not in the scratch prefix ${prefix}")
endif()
step("build" ${CMAKE_COMMAND} --build "${build}")
step("run at 2 ranks" ${MPIEXEC} 2 "${build}/downstream")
message(STATUS "${step_output}")
if(NOT step_output MATCHES "all_reduce correct")
  message(FATAL_ERROR "downstream test: the program did not report a correct all_reduce")
endif()
