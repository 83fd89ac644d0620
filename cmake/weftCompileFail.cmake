# Run by CTest (cmake -P): builds TARGET in BUILD_DIR, which must FAIL, with
# compiler output matching REGEX. With FIRST_ERROR, the first line of the
# output that contains "error:" (the compiler's first diagnostic: g++ writes
# "error: static assertion failed: <message>", clang "error: static_assert
# failed due to requirement '...' "<message>"", both on one line) must match
# it too, so that a message is not only present but the one the user reads
# first. Either way the output is shown on failure.
#
# With Ninja (NINJA set), the test asks Ninja for the target's compile command
# (`ninja -t commands`, which only reads build.ninja) and runs it itself, so
# that compile-fail tests run in parallel: two Ninja processes must never build
# in one tree at the same time, but two compilers writing different objects
# may. Otherwise it builds the target through the build tool, and the tests
# are serialised on the tree (RESOURCE_LOCK, see weftTesting.cmake).
if(DEFINED NINJA AND NOT NINJA STREQUAL "")
  execute_process(COMMAND ${NINJA} -C ${BUILD_DIR} -t commands ${TARGET}
                  RESULT_VARIABLE qrc OUTPUT_VARIABLE cmds ERROR_VARIABLE qerr)
  if(NOT qrc EQUAL 0 OR cmds STREQUAL "")
    message(FATAL_ERROR "compile-fail test: Ninja gave no command for ${TARGET} in ${BUILD_DIR}:\n${qerr}")
  endif()
  string(REGEX REPLACE "\n$" "" cmds "${cmds}")
  string(REPLACE "\n" ";" cmds "${cmds}")
  set(rc 0)
  set(out "")
  set(err "")
  foreach(cmd IN LISTS cmds)
    execute_process(COMMAND sh -c "${cmd}" WORKING_DIRECTORY ${BUILD_DIR}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE e)
    string(APPEND out "${o}")
    string(APPEND err "${e}")
    if(NOT rc EQUAL 0)
      break()
    endif()
  endforeach()
else()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
endif()
set(all "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "compile-fail test: ${TARGET} compiled, but it must not compile.\n${all}")
endif()
string(REGEX MATCH "${REGEX}" found "${all}")
if(NOT found)
  message(FATAL_ERROR "compile-fail test: ${TARGET} failed to compile as it must, but the output does not contain the expected message /${REGEX}/:\n${all}")
endif()
if(DEFINED FIRST_ERROR AND NOT FIRST_ERROR STREQUAL "")
  string(REGEX MATCH "[^\n]*error:[^\n]*" first "${all}")
  if(NOT first)
    message(FATAL_ERROR "compile-fail test: ${TARGET} failed to compile, but no line of the output contains 'error:':\n${all}")
  endif()
  string(REGEX MATCH "${FIRST_ERROR}" found_first "${first}")
  if(NOT found_first)
    message(FATAL_ERROR "compile-fail test: ${TARGET} failed to compile with the expected message, but the first error does not match /${FIRST_ERROR}/; it is:\n${first}\n\nThe whole output:\n${all}")
  endif()
  message(STATUS "compile-fail test: ${TARGET} does not compile, says /${REGEX}/, and its first error matches /${FIRST_ERROR}/")
else()
  message(STATUS "compile-fail test: ${TARGET} does not compile, and says /${REGEX}/")
endif()
