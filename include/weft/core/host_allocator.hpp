// How the C library hands out large host buffers, and why weft changes it.
//
// glibc's malloc serves every request of 128 KiB and more (its adaptive
// threshold grows to at most 32 MiB) with a fresh mmap, and returns it to the
// system with munmap on free. MPI libraries allocate their temporary buffers
// with malloc on every large collective (Open MPI's all-reduce and
// reduce-scatter take a message-sized scratch buffer per call), so each call
// touches freshly mapped pages and pays one page fault per 4 KiB page. On a
// virtual machine a fault costs microseconds: measured here, Open MPI's
// 64 MiB all-reduce on 2 ranks ran at 0.16 GB/s with the default and at
// 2.8 GB/s with large blocks kept in the heap (docs/build.md). The same
// applies to weft's own transient buffers and to Kokkos host views.
//
// keep_large_host_allocations() tells malloc to serve large blocks from the
// heap (no mmap) and not to give freed memory back to the system, so a buffer
// freed by one call is reused, already faulted in, by the next. The price: the
// process' resident memory stays at its high-water mark instead of shrinking
// after a large free. weft::Environment applies it at start-up unless the
// environment variable WEFT_HOST_MALLOC=system asks for the C library's own
// behaviour.
#pragma once

#include <cstdlib>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace weft {

/// What keep_large_host_allocations() did, for logs and run records.
struct HostAllocatorPolicy {
  /// "keep-large" when large blocks now stay in the heap, "system" otherwise.
  std::string mode = "system";
  /// A sentence saying why this mode is in effect.
  std::string reason;
  /// Whether the mode is keep-large.
  bool keeps_large() const noexcept { return mode == "keep-large"; }
};

namespace detail {
inline HostAllocatorPolicy& host_allocator_policy_state() {
  static HostAllocatorPolicy p{"system", "weft has not changed the C library's allocator"};
  return p;
}
/// Whether a sanitizer's run-time replaces malloc: AddressSanitizer,
/// ThreadSanitizer or MemorySanitizer (g++ defines __SANITIZE_ADDRESS__ and
/// __SANITIZE_THREAD__, clang answers __has_feature). Its allocator ignores
/// mallopt and aborts on a request beyond its limit instead of failing it.
inline constexpr bool sanitized_allocator() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}
}  // namespace detail

/// The allocator policy currently in effect in this process (as weft set it).
inline const HostAllocatorPolicy& host_allocator_policy() { return detail::host_allocator_policy_state(); }

/// Makes the C library keep large host blocks in its heap and stop returning
/// freed memory to the system (see the comment at the top of this header).
/// Honours WEFT_HOST_MALLOC=system (leave the C library alone) and does
/// nothing where the C library is not glibc or a sanitizer replaces malloc.
/// Idempotent; returns the policy now in effect.
inline const HostAllocatorPolicy& keep_large_host_allocations() {
  auto& p = detail::host_allocator_policy_state();
  if (p.keeps_large()) return p;
  if (const char* e = std::getenv("WEFT_HOST_MALLOC"); e != nullptr && std::string(e) == "system") {
    p = {"system", "WEFT_HOST_MALLOC=system asked for the C library's default"};
    return p;
  }
#if defined(__GLIBC__)
  if constexpr (detail::sanitized_allocator()) {
    p = {"system", "a sanitizer replaces malloc; its allocator is left as it is"};
  } else {
    // 0 mmap'ed blocks: every block comes from the heap. A trim threshold of
    // INT_MAX (2 GiB, the most mallopt takes): freed memory at the top of the
    // heap is kept for the next request unless more than that is free.
    const bool ok = mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, int(~0u >> 1)) == 1;
    if (ok) {
      p = {"keep-large",
           "large host blocks stay in the heap and freed memory is kept, so MPI's and weft's per-call buffers are "
           "reused without page faults (WEFT_HOST_MALLOC=system turns this off)"};
    } else {
      p = {"system", "glibc's mallopt refused the settings; the default allocator is in effect"};
    }
  }
#else
  p = {"system", "the C library is not glibc; its allocator is left as it is"};
#endif
  return p;
}

}  // namespace weft
