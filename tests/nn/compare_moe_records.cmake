# Compares the routing statistics of two train_gpt run records (the "moe"
# object): the per-step dropped slots and the smallest and largest tokens per
# expert must be equal, step for step. Two layouts of the same model that
# route alike (docs/moe.md) pass; a layout whose statistics miss a stage's
# blocks, or count a block twice, fails.
#   cmake -DREFERENCE=ref.json -DRECORD=run.json -P compare_moe_records.cmake
foreach(v REFERENCE RECORD)
  if(NOT EXISTS "${${v}}")
    message(FATAL_ERROR "compare_moe_records: ${v} '${${v}}' does not exist")
  endif()
  file(READ "${${v}}" _json_${v})
endforeach()
set(_checked 0)
foreach(key dropped_slots tokens_per_expert_min tokens_per_expert_max)
  string(JSON _na LENGTH "${_json_REFERENCE}" moe ${key})
  string(JSON _nb LENGTH "${_json_RECORD}" moe ${key})
  if(NOT _na EQUAL _nb)
    message(FATAL_ERROR "compare_moe_records: moe.${key} has ${_na} steps in ${REFERENCE} but ${_nb} in ${RECORD}")
  endif()
  math(EXPR _last "${_na} - 1")
  foreach(i RANGE 0 ${_last})
    string(JSON a GET "${_json_REFERENCE}" moe ${key} ${i})
    string(JSON b GET "${_json_RECORD}" moe ${key} ${i})
    if(NOT a EQUAL b)
      message(FATAL_ERROR "compare_moe_records: moe.${key}[${i}] is ${a} in ${REFERENCE} but ${b} in ${RECORD}")
    endif()
    math(EXPR _checked "${_checked} + 1")
  endforeach()
endforeach()
message(STATUS "compare_moe_records: ${_checked} routing statistics equal")
