// The state a communicator shares with its pending operations (error
// conversion, checked-mode deadlines, statistics) and Request, the handle of a
// non-blocking operation.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <weft/comm/stats.hpp>
#include <weft/comm/watchdog.hpp>
#include <weft/config.hpp>
#include <weft/core/error.hpp>
#include <weft/core/parse.hpp>

namespace weft {

namespace detail {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Process-wide defaults of the checked mode and of every wait's deadline:
// the CMake option WEFT_ENABLE_CHECKED, overridden by the environment
// variables WEFT_CHECKED (0/1) and WEFT_DEADLINE (seconds; 0 = waits are not
// bounded), overridden by set_checked_default().
// Both are parsed strictly: WEFT_DEADLINE is seconds with an optional unit
// ("5", "5s", "500ms", "2min"; weft::parse_seconds) and WEFT_CHECKED 0 or 1.
// A value that is neither keeps the default, and `env_error` says so, for
// programs to refuse before they start (train_gpt and serve_gpt do).
struct CheckedDefaults {
  bool checked = WEFT_CHECKED_DEFAULT != 0;
  double deadline_s = 60.0;
  std::string env_error;  // empty: the environment's values were taken as given
  CheckedDefaults() {
    if (const char* e = std::getenv("WEFT_CHECKED")) {
      if (std::string(e) == "0" || std::string(e) == "1") checked = e[0] == '1';
      else env_error = std::string("WEFT_CHECKED=") + e + ": expected 0 or 1";
    }
    if (const char* e = std::getenv("WEFT_DEADLINE")) {
      if (const auto d = parse_seconds(e)) deadline_s = *d;
      else
        env_error += (env_error.empty() ? "" : "; ") + std::string("WEFT_DEADLINE=") + e +
                     ": expected a non-negative number of seconds such as 60, 5s, 500ms or 2min (0: waits are not bounded)";
    }
  }
};
inline CheckedDefaults& checked_defaults() {
  static CheckedDefaults d;
  return d;
}

// The process-wide default of Comm::node_shared_staging(): on, unless the
// environment variable WEFT_NODE_SHARED_STAGING is 0 (read once).
inline bool node_shared_staging_default() {
  static const bool on = [] {
    const char* e = std::getenv("WEFT_NODE_SHARED_STAGING");
    return !(e != nullptr && e[0] == '0' && e[1] == '\0');
  }();
  return on;
}

// The process-wide default of Comm::cross_memory_attach(): on, unless the
// environment variable WEFT_CROSS_MEMORY_ATTACH is 0 (read once).
inline bool cross_memory_attach_default() {
  static const bool on = [] {
    const char* e = std::getenv("WEFT_CROSS_MEMORY_ATTACH");
    return !(e != nullptr && e[0] == '0' && e[1] == '\0');
  }();
  return on;
}

// Set when a deadline passed with operations still posted: MPI cannot cancel a
// collective, so such a process must not call MPI_Finalize (it could block);
// weft::Environment aborts the job instead.
inline bool& comm_poisoned() {
  static bool p = false;
  return p;
}

inline std::string mpi_error_text(int rc) {
  int cls = 0;
  MPI_Error_class(rc, &cls);
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  char cls_text[MPI_MAX_ERROR_STRING];
  int cls_len = 0;
  MPI_Error_string(cls, cls_text, &cls_len);
  return "MPI error class " + std::to_string(cls) + " (" + std::string(cls_text, cls_len) + "): " +
         std::string(text, len);
}

// What a communicator shares with its requests; heap-allocated so that its
// address survives moves of the owning Comm.
struct CommCore {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm shadow = MPI_COMM_NULL;  // checked-mode handshakes travel here, never mixed with data
  bool owned = false;
  std::string name;
  int rank = 0;
  int size = 1;
  CommStats stats;
  bool checked = checked_defaults().checked;
  double deadline_s = checked_defaults().deadline_s;
  int node_shared_users = 0;  // see Comm::node_shared_peers
  int staging = -1;           // Comm::node_shared_staging(): -1 = the process default
  int within_node = -1;       // -1 = not asked yet; else whether all ranks share one node
  int cma = -1;               // Comm::cross_memory_attach(): -1 = the process default
  bool cma_failed = false;    // a cross-memory read failed on some rank: off for good
  std::vector<int> world_ranks;  // rank r of this communicator is world rank world_ranks[r] (for the watchdog's report)
  std::size_t staging_bytes = 0;        // this rank's segment of the staging window
  std::shared_ptr<void> staging_window;  // freed (collectively) before the communicator

  std::string where(const char* op) const {
    return std::string("weft::Comm::") + op + " on axis '" + name + "' (rank " + std::to_string(rank) + " of " +
           std::to_string(size) + ")";
  }
  [[noreturn]] void fail(const char* op, const std::string& msg) const {
    throw CommError(op, name, where(op) + ": " + msg);
  }
  void check(int rc, const char* op) const {
    if (rc != MPI_SUCCESS) fail(op, mpi_error_text(rc));
  }

  // Where the other ranks are, for a wait in `op` past its deadline (the
  // watchdog's heartbeat table; see weft/comm/watchdog.hpp).
  std::string peers(const char* op) const { return Watchdog::instance().report(op, name, world_ranks); }

  // Completes n requests. Unchecked: MPI_Waitall, bounded by the watchdog
  // (which ends the job past the deadline). Checked: polls until the
  // deadline, then raises CommError instead of hanging. Adds the time spent
  // here to exposed.
  void wait_all(MPI_Request* reqs, int n, const char* op, double& exposed, const std::string& what = {}) const {
    const double t0 = now_seconds();
    if (!checked) {
      WaitScope scope(op, name, world_ranks, deadline_s);
      int rc = MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE);
      exposed += now_seconds() - t0;
      check(rc, op);
      return;
    }
    // Shown in the watchdog's heartbeat table (its deadline is this loop's own).
    WaitScope scope(op, name, world_ranks, 0);
    for (long spin = 0;; ++spin) {
      int flag = 0;
      int rc = MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        exposed += now_seconds() - t0;
        check(rc, op);
      }
      if (flag) break;
      const double t = now_seconds();
      if (deadline_s > 0 && t - t0 > deadline_s) {
        comm_poisoned() = true;
        PeerReport r;
        const bool here = Watchdog::instance().elect_reporter(op, name, world_ranks, deadline_s, r);
        exposed += now_seconds() - t0;
        throw CommError(op, name,
                        where(op) + ": did not complete within the checked-mode deadline of " + std::to_string(deadline_s) +
                            " s" + (what.empty() ? std::string() : " (" + what + ")") +
                            ". Another rank of this axis is not taking part: it failed, or it is blocked in a "
                            "different operation:" + r.text + "\nSet WEFT_DEADLINE (seconds) to allow slower peers.",
                        here ? CommError::Deadline::report_here : CommError::Deadline::reported_by_another_rank);
      }
      if (spin > 64) std::this_thread::yield();
    }
    exposed += now_seconds() - t0;
  }
};

}  // namespace detail

/// Handle of a non-blocking operation started by a weft::Comm. Call wait() (or
/// test() until it returns true) before reading or reusing its buffers; a
/// request destroyed while pending waits for it, so buffers are never freed
/// under MPI. Move-only. The Comm that started it must outlive it.
class Request {
 public:
  Request() = default;
  Request(Request&& o) noexcept : st_(std::move(o.st_)) {}
  Request& operator=(Request&& o) noexcept {
    if (this != &o) {
      complete_in_destructor();
      st_ = std::move(o.st_);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { complete_in_destructor(); }

  /// True while the operation has not been completed by wait() or test().
  bool active() const noexcept { return st_ != nullptr; }

  /// Blocks until the operation is complete, then copies staged data back.
  /// Raises weft::CommError on an MPI error or a passed checked-mode deadline.
  void wait() {
    if (!st_) return;
    auto st = std::move(st_);
    st->core->wait_all(st->reqs.data(), static_cast<int>(st->reqs.size()), st->op, st->exposed);
    finish(*st);
  }

  /// Completes the operation if it is done; returns true when it is (or when
  /// the request is inactive).
  bool test() {
    if (!st_) return true;
    const double t0 = detail::now_seconds();
    int flag = 0;
    int rc = MPI_Testall(static_cast<int>(st_->reqs.size()), st_->reqs.data(), &flag, MPI_STATUSES_IGNORE);
    st_->exposed += detail::now_seconds() - t0;
    if (rc != MPI_SUCCESS) {
      auto st = std::move(st_);
      st->core->check(rc, st->op);
    }
    if (!flag) return false;
    auto st = std::move(st_);
    finish(*st);
    return true;
  }

 private:
  friend class Comm;
  struct State {
    detail::CommCore* core = nullptr;
    std::vector<MPI_Request> reqs;
    std::function<void()> on_complete;  // copy-back of staged buffers, average scaling
    std::shared_ptr<void> keep;         // buffers MPI uses until completion
    CommKind kind = CommKind::barrier;
    std::uint64_t bytes = 0;
    double t_start = 0.0;
    double exposed = 0.0;
    const char* op = "";
  };
  explicit Request(std::unique_ptr<State> st) : st_(std::move(st)) {}

  static void finish(State& st) {
    const double t0 = detail::now_seconds();
    if (st.on_complete) st.on_complete();
    const double t1 = detail::now_seconds();
    st.exposed += t1 - t0;
    st.core->stats.record(st.kind, st.bytes, t1 - st.t_start, st.exposed);
  }

  void complete_in_destructor() noexcept {
    if (!st_) return;
    if (std::uncaught_exceptions() > 0 || detail::comm_poisoned()) {
      // Unwinding from an error: waiting could hang. An operation that is
      // still posted is abandoned: its buffers stay alive for good (MPI could
      // write into them), and the process must not call MPI_Finalize, which
      // could block on it, so weft::Environment ends the job with MPI_Abort
      // instead, as every other failing rank does.
      int done = 0, fin = 0;
      MPI_Finalized(&fin);
      if (!fin) (void)MPI_Testall(static_cast<int>(st_->reqs.size()), st_->reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (done) {
        st_.reset();
      } else {
        detail::comm_poisoned() = true;
        (void)st_.release();
      }
      return;
    }
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft: a pending Request failed while being destroyed: %s\n", e.what());
    }
  }

  std::unique_ptr<State> st_;
};

/// Waits for every request in the range, in order.
template <class Range>
void wait_all(Range& requests) {
  for (auto& r : requests) r.wait();
}

}  // namespace weft
