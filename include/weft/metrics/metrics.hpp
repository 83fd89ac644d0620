// Measurement: kernel timers, Kokkos event counters, memory by category, the
// gemm peak behind MFU, and the JSON writer of run records.
#pragma once

#include <weft/metrics/counters.hpp>
#include <weft/metrics/json.hpp>
#include <weft/metrics/memory.hpp>
#include <weft/metrics/peak.hpp>
#include <weft/metrics/profiler.hpp>
