// Small helpers of measurement that several floors share: the median of a
// set of samples (the run loop's steady step time, the planner's
// calibration) and the memory this host can still give (MemAvailable: the
// programs' default per-rank memory limit, the calibration's memory_gb).
#pragma once

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace weft {

/// The median of `v` (the mean of the two middle values for an even count;
/// 0 for none).
inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// MemAvailable of /proc/meminfo in bytes: the memory the kernel estimates
/// it can give to new allocations without swapping. nullopt where the file
/// or the line cannot be read (not Linux, a restricted /proc).
inline std::optional<double> mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, rest;
  double kb = 0;
  while (f >> key >> kb) {
    std::getline(f, rest);  // the unit, or nothing (HugePages_Total: 0)
    if (key == "MemAvailable:") return kb * 1024.0;
  }
  return std::nullopt;
}

}  // namespace weft
