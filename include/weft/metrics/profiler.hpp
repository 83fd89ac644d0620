// Wall-clock time by kernel name, for the training-step breakdown that shows
// the next bottleneck. Scopes fence the device at both ends so asynchronous
// backends are charged to the right kernel; with no profiler attached a scope
// costs nothing and fences nothing.
#pragma once

#include <Kokkos_Core.hpp>
#include <chrono>
#include <map>
#include <string>

namespace weft::metrics {

/// Accumulated seconds and call counts per kernel name.
class Profiler {
 public:
  /// Time and calls of one kernel name.
  struct Entry {
    double seconds = 0;
    long calls = 0;
  };

  /// Charges the time from construction to destruction to `name`.
  class Scope {
   public:
    Scope(Profiler* p, const char* name) : p_(p), name_(name) {
      if (p_) {
        Kokkos::fence();
        t0_ = std::chrono::steady_clock::now();
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() {
      if (!p_) return;
      Kokkos::fence();
      auto& e = p_->entries_[name_];
      e.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      e.calls += 1;
    }

   private:
    Profiler* p_;
    const char* name_;
    std::chrono::steady_clock::time_point t0_{};
  };

  /// Per-name totals since the last reset.
  const std::map<std::string, Entry>& entries() const { return entries_; }
  /// Sum of all entries' seconds.
  double total_seconds() const {
    double s = 0;
    for (const auto& [k, e] : entries_) s += e.seconds;
    return s;
  }
  /// Forgets everything (e.g. after warm-up steps).
  void reset() { entries_.clear(); }

 private:
  std::map<std::string, Entry> entries_;
};

}  // namespace weft::metrics
