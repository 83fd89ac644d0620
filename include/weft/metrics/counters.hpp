// Kernel launches, fences, deep copies and allocations, counted through
// Kokkos' tools callbacks, so that a step's synchronisations and kernels are
// visible (and testable) on every backend, the CPU's included.
#pragma once

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include <weft/metrics/json.hpp>

namespace weft::metrics {

/// Whether this Kokkos reports fences to tools (3.5 and later; before, a
/// fence count is always 0).
inline constexpr bool kokkos_reports_fences =
#if KOKKOS_VERSION >= 30500
    true;
#else
    false;
#endif

/// A snapshot of the counters (or the difference of two: a region's counts).
struct KernelCounts {
  std::int64_t parallel_for = 0;     ///< parallel_for launches (View initialisation and fills included)
  std::int64_t parallel_reduce = 0;  ///< parallel_reduce launches
  std::int64_t parallel_scan = 0;    ///< parallel_scan launches
  std::int64_t fences = 0;           ///< fences Kokkos reported (none before Kokkos 3.5: see fences_reported)
  std::int64_t copies_host_device = 0;  ///< deep copies between memory spaces, or of a mirror onto itself
  std::int64_t copies_same_space = 0;   ///< deep copies within one memory space
  std::int64_t fills = 0;            ///< deep_copy(view, value)
  std::int64_t allocations = 0;      ///< allocations through Kokkos (View constructions, scratch)
  std::int64_t allocated_bytes = 0;  ///< their bytes
  /// Events by "kind:label" (for:, reduce:, scan:, fence:, copy:<dst> <- <src>,
  /// alloc:), kept only while labels are on (KernelCounters::install(true)).
  std::map<std::string, std::int64_t> labels;

  /// Kernel launches of the three kinds.
  std::int64_t kernels() const { return parallel_for + parallel_reduce + parallel_scan; }
  /// Deep copies of both kinds (fills not included).
  std::int64_t deep_copies() const { return copies_host_device + copies_same_space; }

  /// The events of `kind` ("for", "fence", ...) with their counts, one
  /// "label x count" per line: what a failing test prints.
  std::string labels_of(const std::string& kind) const {
    std::ostringstream s;
    const std::string prefix = kind + ":";
    for (const auto& [k, n] : labels)
      if (k.compare(0, prefix.size(), prefix) == 0) s << "  " << k.substr(prefix.size()) << " x" << n << "\n";
    return s.str();
  }

  /// One line: "kernels K (for F, reduce R, scan S), fences N, ...", with a
  /// note when this Kokkos reports no fences.
  std::string summary() const {
    std::ostringstream s;
    s << "kernels " << kernels() << " (for " << parallel_for << ", reduce " << parallel_reduce << ", scan "
      << parallel_scan << "), fences " << fences << ", deep copies host<->device " << copies_host_device
      << ", same-space " << copies_same_space << ", fills " << fills << ", allocations " << allocations << " ("
      << allocated_bytes << " bytes)" << (kokkos_reports_fences ? "" : " (this Kokkos reports no fences)");
    return s.str();
  }
};

namespace detail {
/// A pointer to one count of KernelCounts (an alias: nvcc's host pass
/// rewrites the plain declarator into one g++ warns about).
using CountMember = std::int64_t KernelCounts::*;
/// Every count of KernelCounts with its name in a run record, in record order.
struct CountField {
  const char* name;
  CountMember member;
};
inline constexpr CountField count_fields[] = {
    {"parallel_for", &KernelCounts::parallel_for},
    {"parallel_reduce", &KernelCounts::parallel_reduce},
    {"parallel_scan", &KernelCounts::parallel_scan},
    {"fences", &KernelCounts::fences},
    {"deep_copies_host_device", &KernelCounts::copies_host_device},
    {"deep_copies_same_space", &KernelCounts::copies_same_space},
    {"fills", &KernelCounts::fills},
    {"allocations", &KernelCounts::allocations},
    {"allocated_bytes", &KernelCounts::allocated_bytes}};
}  // namespace detail

/// The counts of the region between `earlier` and `later` (labels too).
inline KernelCounts operator-(const KernelCounts& later, const KernelCounts& earlier) {
  KernelCounts d;
  for (const auto& f : detail::count_fields) d.*f.member = later.*f.member - earlier.*f.member;
  for (const auto& [k, n] : later.labels) {
    const auto it = earlier.labels.find(k);
    const std::int64_t e = it == earlier.labels.end() ? 0 : it->second;
    if (n != e) d.labels[k] = n - e;
  }
  return d;
}

/// The most of each count of two regions (labels dropped): the worst of
/// several steps.
inline KernelCounts max_of(const KernelCounts& a, const KernelCounts& b) {
  KernelCounts m;
  for (const auto& f : detail::count_fields) m.*f.member = std::max(a.*f.member, b.*f.member);
  return m;
}

/// The counts as a run record's object (docs/records.md, "counters"):
/// "kernels" first, then every count.
inline Json to_json(const KernelCounts& c) {
  Json j = Json::object().set("kernels", Json(long(c.kernels())));
  for (const auto& f : detail::count_fields) j.set(f.name, Json(long(c.*f.member)));
  return j;
}

namespace detail {

/// The process-wide tallies the callbacks add to, and the callbacks that were
/// there before ours (a KOKKOS_TOOLS_LIBS tool's), which ours call on.
struct CounterState {
  // One tally per entry of count_fields, in its order.
  std::atomic<std::int64_t> tally[std::size(count_fields)] = {};
  std::atomic<bool> by_label{false};
  std::mutex label_mutex;
  std::map<std::string, std::int64_t> labels;
  bool installed = false;
  Kokkos::Tools::beginFunction prev_for = nullptr, prev_reduce = nullptr, prev_scan = nullptr;
  Kokkos::Tools::beginFenceFunction prev_fence = nullptr;
  Kokkos::Tools::beginDeepCopyFunction prev_copy = nullptr;
  Kokkos::Tools::allocateDataFunction prev_alloc = nullptr;
};

inline CounterState& counter_state() {
  static CounterState s;
  return s;
}

// Adds n to the tally of KernelCounts::*member.
inline void add(CounterState& s, CountMember member, std::int64_t n = 1) {
  for (std::size_t i = 0; i < std::size(count_fields); ++i)
    if (count_fields[i].member == member) s.tally[i].fetch_add(n, std::memory_order_relaxed);
}

inline void count_label(CounterState& s, const char* kind, const char* label) {
  if (!s.by_label.load(std::memory_order_relaxed)) return;
  std::string key = std::string(kind) + ":" + (label ? label : "");
  const std::lock_guard<std::mutex> lock(s.label_mutex);
  ++s.labels[key];
}

inline void on_begin_for(const char* name, std::uint32_t dev, std::uint64_t* id) {
  auto& s = counter_state();
  add(s, &KernelCounts::parallel_for);
  count_label(s, "for", name);
  if (s.prev_for) s.prev_for(name, dev, id);
}
inline void on_begin_reduce(const char* name, std::uint32_t dev, std::uint64_t* id) {
  auto& s = counter_state();
  add(s, &KernelCounts::parallel_reduce);
  count_label(s, "reduce", name);
  if (s.prev_reduce) s.prev_reduce(name, dev, id);
}
inline void on_begin_scan(const char* name, std::uint32_t dev, std::uint64_t* id) {
  auto& s = counter_state();
  add(s, &KernelCounts::parallel_scan);
  count_label(s, "scan", name);
  if (s.prev_scan) s.prev_scan(name, dev, id);
}
// Kokkos 4 fences the device before every callback of a loaded tool, under
// this name; those fences exist only because a tool is listening, so they are
// not the program's and are not counted.
inline bool is_tool_fence(const char* name) {
  return name && std::strstr(name, "Kokkos::Tools::invoke_kokkosp_callback") != nullptr;
}
inline void on_begin_fence(const char* name, std::uint32_t dev, std::uint64_t* id) {
  auto& s = counter_state();
  if (!is_tool_fence(name)) {
    add(s, &KernelCounts::fences);
    count_label(s, "fence", name);
  }
  if (s.prev_fence) s.prev_fence(name, dev, id);
}
inline void on_begin_deep_copy(Kokkos::Tools::SpaceHandle dst_space, const char* dst_label, const void* dst,
                               Kokkos::Tools::SpaceHandle src_space, const char* src_label, const void* src,
                               std::uint64_t bytes) {
  auto& s = counter_state();
  // deep_copy(view, value) reports a host "Scalar" source: a fill, a kernel
  // on the destination's space, not a transfer.
  if (src_label && std::strcmp(src_label, "Scalar") == 0) {
    add(s, &KernelCounts::fills);
    count_label(s, "fill", dst_label);
  } else {
    // A copy between two spaces crosses the host-device link; so does a
    // mirror copied onto itself (create_mirror_view on a host backend gives
    // the same allocation), which is a transfer on a device backend.
    const bool crossing = std::strncmp(dst_space.name, src_space.name, sizeof(dst_space.name)) != 0 || dst == src;
    add(s, crossing ? &KernelCounts::copies_host_device : &KernelCounts::copies_same_space);
    if (s.by_label.load(std::memory_order_relaxed)) {
      const std::string what = std::string(dst_label ? dst_label : "") + " <- " + (src_label ? src_label : "");
      count_label(s, crossing ? "copy_host_device" : "copy_same_space", what.c_str());
    }
  }
  if (s.prev_copy) s.prev_copy(dst_space, dst_label, dst, src_space, src_label, src, bytes);
}
inline void on_allocate(Kokkos::Tools::SpaceHandle space, const char* label, const void* ptr, std::uint64_t bytes) {
  auto& s = counter_state();
  add(s, &KernelCounts::allocations);
  add(s, &KernelCounts::allocated_bytes, std::int64_t(bytes));
  count_label(s, "alloc", label);
  if (s.prev_alloc) s.prev_alloc(space, label, ptr, bytes);
}

}  // namespace detail

/// Process-wide counters of Kokkos events, fed by Kokkos' tools callbacks.
///
/// Nothing is counted, and nothing costs, until install(): Kokkos calls no
/// callback while none is set. install() (after Kokkos is initialised, e.g.
/// after weft::Environment) sets the begin callbacks of parallel_for, reduce,
/// scan, fence and deep_copy and the allocation callback; uninstall() puts
/// back what was there. A tool loaded through KOKKOS_TOOLS_LIBS (or set by the
/// program) before install() keeps working: its callbacks are saved and
/// called on from ours, with the same arguments. A tool that sets callbacks
/// after install() replaces ours, and the counts stop.
///
/// Threads: Kokkos calls the callbacks on the host thread that launches the
/// kernel, fence or copy. The tallies are relaxed atomics and the label map
/// is locked, so launches from several host threads are all counted, but a
/// region's difference (snapshot() before and after) then includes what other
/// threads launched meanwhile.
///
/// What differs between Kokkos versions and backends:
///  - Kokkos before 3.5 reports no fences (fences_reported() is false);
///    Kokkos 4 also reports its own internal fences (in deep_copy, in a
///    reduction into a host value), each is counted.
///  - With a callback set, Kokkos fences the device before each reported
///    kernel (Kokkos 3) or each callback (Kokkos 4, under the tool-fence name,
///    not counted): on a device backend, timings taken while counting are
///    slower than without.
///  - On a host backend a mirror view is the view itself: its deep_copy is
///    counted host<->device (same allocation), but create_mirror_view_and_copy
///    does no copy at all there, so it is missing from the host counts.
class KernelCounters {
 public:
  /// Sets the callbacks (once; a second call can only turn labels on).
  /// by_label: also count events by label (a map update per event).
  static void install(bool by_label = false) {
    auto& s = detail::counter_state();
    if (by_label) s.by_label.store(true, std::memory_order_relaxed);
    if (s.installed) return;
    namespace E = Kokkos::Tools::Experimental;
    const E::EventSet prev = E::get_callbacks();
    s.prev_for = prev.begin_parallel_for;
    s.prev_reduce = prev.begin_parallel_reduce;
    s.prev_scan = prev.begin_parallel_scan;
    s.prev_fence = prev.begin_fence;
    s.prev_copy = prev.begin_deep_copy;
    s.prev_alloc = prev.allocate_data;
    E::set_begin_parallel_for_callback(&detail::on_begin_for);
    E::set_begin_parallel_reduce_callback(&detail::on_begin_reduce);
    E::set_begin_parallel_scan_callback(&detail::on_begin_scan);
    E::set_begin_fence_callback(&detail::on_begin_fence);
    E::set_begin_deep_copy_callback(&detail::on_begin_deep_copy);
    E::set_allocate_data_callback(&detail::on_allocate);
    s.installed = true;
  }

  /// Puts back the callbacks install() found; the tallies stay.
  static void uninstall() {
    auto& s = detail::counter_state();
    if (!s.installed) return;
    namespace E = Kokkos::Tools::Experimental;
    E::set_begin_parallel_for_callback(s.prev_for);
    E::set_begin_parallel_reduce_callback(s.prev_reduce);
    E::set_begin_parallel_scan_callback(s.prev_scan);
    E::set_begin_fence_callback(s.prev_fence);
    E::set_begin_deep_copy_callback(s.prev_copy);
    E::set_allocate_data_callback(s.prev_alloc);
    s.installed = false;
  }

  static bool installed() { return detail::counter_state().installed; }

  /// Whether this Kokkos reports fences to tools (3.5 and later).
  static constexpr bool fences_reported() { return kokkos_reports_fences; }

  /// The tallies since the program started counting.
  static KernelCounts snapshot() {
    auto& s = detail::counter_state();
    KernelCounts c;
    for (std::size_t i = 0; i < std::size(detail::count_fields); ++i)
      c.*detail::count_fields[i].member = s.tally[i].load(std::memory_order_relaxed);
    if (s.by_label.load(std::memory_order_relaxed)) {
      const std::lock_guard<std::mutex> lock(s.label_mutex);
      c.labels = s.labels;
    }
    return c;
  }
};

/// The counts of a region: snapshot at construction, difference on counts().
/// Installs the counters if they are not (and leaves them installed).
class CountedRegion {
 public:
  explicit CountedRegion(bool by_label = false) {
    KernelCounters::install(by_label);
    start_ = KernelCounters::snapshot();
  }
  /// What was counted since construction.
  KernelCounts counts() const { return KernelCounters::snapshot() - start_; }

 private:
  KernelCounts start_;
};

}  // namespace weft::metrics
