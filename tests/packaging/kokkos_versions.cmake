# Run by CTest (cmake -P): weft refuses a Kokkos Kernels of another version than
# Kokkos' at configure time, and its installed package refuses a Kokkos and a
# Kokkos Kernels of another version than the ones weft was configured with.
# Fake packages of version 9.8.0 in a scratch prefix stand in for the wrong
# ones; a run against the real ones first shows that the projects configure.
foreach(v WEFT_SOURCE_DIR WEFT_BUILD_DIR WORK_DIR CXX GENERATOR KOKKOS_VERSION KOKKOS_DIR KOKKOSKERNELS_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "kokkos_versions.cmake: -D${v}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
set(fake "${WORK_DIR}/fake")

# A standard-looking Kokkos / Kokkos Kernels 9.8.0 config package: the target
# and the version file, nothing else.
function(fake_package name target)
  file(WRITE "${fake}/lib/cmake/${name}/${name}Config.cmake"
       "if(NOT TARGET ${target})\n  add_library(${target} INTERFACE IMPORTED)\nendif()\n")
  file(WRITE "${fake}/lib/cmake/${name}/${name}ConfigVersion.cmake"
       "set(PACKAGE_VERSION 9.8.0)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
endfunction()
fake_package(Kokkos Kokkos::kokkos)
fake_package(KokkosKernels Kokkos::kokkoskernels)

# configure(NAME SOURCE_DIR EXPECT_OK|EXPECT_FAIL REGEX args...): configures a
# project and checks the outcome; a failure must print REGEX.
function(configure name src expect regex)
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${src}" -B "${WORK_DIR}/${name}" -G "${GENERATOR}"
                          -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \t]*\n[ \t]*" " " flat "${out}")  # CMake wraps long messages
  if(expect STREQUAL "EXPECT_OK" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "kokkos_versions: ${name} should configure but failed (${rc}):\n${out}")
  elseif(expect STREQUAL "EXPECT_FAIL" AND rc EQUAL 0)
    message(FATAL_ERROR "kokkos_versions: ${name} should have been refused but configured:\n${out}")
  elseif(expect STREQUAL "EXPECT_FAIL" AND NOT flat MATCHES "${regex}")
    message(FATAL_ERROR "kokkos_versions: ${name} was refused without the expected message /${regex}/:\n${out}")
  endif()
  message(STATUS "kokkos_versions: ${name}: ok")
endfunction()

# 1. Configure time: a project that finds its dependencies the way weft does.
set(deps "${WORK_DIR}/deps_src")
file(WRITE "${deps}/CMakeLists.txt"
     "cmake_minimum_required(VERSION 3.23)\nproject(deps LANGUAGES CXX)\n"
     "include(\"${WEFT_SOURCE_DIR}/cmake/weftFindDependencies.cmake\")\n")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" k_mm "${KOKKOS_VERSION}")
string(REPLACE "." "\\." k_mm_re "${k_mm}")
configure(deps_matching "${deps}" EXPECT_OK "" -DKokkos_DIR=${KOKKOS_DIR} -DKokkosKernels_DIR=${KOKKOSKERNELS_DIR})
configure(deps_mismatched_kernels "${deps}" EXPECT_FAIL
          "Kokkos Kernels 9\\.8\\.0 \\(at [^)]*fake[^)]*\\) does not match Kokkos ${k_mm_re}[.0-9]* \\(at "
          -DKokkos_DIR=${KOKKOS_DIR} -DKokkosKernels_DIR=${fake}/lib/cmake/KokkosKernels)

# 2. The installed package: it records weft's Kokkos and refuses another version.
set(prefix "${WORK_DIR}/prefix")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${WEFT_BUILD_DIR}" --prefix "${prefix}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kokkos_versions: cmake --install failed (${rc}):\n${out}")
endif()
file(GLOB_RECURSE config "${prefix}/*/weftConfig.cmake")
file(READ "${config}" text)
string(REPLACE "." "\\." kv_re "${KOKKOS_VERSION}")
if(NOT text MATCHES "set\\(weft_KOKKOS_VERSION \"${kv_re}\"\\)" OR NOT text MATCHES "set\\(weft_KOKKOS_DIR \"${KOKKOS_DIR}\"\\)"
   OR NOT text MATCHES "set\\(weft_KOKKOSKERNELS_DIR \"${KOKKOSKERNELS_DIR}\"\\)")
  message(FATAL_ERROR "kokkos_versions: ${config} does not record Kokkos ${KOKKOS_VERSION} at ${KOKKOS_DIR} "
                      "and Kokkos Kernels at ${KOKKOSKERNELS_DIR}")
endif()
set(user "${WORK_DIR}/user_src")
file(WRITE "${user}/CMakeLists.txt"
     "cmake_minimum_required(VERSION 3.23)\nproject(user LANGUAGES CXX)\nfind_package(weft REQUIRED)\n"
     "message(STATUS \"user: Kokkos \${Kokkos_VERSION} at \${Kokkos_DIR}\")\n")
configure(installed_default "${user}" EXPECT_OK "" -DCMAKE_PREFIX_PATH=${prefix})
configure(installed_other_kokkos "${user}" EXPECT_FAIL
          "configured with Kokkos ${kv_re} .*but this project found Kokkos 9\\.8\\.0 \\([^)]*fake"
          -DCMAKE_PREFIX_PATH=${prefix} -DKokkos_DIR=${fake}/lib/cmake/Kokkos -DKokkosKernels_DIR=${fake}/lib/cmake/KokkosKernels)
