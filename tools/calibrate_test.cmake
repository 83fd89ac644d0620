# The ctests weft_plan.calibrate.* and cluster.calibrate.np4: LAUNCH (a
# ;-list: the launcher and its ranks) runs weft-plan --calibrate OUT/FILE,
# and the file must be a topology that weft-plan plans with, holding sane
# figures: a positive FMA peak, compute efficiency in (0, 1], positive
# memory, bandwidths and latencies, and `hosts` hosts. With HOSTS 1 the link
# across hosts is not measured and takes the figures inside the host; with
# HOSTS 2 both links are measured, and with SLOWER_LINK=ON (two real hosts
# joined by a rate-limited link) the link across hosts must be slower than
# the one inside a host and no faster than RATE_GBS (its rate limit).
# Variables: PLAN, LAUNCH (its words joined by |), OUT, MODEL, HOSTS, INTRA (ON: rank 0 shares its
# host with another rank), SLOWER_LINK (ON/OFF), RATE_GBS (with SLOWER_LINK).
string(REPLACE "|" ";" LAUNCH "${LAUNCH}")
file(MAKE_DIRECTORY ${OUT})
set(file ${OUT}/machine.json)
file(REMOVE ${file})
execute_process(COMMAND ${LAUNCH} ${PLAN} --calibrate ${file} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "weft-plan --calibrate exited with ${rc}")
endif()
file(READ ${file} doc)
foreach(field peak_tflops memory_gb intra_bw_gbs intra_latency_us inter_bw_gbs inter_latency_us compute_efficiency)
  string(JSON v GET "${doc}" ${field})
  if(NOT v GREATER 0)
    message(FATAL_ERROR "${file}: ${field} is ${v}; expected a positive number")
  endif()
  set(${field} ${v})
endforeach()
if(compute_efficiency GREATER 1)
  message(FATAL_ERROR "${file}: compute_efficiency ${compute_efficiency} is above 1")
endif()
string(JSON hosts GET "${doc}" calibration hosts)
string(JSON inter_measured GET "${doc}" calibration inter_measured)
string(JSON intra_measured GET "${doc}" calibration intra_measured)
if(NOT hosts EQUAL HOSTS)
  message(FATAL_ERROR "${file}: ${hosts} host(s); expected ${HOSTS}")
endif()
if(HOSTS EQUAL 1)
  if(inter_measured OR NOT inter_bw_gbs EQUAL intra_bw_gbs)
    message(FATAL_ERROR "${file}: one host, but the link across hosts was measured (${inter_measured}) or differs "
                        "from the one inside (${inter_bw_gbs} against ${intra_bw_gbs} GB/s)")
  endif()
elseif(NOT inter_measured)
  message(FATAL_ERROR "${file}: ${hosts} hosts, but the link across them was not measured")
endif()
if(INTRA AND NOT intra_measured)
  message(FATAL_ERROR "${file}: rank 0 shares its host, but the link inside it was not measured")
endif()
if(NOT INTRA AND intra_measured)
  message(FATAL_ERROR "${file}: rank 0 is alone on its host, but a link inside it was measured")
endif()
if(SLOWER_LINK)
  if(NOT inter_bw_gbs LESS intra_bw_gbs)
    message(FATAL_ERROR "${file}: across hosts ${inter_bw_gbs} GB/s, not slower than inside one (${intra_bw_gbs} GB/s)")
  endif()
  if(inter_bw_gbs GREATER RATE_GBS)
    message(FATAL_ERROR "${file}: across hosts ${inter_bw_gbs} GB/s, above the link's rate limit of ${RATE_GBS} GB/s")
  endif()
endif()
# The planner takes the file as its topology.
execute_process(COMMAND ${PLAN} --model ${MODEL} --gpus 2 --topology ${file} --top 2
                OUTPUT_VARIABLE plan ERROR_VARIABLE plan_err RESULT_VARIABLE rc)
message("${plan}${plan_err}")
if(NOT rc EQUAL 0 OR NOT plan MATCHES "calibrated on")
  message(FATAL_ERROR "weft-plan --topology ${file} exited with ${rc}")
endif()
message("calibrate: ok (${hosts} host(s); inside ${intra_bw_gbs} GB/s, across ${inter_bw_gbs} GB/s)")
