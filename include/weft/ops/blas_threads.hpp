// The BLAS thread count of this process. OpenBLAS starts its own thread pool
// beside Kokkos' host threads; when ranks x Kokkos threads x BLAS threads
// exceed the cores, every gemm slows down, so weft chooses the count and says why.
#pragma once

#include <dlfcn.h>
#include <sched.h>

#include <Kokkos_Core.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <weft/config.hpp>
#include <weft/core/error.hpp>

namespace weft::ops {

/// What set_blas_threads chose and why (for the run record and the log).
struct BlasThreads {
  int threads = 1;       ///< BLAS threads per rank now in effect (best knowledge)
  bool controlled = false;  ///< whether the count was applied: the BLAS library exposes a thread setter, or oneDNN's OpenMP runtime took it
  std::string reason;    ///< a sentence for humans
};

/// Everything choose_blas_threads decides from, so that the rule is a pure
/// function that tests can call with any machine in mind.
struct BlasThreadInputs {
  int requested = 0;       ///< the user's explicit count (a flag); 0: none
  int ranks_per_node = 1;  ///< ranks of this job sharing this node, >= 1
  int cores = 0;           ///< cores of the node; 0 or less: unknown (taken as 1)
  int kokkos_threads = 1;  ///< threads of Kokkos' default host execution space per rank, >= 1
  int openblas_env = 0;    ///< OPENBLAS_NUM_THREADS when set to a positive count; else 0
};

/// The rule: an explicit `requested` count wins; else a positive
/// OPENBLAS_NUM_THREADS is kept (the user's choice for BLAS); else
/// cores / (ranks_per_node x kokkos_threads), at least 1, so that Kokkos'
/// threads and BLAS' threads of all ranks on the node together never
/// outnumber its cores. OMP_NUM_THREADS is not read: it sets Kokkos' OpenMP
/// threads, which `kokkos_threads` already counts. Returns the count and the
/// reason; `controlled` is left false (whether it can be applied is
/// set_blas_threads' business). Throws ConfigError on ranks_per_node < 1 or
/// kokkos_threads < 1.
inline BlasThreads choose_blas_threads(const BlasThreadInputs& in) {
  WEFT_REQUIRE(in.ranks_per_node >= 1, ConfigError, "weft::ops::choose_blas_threads: ranks_per_node is ",
               in.ranks_per_node, ", expected >= 1");
  WEFT_REQUIRE(in.kokkos_threads >= 1, ConfigError, "weft::ops::choose_blas_threads: kokkos_threads is ",
               in.kokkos_threads, ", expected >= 1");
  BlasThreads out;
  if (in.requested > 0) {
    out.threads = in.requested;
    out.reason = "set by the user";
    return out;
  }
  if (in.openblas_env > 0) {
    out.threads = in.openblas_env;
    out.reason = "kept from OPENBLAS_NUM_THREADS=" + std::to_string(in.openblas_env);
    return out;
  }
  const int cores = in.cores > 0 ? in.cores : 1;
  const int per_rank = in.ranks_per_node * in.kokkos_threads;
  out.threads = cores / per_rank > 0 ? cores / per_rank : 1;
  out.reason = std::to_string(cores) + " cores / (" + std::to_string(in.ranks_per_node) + " ranks on this node x " +
               std::to_string(in.kokkos_threads) + " Kokkos host threads per rank)";
  return out;
}

namespace detail {
// Looked up at run time: the BLAS library behind Kokkos Kernels is chosen by
// the system (OpenBLAS, reference BLAS, MKL), and only OpenBLAS has these.
inline void* blas_symbol(const char* name) { return dlsym(RTLD_DEFAULT, name); }

// Threads of Kokkos' default host execution space (1 for Serial, and before
// Kokkos is initialised).
inline int kokkos_host_threads() {
  if (!Kokkos::is_initialized()) return 1;
  const int n = Kokkos::DefaultHostExecutionSpace().concurrency();
  return n > 0 ? n : 1;
}
}  // namespace detail

/// Current BLAS thread count, or 1 when the library does not say.
inline int blas_thread_count() {
  using get_fn = int (*)();
  if (auto f = reinterpret_cast<get_fn>(detail::blas_symbol("openblas_get_num_threads"))) return f();
  return 1;
}

/// Chooses the BLAS thread count by choose_blas_threads' rule, from
/// `requested` (a user flag; 0: none), `ranks_per_node`, the node's cores,
/// the threads of Kokkos' default host execution space and
/// OPENBLAS_NUM_THREADS, and applies it when the BLAS library has a thread
/// setter (OpenBLAS). OMP_NUM_THREADS is deliberately not handed to BLAS.
/// Throws ConfigError on ranks_per_node < 1 (choose_blas_threads' check).
inline BlasThreads set_blas_threads(int requested, int ranks_per_node) {
  BlasThreadInputs in;
  in.requested = requested;
  in.ranks_per_node = ranks_per_node;
  in.cores = static_cast<int>(std::thread::hardware_concurrency());
  in.kokkos_threads = detail::kokkos_host_threads();
  if (const char* e = std::getenv("OPENBLAS_NUM_THREADS"); e && std::atoi(e) > 0) in.openblas_env = std::atoi(e);
  BlasThreads out = choose_blas_threads(in);
  const int wanted = out.threads;
  using set_fn = void (*)(int);
  auto setter = reinterpret_cast<set_fn>(detail::blas_symbol("openblas_set_num_threads"));
  if (setter) {
    setter(wanted);
    out.threads = blas_thread_count();
  }
  bool onednn_set = false;
#if WEFT_ENABLE_ONEDNN
  // oneDNN (the float provider) runs on the OpenMP runtime it was built
  // with: its threads are that runtime's, set from this (the calling) thread.
  // Looked up at run time, as for OpenBLAS: weft itself is not built with
  // -fopenmp. Kokkos' OpenMP backend keeps its own pool size either way. A
  // program whose products all go to oneDNN may not load OpenBLAS at all (the
  // linker drops it), and then oneDNN's threads are the ones that matter.
  using omp_set_fn = void (*)(int);
  if (auto omp_set = reinterpret_cast<omp_set_fn>(detail::blas_symbol("omp_set_num_threads"))) {
    omp_set(wanted);
    onednn_set = true;
    if (!setter) out.threads = wanted;
  }
#endif
  out.controlled = setter != nullptr || onednn_set;
  if (!out.controlled) {
    out.threads = 1;
    out.reason += "; this BLAS exposes no thread setter, so its own default applies";
  }
  return out;
}

/// How this rank's host threads sit on the cores, as the examples print it
/// at start-up (host_binding(), describe()).
struct HostBinding {
  int allowed_cpus = 0;    ///< CPUs this process may run on (its affinity mask); 0: unknown
  int cores = 0;           ///< CPUs of the node
  int kokkos_threads = 1;  ///< threads of Kokkos' default host execution space
  int blas_threads = 1;    ///< BLAS threads per rank
  std::string proc_bind;   ///< OMP_PROC_BIND, or "unset"
  std::string advice;      ///< what to change, or "" when the binding gives every thread a CPU
};

/// The rule, a pure function: advice when Kokkos' host threads outnumber the
/// CPUs the process may run on (mpirun's default --bind-to core gives a rank
/// one core, so a second OpenMP thread only takes turns with the first: 19 %
/// slower in issue 21's measurement), or when OMP_PROC_BIND pins threads while
/// several ranks share the node's CPUs (each rank's first thread then lands on
/// the same CPU). "" when neither holds.
inline std::string binding_advice(int allowed_cpus, int kokkos_threads, int ranks_per_node, const std::string& proc_bind) {
  if (allowed_cpus > 0 && kokkos_threads > allowed_cpus)
    return std::to_string(kokkos_threads) + " Kokkos threads may run on only " + std::to_string(allowed_cpus) +
           " CPU" + (allowed_cpus == 1 ? "" : "s") +
           " (mpirun binds each rank to one core by default): run mpirun with --map-by slot:PE=" +
           std::to_string(kokkos_threads) + " --bind-to core, or --bind-to none";
  const bool pinned = !proc_bind.empty() && proc_bind != "unset" && proc_bind != "false";
  if (pinned && ranks_per_node > 1 && allowed_cpus > kokkos_threads)
    return "OMP_PROC_BIND=" + proc_bind + " pins each rank's threads to the same first CPUs of the " +
           std::to_string(allowed_cpus) + " every rank may use: unset it, or bind the ranks apart (mpirun --map-by "
           "slot:PE=" + std::to_string(kokkos_threads) + " --bind-to core)";
  return "";
}

/// This process' binding: its affinity mask, the node's CPUs, Kokkos' host
/// threads, `blas_threads` (set_blas_threads' choice) and OMP_PROC_BIND, with
/// binding_advice()'s advice for `ranks_per_node` ranks on the node.
inline HostBinding host_binding(int blas_threads, int ranks_per_node) {
  HostBinding b;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) b.allowed_cpus = CPU_COUNT(&set);
  b.cores = static_cast<int>(std::thread::hardware_concurrency());
  b.kokkos_threads = detail::kokkos_host_threads();
  b.blas_threads = blas_threads;
  const char* pb = std::getenv("OMP_PROC_BIND");
  b.proc_bind = pb && *pb ? pb : "unset";
  b.advice = binding_advice(b.allowed_cpus, b.kokkos_threads, ranks_per_node, b.proc_bind);
  return b;
}

/// One line for the log, e.g. "2 Kokkos threads + 1 BLAS thread per rank, on 2
/// of 2 CPUs (OMP_PROC_BIND unset)", followed by the advice when there is one.
inline std::string describe(const HostBinding& b) {
  std::string s = std::to_string(b.kokkos_threads) + " Kokkos thread" + (b.kokkos_threads == 1 ? "" : "s") + " + " +
                  std::to_string(b.blas_threads) + " BLAS thread" + (b.blas_threads == 1 ? "" : "s") + " per rank, on " +
                  (b.allowed_cpus > 0 ? std::to_string(b.allowed_cpus) : std::string("?")) + " of " +
                  std::to_string(b.cores) + " CPUs (OMP_PROC_BIND " + b.proc_bind + ")";
  if (!b.advice.empty()) s += "; warning: " + b.advice;
  return s;
}

/// Prints "<program>: host threads: <describe(b)>" on rank 0, and the same
/// line on stderr from any other rank whose binding has advice.
inline void print_host_threads(const char* program, int rank, const HostBinding& b) {
  if (rank == 0) std::printf("%s: host threads: %s\n", program, describe(b).c_str());
  else if (!b.advice.empty()) std::fprintf(stderr, "%s: rank %d: host threads: %s\n", program, rank, describe(b).c_str());
}

}  // namespace weft::ops
