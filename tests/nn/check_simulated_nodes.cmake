# Runs train_gpt on simulated nodes (WEFT_TEST_RANKS_PER_NODE, set by CTest)
# and checks what depends on node boundaries: the loss curve follows the
# one-process baseline (--compare), the BLAS threads are chosen for the
# ranks of one simulated node, and the record's topology has NODES hosts and
# RANKS_PER_NODE ranks per node.
#   cmake "-DCMD=mpiexec|...|train_gpt|args" -DRECORD=file -DNODES=n -DRANKS_PER_NODE=k -P check_simulated_nodes.cmake
string(REPLACE "|" ";" cmd "${CMD}")
execute_process(COMMAND ${cmd} --record "${RECORD}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "train_gpt failed (${rc}):\n${out}\n${err}")
endif()
foreach(re "the loss curve follows" "BLAS threads [0-9]+ \\([0-9]+ cores / \\(${RANKS_PER_NODE} ranks on this node x [0-9]+ Kokkos host threads per rank\\)\\)")
  if(NOT out MATCHES "${re}")
    message(FATAL_ERROR "the output does not match /${re}/:\n${out}\n${err}")
  endif()
endforeach()
file(READ "${RECORD}" json)
string(JSON hosts GET "${json}" topology host_count)
string(JSON per_node GET "${json}" topology ranks_per_node)
string(JSON blas GET "${json}" runtime ranks_per_node)
if(NOT hosts EQUAL NODES OR NOT per_node EQUAL RANKS_PER_NODE OR NOT blas EQUAL RANKS_PER_NODE)
  message(FATAL_ERROR "the record's topology has host_count ${hosts} and ranks_per_node ${per_node} (runtime: ${blas}); "
                      "expected ${NODES} and ${RANKS_PER_NODE}")
endif()
message(STATUS "${NODES} simulated nodes of ${RANKS_PER_NODE} ranks: the loss curve follows the baseline")
