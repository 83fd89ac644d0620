// Allocation failures as weft errors: a Kokkos view that cannot be allocated
// becomes weft::AllocationError naming the tensor, its size and the memory
// space, instead of Kokkos' runtime_error escaping through MPI_Abort.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>

namespace weft {

/// A tensor that could not be allocated: its label, its size in bytes (0
/// when unknown) and the memory space; the message adds what the allocator
/// said and what to try.
class AllocationError : public Error {
 public:
  AllocationError(std::string label, std::size_t bytes, std::string space, const std::string& what)
      : Error(what), label_(std::move(label)), bytes_(bytes), space_(std::move(space)) {}
  /// The tensor's label, e.g. "weft::dp.group_buffer".
  const std::string& label() const noexcept { return label_; }
  /// Bytes asked for (0: not known).
  std::size_t bytes() const noexcept { return bytes_; }
  /// The Kokkos memory space's name, e.g. "Host" (Kokkos::HostSpace::name()).
  const std::string& space() const noexcept { return space_; }

 private:
  std::string label_;
  std::size_t bytes_;
  std::string space_;
};

namespace detail {
inline std::string byte_figure(std::size_t bytes) {
  char buf[64];
  if (bytes >= (std::size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%zu bytes (%.2f GiB)", bytes, double(bytes) / 1073741824.0);
  else std::snprintf(buf, sizeof buf, "%zu bytes (%.1f MiB)", bytes, double(bytes) / 1048576.0);
  return buf;
}

inline AllocationError allocation_error(const std::string& label, std::size_t bytes, const std::string& space,
                                        const std::string& cause, bool approximate = false) {
  std::string size = bytes ? (approximate ? " of about " : " of ") + byte_figure(bytes) : std::string();
  return AllocationError(label, bytes, space,
                         "cannot allocate tensor \"" + label + "\"" + size + " in " + space + ": " + cause +
                             "; this rank needs more memory than it has: use fewer ranks per node, a smaller model, "
                             "batch or sequence, or a mode that shards more");
}
}  // namespace detail

/// A view of type V labelled `label` with the given extents (initialised as
/// Kokkos initialises); a failed allocation throws AllocationError naming it.
template <class V, class... Extents>
V allocate_view(const std::string& label, Extents... extents) {
  try {
    return V(Kokkos::view_alloc(label), extents...);
  } catch (const std::exception& e) {
    const std::size_t bytes = (std::size_t(1) * ... * std::size_t(extents)) * sizeof(typename V::value_type);
    throw detail::allocation_error(label, bytes, V::memory_space::name(), e.what());
  }
}

/// Output storage that a layer hands out again once nobody else holds it.
///
/// take(label, e0, e1, ...) returns a view of type V with those extents. It
/// is one the pool made earlier when one of them has the same extents and
/// is held by the pool alone (V::use_count() == 1: every DistView, copy or
/// subview a caller kept of it has gone); otherwise it is a new view,
/// allocated without initialisation (the caller overwrites every element)
/// through allocate's AllocationError. A new view is kept for later calls
/// while the pool holds fewer than `capacity`, or in place of a kept view of
/// other extents that nobody holds; past that it is not kept, so a caller
/// that holds many outputs at once (a pipeline's microbatches in flight)
/// gets fresh storage for each and nothing is overwritten that is still in
/// use. A reused view keeps the values of its last use: take() is for
/// outputs that the caller overwrites completely. An unmanaged view or raw
/// pointer made from a returned view does not count as holding it.
/// Not thread-safe: one pool per layer, called from one thread.
template <class V>
class ViewRecycler {
 public:
  /// How many views a pool keeps unless told otherwise.
  static constexpr std::size_t default_capacity = 4;

  /// A pool that keeps at most `capacity` views (0: it keeps none, and every
  /// take() allocates).
  explicit ViewRecycler(std::size_t capacity = default_capacity) : capacity_(capacity) {}

  /// A view of the given extents: a kept one that nobody holds, or a new one
  /// (see the class comment).
  template <class... E>
  V take(const std::string& label, E... extents) {
    static_assert(sizeof...(E) == V::rank, "weft::ViewRecycler::take: give one extent per dimension of the view");
    const std::size_t want[] = {std::size_t(extents)...};
    auto same_shape = [&](const V& v) {
      for (std::size_t d = 0; d < sizeof...(E); ++d)
        if (v.extent(d) != want[d]) return false;
      return true;
    };
    for (const V& v : kept_)
      if (v.use_count() == 1 && same_shape(v)) {
        ++reused_;
        return v;
      }
    V fresh;
    try {
      fresh = V(Kokkos::view_alloc(label, Kokkos::WithoutInitializing), extents...);
    } catch (const std::exception& e) {
      const std::size_t bytes = (std::size_t(1) * ... * std::size_t(extents)) * sizeof(typename V::value_type);
      throw detail::allocation_error(label, bytes, V::memory_space::name(), e.what());
    }
    ++allocated_;
    if (kept_.size() < capacity_) {
      kept_.push_back(fresh);
    } else {
      for (V& v : kept_)
        if (v.use_count() == 1) {  // another shape nobody holds: make room
          v = fresh;
          break;
        }
    }
    return fresh;
  }

  /// Views the pool keeps now.
  std::size_t kept() const noexcept { return kept_.size(); }
  /// take() calls that allocated, since construction.
  std::size_t allocations() const noexcept { return allocated_; }
  /// take() calls that returned a kept view, since construction.
  std::size_t reuses() const noexcept { return reused_; }
  /// Drops the pool's hold on every kept view (memory a caller still holds
  /// stays with the caller).
  void clear() noexcept { kept_.clear(); }

 private:
  std::size_t capacity_;
  std::vector<V> kept_;
  std::size_t allocated_ = 0, reused_ = 0;
};

namespace detail {
// The text between `key` (found at or after `from`) and the next '"' in w,
// or `fallback`.
inline std::string quoted_after(const std::string& w, const std::string& key, const std::string& fallback,
                                std::size_t from = 0) {
  const std::size_t k = w.find(key, from);
  if (k == std::string::npos) return fallback;
  const std::size_t b = k + key.size(), q = w.find('"', b);
  return q == std::string::npos ? fallback : w.substr(b, q - b);
}
// Bytes of a size Kokkos printed at p: a number, a space and a unit whose
// first letter is K, M, G or T (Kokkos 3's "128 M", Kokkos 4's "8 GiB"), or
// none (bytes); 0 when no positive number is there.
inline std::size_t kokkos_size(const char* p) {
  char* end = nullptr;
  const double x = std::strtod(p, &end);
  if (!(x > 0)) return 0;
  if (*end == ' ') ++end;
  const double unit = *end == 'K' ? 1024.0 : *end == 'M' ? 1048576.0 : *end == 'G' ? 1073741824.0
                      : *end == 'T' ? 1099511627776.0 : 1.0;
  return std::size_t(x * unit);
}
}  // namespace detail

/// The AllocationError that `e` amounts to when it is Kokkos' report of a
/// failed allocation made anywhere (its label and size read from Kokkos'
/// message, which rounds the size, so it is "about": Kokkos 3's "Kokkos
/// failed to allocate memory for label \"X\"" with "Allocation of size N" and
/// an optional K/M/G suffix, or Kokkos 4's "Kokkos ERROR: Host memory space
/// failed to allocate 8 GiB (label=\"X\")."); nullopt for any other exception.
inline std::optional<AllocationError> as_allocation_error(const std::exception& e) {
  std::string w = e.what();
  w = w.substr(0, w.find('\n'));  // Kokkos appends a traceback note on later lines
  std::string label, space = "its memory space";
  std::size_t bytes = 0;
  const std::string key4 = " memory space failed to allocate ";
  const std::string key3 = "failed to allocate memory for label \"";
  if (const std::size_t at = w.find(key4); at != std::string::npos) {
    // Kokkos 4 (Kokkos::Impl::throw_bad_alloc): "Kokkos ERROR: <Space> memory
    // space failed to allocate <size> <unit> (label=\"<label>\")."
    const std::string lead = "Kokkos ERROR: ";
    const std::size_t s0 = w.compare(0, lead.size(), lead) == 0 ? lead.size() : 0;
    if (at > s0) space = w.substr(s0, at - s0);
    bytes = detail::kokkos_size(w.c_str() + at + key4.size());
    label = detail::quoted_after(w, "(label=\"", "unknown", at);
  } else if (const std::size_t at3 = w.find(key3); at3 != std::string::npos) {
    label = detail::quoted_after(w, key3, "unknown");
    space = detail::quoted_after(w, "MemorySpace named \"", space);
    const std::string zkey = "Allocation of size ";
    if (const std::size_t z = w.find(zkey); z != std::string::npos) bytes = detail::kokkos_size(w.c_str() + z + zkey.size());
  } else {
    return std::nullopt;
  }
  return detail::allocation_error(label, bytes, space, "out of memory (Kokkos: " + w + ")", true);
}

}  // namespace weft
