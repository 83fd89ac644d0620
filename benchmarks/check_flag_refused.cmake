# Runs CMD with ARGS (a list) and passes when it exits with status 2 (a
# refused flag), prints nothing to stdout (no measurement started) and its
# stderr matches EXPECT.
execute_process(COMMAND ${CMD} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "expected exit status 2, got '${rc}'\nstdout: ${out}\nstderr: ${err}")
endif()
if(NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "stderr does not match '${EXPECT}':\n${err}")
endif()
if(NOT out STREQUAL "")
  message(FATAL_ERROR "a refused flag must stop before any output, but stdout has:\n${out}")
endif()
