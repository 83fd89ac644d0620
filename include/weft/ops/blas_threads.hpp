// The BLAS thread count of this process. OpenBLAS starts its own thread pool;
// when several ranks share a node, ranks x BLAS threads must not exceed the
// cores or every gemm slows down, so weft chooses the count and says why.
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <thread>

#include <weft/core/error.hpp>

namespace weft::ops {

/// What set_blas_threads chose and why (for the run record and the log).
struct BlasThreads {
  int threads = 1;       ///< BLAS threads per rank now in effect (best knowledge)
  bool controlled = false;  ///< whether the BLAS library exposes a thread setter
  std::string reason;    ///< a sentence for humans
};

namespace detail {
// Looked up at run time: the BLAS library behind Kokkos Kernels is chosen by
// the system (OpenBLAS, reference BLAS, MKL), and only OpenBLAS has these.
inline void* blas_symbol(const char* name) { return dlsym(RTLD_DEFAULT, name); }
}  // namespace detail

/// Current BLAS thread count, or 1 when the library does not say.
inline int blas_thread_count() {
  using get_fn = int (*)();
  if (auto f = reinterpret_cast<get_fn>(detail::blas_symbol("openblas_get_num_threads"))) return f();
  return 1;
}

/// Sets the BLAS thread count: `requested` when positive (a user flag); else
/// the environment's OPENBLAS_NUM_THREADS / OMP_NUM_THREADS when set (the
/// user's choice, kept); else cores / ranks_per_node, at least 1.
inline BlasThreads set_blas_threads(int requested, int ranks_per_node) {
  WEFT_REQUIRE(ranks_per_node >= 1, ConfigError, "weft::ops::set_blas_threads: ranks_per_node is ", ranks_per_node,
               ", expected >= 1");
  using set_fn = void (*)(int);
  auto setter = reinterpret_cast<set_fn>(detail::blas_symbol("openblas_set_num_threads"));
  BlasThreads out;
  out.controlled = setter != nullptr;
  int want = 0;
  if (requested > 0) {
    want = requested;
    out.reason = "set by the user";
  } else if (const char* e = std::getenv("OPENBLAS_NUM_THREADS"); e && std::atoi(e) > 0) {
    out.threads = std::atoi(e);
    out.reason = std::string("kept from OPENBLAS_NUM_THREADS=") + e;
    return out;
  } else if (const char* o = std::getenv("OMP_NUM_THREADS"); o && std::atoi(o) > 0) {
    out.threads = std::atoi(o);
    out.reason = std::string("kept from OMP_NUM_THREADS=") + o;
    return out;
  } else {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    want = cores / ranks_per_node > 0 ? cores / ranks_per_node : 1;
    out.reason = std::to_string(cores > 0 ? cores : 1) + " cores / " + std::to_string(ranks_per_node) +
                 " ranks on this node";
  }
  if (setter) {
    setter(want);
    out.threads = blas_thread_count();
  } else {
    out.threads = 1;
    out.reason += "; this BLAS exposes no thread setter, so its own default applies";
  }
  return out;
}

}  // namespace weft::ops
