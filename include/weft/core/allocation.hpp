// Allocation failures as weft errors: a Kokkos view that cannot be allocated
// becomes weft::AllocationError naming the tensor, its size and the memory
// space, instead of Kokkos' runtime_error escaping through MPI_Abort.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

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

/// The AllocationError that `e` amounts to when it is Kokkos' report of a
/// failed allocation made anywhere (its label and size read from Kokkos'
/// message, which rounds the size, so it is "about": Kokkos 3's "Kokkos
/// failed to allocate memory for label \"X\"" with "Allocation of size N" and
/// an optional K/M/G suffix, or Kokkos 4's "Kokkos ERROR: Host memory space
/// failed to allocate 8 GiB (label=\"X\")."); nullopt for any other exception.
inline std::optional<AllocationError> as_allocation_error(const std::exception& e) {
  std::string w = e.what();
  w = w.substr(0, w.find('\n'));  // Kokkos appends a traceback note on later lines
  // Kokkos 4 (Kokkos::Impl::throw_bad_alloc): "<Space> memory space failed to
  // allocate <size> <B|KiB|MiB|GiB|TiB> (label=\"<label>\")."
  const std::string key4 = " memory space failed to allocate ";
  if (const std::size_t at4 = w.find(key4); at4 != std::string::npos) {
    const std::string lead = "Kokkos ERROR: ";
    const std::size_t sp0 = w.compare(0, lead.size(), lead) == 0 ? lead.size() : 0;
    const std::string space = at4 > sp0 ? w.substr(sp0, at4 - sp0) : std::string("its memory space");
    char* end = nullptr;
    const double x = std::strtod(w.c_str() + at4 + key4.size(), &end);
    double unit = 1;
    if (end && *end == ' ') ++end;
    if (end) {
      const std::string u(end, std::min<std::size_t>(3, std::strlen(end)));
      unit = u.rfind("KiB", 0) == 0   ? 1024.0
             : u.rfind("MiB", 0) == 0 ? 1048576.0
             : u.rfind("GiB", 0) == 0 ? 1073741824.0
             : u.rfind("TiB", 0) == 0 ? 1099511627776.0
                                      : 1.0;
    }
    std::string label = "unknown";
    const std::string lkey = "(label=\"";
    if (const std::size_t l = w.find(lkey, at4); l != std::string::npos) {
      const std::size_t q = w.find('"', l + lkey.size());
      if (q != std::string::npos) label = w.substr(l + lkey.size(), q - l - lkey.size());
    }
    const std::size_t bytes = x > 0 ? std::size_t(x * unit) : 0;
    return detail::allocation_error(label, bytes, space, "out of memory (Kokkos: " + w + ")", true);
  }
  const std::string key = "failed to allocate memory for label \"";
  const std::size_t at = w.find(key);
  if (at == std::string::npos) return std::nullopt;
  const std::size_t b = at + key.size(), q = w.find('"', b);
  const std::string label = q == std::string::npos ? std::string("unknown") : w.substr(b, q - b);
  std::string space = "its memory space";
  const std::string skey = "MemorySpace named \"";
  if (const std::size_t s = w.find(skey); s != std::string::npos) {
    const std::size_t e2 = w.find('"', s + skey.size());
    if (e2 != std::string::npos) space = w.substr(s + skey.size(), e2 - s - skey.size());
  }
  std::size_t bytes = 0;
  const std::string zkey = "Allocation of size ";
  if (const std::size_t z = w.find(zkey); z != std::string::npos) {
    char* end = nullptr;
    const double x = std::strtod(w.c_str() + z + zkey.size(), &end);
    double unit = 1;
    if (end && *end == ' ') ++end;
    if (end && (*end == 'K' || *end == 'M' || *end == 'G'))
      unit = *end == 'K' ? 1024.0 : *end == 'M' ? 1048576.0 : 1073741824.0;
    if (x > 0) bytes = std::size_t(x * unit);
  }
  return detail::allocation_error(label, bytes, space, "out of memory (Kokkos: " + w + ")", true);
}

}  // namespace weft
