// weft::Environment: RAII start and stop of MPI and Kokkos for a weft program.
// It respects an application that already initialised either (and then leaves
// finalisation to it), and makes a failure on one rank end the whole job
// instead of leaving the other ranks blocked.
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/core/error.hpp>
#include <weft/core/host_allocator.hpp>
#include <weft/core/kokkos_compat.hpp>

namespace weft {

namespace detail {
inline const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "unknown";
  }
}

// How long a rank that leaves the report of a failure to another rank waits
// for that rank to end the job before it ends it itself.
inline constexpr double quiet_end_s = 5.0;
inline void sleep_seconds(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

// An exception that escapes main on one rank would leave the others blocked in
// their next collective; print it and abort the whole job instead.
[[noreturn]] inline void terminate_job() {
  int rank = -1, init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string what = "unknown exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
    }
  } else {
    what = "std::terminate called without an active exception";
  }
  std::fprintf(stderr, "weft: rank %d is ending the job: %s\n", rank, what.c_str());
  std::fflush(stderr);
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}
}  // namespace detail

/// Starts MPI (at thread level `required_thread_level`, default
/// MPI_THREAD_FUNNELED: only the main thread calls MPI) and Kokkos unless the
/// application already did, and stops what it started. Before that it applies
/// keep_large_host_allocations() (weft/core/host_allocator.hpp: large host
/// buffers stay in the heap; WEFT_HOST_MALLOC=system opts out). Construct it first in
/// main and let every weft object die before it. While it lives, a watchdog
/// thread (weft/comm/watchdog.hpp; it calls no MPI function but MPI_Abort)
/// bounds every blocking wait of weft's communicators by their deadline
/// (WEFT_DEADLINE, 60 s by default): past it the job ends on every rank with
/// a message naming the operation, the axis and the ranks that did not arrive.
class Environment {
 public:
  /// Initialises from the program's arguments: Kokkos gets the --kokkos-*
  /// flags (removed from argv); every other argument is left to the program.
  Environment(int& argc, char**& argv, int required_thread_level = MPI_THREAD_FUNNELED) {
    start(&argc, &argv, required_thread_level);
  }
  /// Initialises without program arguments.
  explicit Environment(int required_thread_level = MPI_THREAD_FUNNELED) {
    start(nullptr, nullptr, required_thread_level);
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

  ~Environment() {
    const int reporter = detail::Watchdog::instance().reporter();
    detail::Watchdog::instance().stop();
    world_.reset();
    const bool failing = std::uncaught_exceptions() > 0 || detail::comm_poisoned();
    if (failing && owns_mpi_) {
      // Another rank may be blocked waiting for this one: finalising could hang.
      if (reporter >= 0 && reporter != rank_) {
        // Another rank of this node reports the failure and ends the job:
        // leave it the time to print, quietly.
        detail::sleep_seconds(detail::quiet_end_s);
      } else {
        std::fprintf(stderr, "weft: rank %d is leaving with an error; aborting the job so that no rank waits forever\n", rank_);
        std::fflush(stderr);
      }
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (owns_kokkos_) {
      Kokkos::finalize();
      detail::kokkos_finalized_by_weft() = true;
    }
    if (owns_mpi_) {
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Finalize();
    }
  }

  /// weft's duplicate of MPI_COMM_WORLD (named "world"; errors returned, not fatal).
  Comm& world() { return *world_; }
  /// The thread level MPI provides.
  int thread_level() const noexcept { return provided_; }
  /// Whether this Environment initialised MPI (and will finalise it).
  bool owns_mpi() const noexcept { return owns_mpi_; }
  /// How large host buffers are allocated in this process (weft/core/host_allocator.hpp).
  const HostAllocatorPolicy& host_allocator() const noexcept { return host_allocator_policy(); }
  /// Whether this Environment initialised Kokkos (and will finalise it).
  bool owns_kokkos() const noexcept { return owns_kokkos_; }

 private:
  void start(int* argc, char*** argv, int required) {
    keep_large_host_allocations();
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    WEFT_REQUIRE(!fin, ConfigError, "weft::Environment: MPI was already finalised; create the Environment before MPI_Finalize");
    if (!init) {
      int rc = MPI_Init_thread(argc, argv, required, &provided_);
      WEFT_REQUIRE(rc == MPI_SUCCESS, ConfigError, "weft::Environment: MPI_Init_thread failed with code ", rc);
      owns_mpi_ = true;
      std::set_terminate(detail::terminate_job);
    } else {
      MPI_Query_thread(&provided_);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    WEFT_REQUIRE(provided_ >= required, ConfigError, "weft::Environment: MPI provides thread level ",
                 detail::thread_level_name(provided_), " but ", detail::thread_level_name(required),
                 " was requested; initialise MPI with MPI_Init_thread at that level or request less");
    if (!detail::kokkos_is_initialized()) {
      WEFT_REQUIRE(!detail::kokkos_is_finalized(), ConfigError,
                   "weft::Environment: Kokkos was already finalised and cannot be initialised again in this process");
      if (argc != nullptr) {
        // Only --kokkos-* flags go to Kokkos: Kokkos 3 also reads the legacy
        // unprefixed --threads, --numa and --device and aborts when their form
        // is not its own (--threads 4), and those names belong to the
        // application. The --kokkos-* flags are removed from argv, as
        // Kokkos::initialize would remove them.
        auto is_kokkos = [](const char* a) { return std::strncmp(a, "--kokkos-", 9) == 0; };
        std::vector<char*> kokkos_args{(*argv)[0]};
        for (int i = 1; i < *argc; ++i)
          if (is_kokkos((*argv)[i])) kokkos_args.push_back((*argv)[i]);
        int kokkos_argc = static_cast<int>(kokkos_args.size());
        kokkos_args.push_back(nullptr);
        char** kokkos_argv = kokkos_args.data();
        Kokkos::initialize(kokkos_argc, kokkos_argv);
        int kept = 1;
        for (int i = 1; i < *argc; ++i)
          if (!is_kokkos((*argv)[i])) (*argv)[kept++] = (*argv)[i];
        for (int i = kept; i < *argc; ++i) (*argv)[i] = nullptr;
        *argc = kept;
      } else {
        Kokkos::initialize();
      }
      owns_kokkos_ = true;
    }
    world_.emplace(Comm::duplicate(MPI_COMM_WORLD, "world"));
    detail::Watchdog::instance().start();
  }

  bool owns_mpi_ = false;
  bool owns_kokkos_ = false;
  int provided_ = MPI_THREAD_SINGLE;
  int rank_ = 0;
  std::optional<Comm> world_;
};

namespace detail {
// FNV-1a: equal messages give equal hashes on every rank.
inline std::uint64_t message_hash(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace detail

/// For a program's top-level catch, after an error ended this rank's work:
/// prints "<program>: error: <message>" once in the job and ends this rank.
/// The failing ranks first agree (on weft's own communicator, waiting at most
/// `wait_s`: 5 s, or half of WEFT_DEADLINE when that is shorter):
/// - every rank failed: each distinct message is printed by the lowest rank
///   that has it (an error every rank finds: by rank 0 alone), and this
///   returns `status`, so the job ends normally with it;
/// - some ranks did not fail within `wait_s` (they compute, or wait for this
///   one): the first failing rank of the node prints and ends the job with
///   `MPI_Abort(status)`; the node's other failing ranks stay quiet.
/// A wait past its deadline (CommError::deadline_passed) skips the agreement:
/// the rank the watchdog elected prints, and the job ends.
inline int report_error_once(Environment& env, const std::exception& e, const char* program, int status,
                             double wait_s = -1) {
  const std::string msg = e.what();
  auto print = [&] {
    std::fprintf(stderr, "%s: error: %s\n", program, msg.c_str());
    std::fflush(stderr);
  };
  auto& watchdog = detail::Watchdog::instance();
  auto end_job = [&](bool printed_elsewhere) {
    if (printed_elsewhere) detail::sleep_seconds(detail::quiet_end_s);  // the reporter ends the job first
    MPI_Abort(MPI_COMM_WORLD, status);
    std::_Exit(status);
  };
  Comm& world = env.world();
  if (world.size() == 1) {
    print();
    return status;
  }
  if (const auto* c = dynamic_cast<const CommError*>(&e); c != nullptr && c->deadline_passed()) {
    if (!c->reported_by_another_rank()) print();
    end_job(c->reported_by_another_rank());
  }
  if (wait_s < 0) {
    const double deadline = detail::checked_defaults().deadline_s;
    wait_s = deadline > 0 ? std::min(5.0, deadline / 2) : 5.0;
  }
  const std::uint64_t mine = detail::message_hash(msg);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world.size()));
  MPI_Request rq = MPI_REQUEST_NULL;
  bool everyone = false;
  if (watchdog.errors_comm() != MPI_COMM_NULL &&
      MPI_Iallgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, watchdog.errors_comm(), &rq) == MPI_SUCCESS) {
    // Shown in the heartbeat table, so that a peer past its own deadline
    // names this wait and leaves the report to this rank.
    const auto& core = world.staging_state();
    detail::WaitScope scope("agree on an error", core.name, core.world_ranks, 0);
    const double t0 = detail::now_seconds();
    for (int done = 0;;) {
      if (MPI_Test(&rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      if (done) {
        everyone = true;
        break;
      }
      if (detail::now_seconds() - t0 > wait_s) break;
      detail::sleep_seconds(1e-3);
    }
  }
  if (everyone) {
    bool first = true;
    for (int r = 0; r < world.rank(); ++r) first = first && all[static_cast<std::size_t>(r)] != mine;
    if (first) print();
    return status;
  }
  const bool here = watchdog.claim_report();
  if (here) print();
  end_job(!here);
  return status;
}

}  // namespace weft
