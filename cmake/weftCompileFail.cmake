# Run by CTest (cmake -P): builds TARGET in BUILD_DIR, which must FAIL, with
# compiler output matching REGEX. Either way the output is shown on failure.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "compile-fail test: ${TARGET} compiled, but it must not compile.\n${all}")
endif()
string(REGEX MATCH "${REGEX}" found "${all}")
if(NOT found)
  message(FATAL_ERROR "compile-fail test: ${TARGET} failed to compile as it must, but the output does not contain the expected message /${REGEX}/:\n${all}")
endif()
message(STATUS "compile-fail test: ${TARGET} does not compile, and says /${REGEX}/")
