# The ctest weft_plan.run_top_json.np2: weft-plan --run-top --json writes one
# JSON document (stdout to a file), which must be valid against
# docs/schema/run_top.schema.json and hold at least one measured run with a
# positive step time and the six predicted memory categories. It trains every
# layout the planner ranks (--run-top 1000), and train_gpt must accept each
# one: a layout skipped because "train_gpt refuses" fails the test (only
# layouts that do not fit in memory may be skipped).
# Variables: PLAN, CHECK, SCHEMA, MODEL, TOPOLOGY, LAUNCHER, OUT.
file(MAKE_DIRECTORY ${OUT})
execute_process(COMMAND ${PLAN} --model ${MODEL} --gpus 2 --topology ${TOPOLOGY} --run-top 1000 --steps 2
                        --launcher "${LAUNCHER}" --workdir ${OUT} --json
                OUTPUT_FILE ${OUT}/run_top.json ERROR_VARIABLE progress RESULT_VARIABLE rc)
message("${progress}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "weft-plan --run-top --json exited with ${rc}")
endif()
execute_process(COMMAND ${CHECK} --schema ${SCHEMA} ${OUT}/run_top.json OUTPUT_VARIABLE verdict RESULT_VARIABLE rc)
message("${verdict}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "run_top.json does not follow ${SCHEMA}")
endif()
file(READ ${OUT}/run_top.json doc)
string(JSON runs LENGTH "${doc}" runs)
if(runs LESS 1)
  message(FATAL_ERROR "run_top.json has no measured run")
endif()
math(EXPR last "${runs} - 1")
foreach(i RANGE ${last})
  string(JSON mesh GET "${doc}" runs ${i} mesh)
  string(JSON meas GET "${doc}" runs ${i} measured step_s)
  string(JSON pred GET "${doc}" runs ${i} predicted step_s)
  string(JSON ratio GET "${doc}" runs ${i} measured_over_predicted step_s)
  if(NOT meas GREATER 0 OR NOT pred GREATER 0)
    message(FATAL_ERROR "run ${i} (${mesh}): step times must be positive, measured ${meas} predicted ${pred}")
  endif()
  message("run ${mesh}: measured ${meas} s, predicted ${pred} s, ratio ${ratio}")
endforeach()
string(JSON skipped LENGTH "${doc}" skipped)
if(skipped GREATER 0)
  math(EXPR last "${skipped} - 1")
  foreach(i RANGE ${last})
    string(JSON mesh GET "${doc}" skipped ${i} mesh)
    string(JSON reason GET "${doc}" skipped ${i} reason)
    if(reason MATCHES "train_gpt refuses")
      message(FATAL_ERROR "the planner ranks ${mesh}, which train_gpt cannot run: ${reason}")
    endif()
    message("skipped ${mesh}: ${reason}")
  endforeach()
endif()
string(JSON fastest GET "${doc}" fastest_measured mesh)
message("run-top json: ${runs} runs, ${skipped} skipped, fastest measured ${fastest}")
