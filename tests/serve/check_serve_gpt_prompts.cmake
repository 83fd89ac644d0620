# serve_gpt --prompts and --baseline on the tiniest model:
# - tp 1 with --prompts PROMPTS --record: the record follows the schema, its
#   "prompts" are the file's prompts (read here from the file by the format of
#   docs/serving.md: # and blank lines skipped, a '\r' before the newline
#   dropped, "bytes:" lines byte by byte, other lines token ids) and
#   traffic.prompts_file names the file;
# - tp 2 with --baseline (the tp 1 record): the outputs match, and its record
#   says so;
# - another model (--seed 4) with --baseline: exit 3, the first differing
#   request and token named;
# - fewer prompts, or one prompt changed: refused before any work, naming the
#   counts or the request and token;
# - a bad line at tp 2: one message, naming the line.
#   cmake -DEXE=... -DCHECK=... -DMPIEXEC=... -DSCHEMA=... -DPROMPTS=file -DWORK=dir -P check_serve_gpt_prompts.cmake
file(MAKE_DIRECTORY "${WORK}")
set(model --layers 1 --d-model 16 --heads 2 --seq 32 --vocab 256 --output-len 2-4 --block-size 8 --max-seqs 4
          --prompts)

# run(NAME NP ARGS...): runs serve_gpt on NP ranks, leaving its exit status in rc_NAME and its output in
# out_NAME. NP 0: one rank without mpiexec (MPI's singleton start), for the runs that fail: mpiexec spends
# 2 s more ending a job whose rank exits non-zero.
function(run name np)
  set(launch ${MPIEXEC} -n ${np})
  if(np EQUAL 0)
    set(launch)
  endif()
  execute_process(COMMAND ${launch} ${EXE} ${model} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  set(rc_${name} "${rc}" PARENT_SCOPE)
  set(out_${name} "${out}${err}" PARENT_SCOPE)
  message(STATUS "${name} (exit ${rc}):\n${out}${err}")
endfunction()

function(check_schema path)
  execute_process(COMMAND ${CHECK} --schema ${SCHEMA} "${path}" RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE e)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${path} does not follow the schema:\n${o}\n${e}")
  endif()
endfunction()

# The file's prompts, each as a list "t0,t1,..." in `expected`.
file(READ "${PROMPTS}" text)
string(REPLACE "\n" ";" lines "${text}")
set(expected)
foreach(line IN LISTS lines)
  string(REGEX REPLACE "\r$" "" line "${line}")
  if(line MATCHES "^[ \t]*(#|$)")
    continue()
  endif()
  set(tokens)
  if(line MATCHES "^bytes:(.*)$")
    string(HEX "${CMAKE_MATCH_1}" hex)
    string(LENGTH "${hex}" n)
    math(EXPR last "${n} - 2")
    foreach(k RANGE 0 ${last} 2)
      string(SUBSTRING "${hex}" ${k} 2 byte)
      math(EXPR v "0x${byte}")
      list(APPEND tokens ${v})
    endforeach()
  else()
    string(REGEX REPLACE "[ \t]+" ";" tokens "${line}")
    list(REMOVE_ITEM tokens "")
  endif()
  string(REPLACE ";" "," tokens "${tokens}")
  list(APPEND expected "${tokens}")
endforeach()
list(LENGTH expected nprompts)

run(tp1 1 "${PROMPTS}" --record "${WORK}/tp1.json")
if(NOT rc_tp1 EQUAL 0)
  message(FATAL_ERROR "serve_gpt --prompts failed (${rc_tp1})")
endif()
check_schema("${WORK}/tp1.json")
file(READ "${WORK}/tp1.json" json)
string(JSON n LENGTH "${json}" prompts)
string(JSON m LENGTH "${json}" outputs)
string(JSON file GET "${json}" traffic prompts_file)
string(JSON requests GET "${json}" traffic requests)
if(NOT n EQUAL nprompts OR NOT m EQUAL nprompts OR NOT requests EQUAL nprompts OR NOT file STREQUAL PROMPTS)
  message(FATAL_ERROR "the record has ${n} prompts, ${m} outputs, traffic.requests ${requests} and prompts_file "
                      "'${file}'; expected ${nprompts} (the file's lines) and '${PROMPTS}'")
endif()
math(EXPR lastp "${nprompts} - 1")
foreach(i RANGE ${lastp})
  list(GET expected ${i} want)
  string(JSON k LENGTH "${json}" prompts ${i})
  set(got)
  math(EXPR lastk "${k} - 1")
  foreach(j RANGE ${lastk})
    string(JSON t GET "${json}" prompts ${i} ${j})
    list(APPEND got ${t})
  endforeach()
  string(REPLACE ";" "," got "${got}")
  if(NOT got STREQUAL want)
    message(FATAL_ERROR "request ${i}: the record's prompt is [${got}], the file's [${want}]")
  endif()
endforeach()

# The same requests at tp 2 follow the tp 1 record token for token.
run(tp2 2 "${PROMPTS}" --mesh tp=2 --baseline "${WORK}/tp1.json" --record "${WORK}/tp2.json")
if(NOT rc_tp2 EQUAL 0 OR NOT out_tp2 MATCHES "the outputs match --baseline .*tp1.json: ${nprompts} requests")
  message(FATAL_ERROR "tp 2 against the tp 1 record: exit ${rc_tp2}, expected 0 and the match reported")
endif()
check_schema("${WORK}/tp2.json")
file(READ "${WORK}/tp2.json" json)
string(JSON match GET "${json}" baseline match)
if(NOT match STREQUAL "ON")
  message(FATAL_ERROR "the tp 2 record's baseline.match is ${match}, expected true")
endif()

# Another model's outputs differ: exit 3, naming where.
run(other 0 "${PROMPTS}" --seed 4 --baseline "${WORK}/tp1.json")
if(NOT rc_other EQUAL 3 OR NOT out_other MATCHES "error: the outputs differ from --baseline .*tp1.json at request 0, token [0-9]+: this run")
  message(FATAL_ERROR "--seed 4 against the --seed 1234 record (the default): exit ${rc_other}, expected 3 and the first difference named")
endif()

# Other requests: refused before any work. Token lists "a,b,c" written back as lines "a b c".
function(write_prompts path)
  string(REPLACE ";" "\n" t "${ARGN}")
  string(REPLACE "," " " t "${t}")
  file(WRITE "${path}" "${t}\n")
endfunction()
set(fewer "${expected}")
list(REMOVE_AT fewer ${lastp})
write_prompts("${WORK}/fewer.txt" ${fewer})
run(fewer 0 "${WORK}/fewer.txt" --baseline "${WORK}/tp1.json")
if(NOT rc_fewer EQUAL 2 OR NOT out_fewer MATCHES "error: --baseline .*tp1.json has ${nprompts} requests, this run ${lastp}")
  message(FATAL_ERROR "${lastp} prompts against a record of ${nprompts}: exit ${rc_fewer}, expected 2 and the counts named")
endif()
# Request 1's first token one higher (mod 256).
set(changed "${expected}")
list(GET changed 1 p1)
string(REGEX MATCH "^[0-9]+" t0 "${p1}")
math(EXPR t1 "(${t0} + 1) % 256")
string(REGEX REPLACE "^[0-9]+" "${t1}" p1 "${p1}")
list(REMOVE_AT changed 1)
list(INSERT changed 1 "${p1}")
write_prompts("${WORK}/changed.txt" ${changed})
run(changed 0 "${WORK}/changed.txt" --baseline "${WORK}/tp1.json")
if(NOT rc_changed EQUAL 2 OR NOT out_changed MATCHES "the prompt of request 1 differs at token 0: this run's ${t1}, the baseline's ${t0}")
  message(FATAL_ERROR "a changed prompt: exit ${rc_changed}, expected 2 and the request and token named")
endif()
# A bad line at tp 2: every rank parses the broadcast bytes and fails alike, so the job ends at once with
# the message printed once (no rank left waiting for the others).
file(WRITE "${WORK}/bad.txt" "1 2\n3 x4\n")
run(bad 2 "${WORK}/bad.txt" --mesh tp=2)
string(REGEX MATCHALL "serve_gpt: error:" said "${out_bad}")
list(LENGTH said times)
if(rc_bad EQUAL 0 OR NOT times EQUAL 1 OR NOT out_bad MATCHES "bad.txt line 2: 'x4' is not a token id")
  message(FATAL_ERROR "a bad line at tp 2: exit ${rc_bad}, the message ${times} times; expected a failure naming "
                      "line 2 once")
endif()
