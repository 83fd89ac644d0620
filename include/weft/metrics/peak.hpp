// The yardstick of MFU: the best single-precision gemm rate this process
// reaches through Kokkos Kernels right now, at its current BLAS thread count,
// measured by wall time and by process CPU time.
#pragma once

#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <vector>

#include <weft/ops/gemm.hpp>

namespace weft::metrics {

/// CPU seconds used by this process so far (all its threads).
inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// FLOP/s by wall-clock time and by CPU time (the two differ when other jobs
/// share the cores: CPU time leaves out the waits for a core).
struct Rate {
  double wall = 0;
  double cpu = 0;
};

/// Best rate over `reps` runs (after one warm-up) of float gemms
/// C[m, n] = A[m, k] B[k, n] for each {m, n, k} in shapes; the maximum over shapes.
template <class Space = Kokkos::DefaultExecutionSpace>
Rate measure_sgemm_peak(const std::vector<std::array<std::size_t, 3>>& shapes, int reps = 5) {
  Rate out;
  for (const auto& [m, n, k] : shapes) {
    ops::Matrix<float, Space> A("peak.A", m, k), B("peak.B", k, n), C("peak.C", m, n);
    Kokkos::deep_copy(A, 0.5f);
    Kokkos::deep_copy(B, 0.25f);
    double wall = 1e30, cpu = 1e30;
    for (int r = 0; r <= reps; ++r) {
      Kokkos::fence();
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = process_cpu_seconds();
      ops::gemm(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 0.0f, C);
      Kokkos::fence();
      if (r == 0) continue;
      wall = std::min(wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      cpu = std::min(cpu, process_cpu_seconds() - c0);
    }
    const double flop = 2.0 * double(m) * double(n) * double(k);
    out.wall = std::max(out.wall, flop / wall);
    out.cpu = std::max(out.cpu, cpu > 0 ? flop / cpu : 0.0);
  }
  return out;
}

}  // namespace weft::metrics
