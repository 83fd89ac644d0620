// The bounded wait of weft's default mode. Blocking collectives keep calling
// the blocking MPI functions (their non-blocking twins cost microseconds more
// per call); each call only marks "this rank waits in <op> on <axis>", and a
// watchdog thread started by weft::Environment ends the job when it has seen
// the same mark for longer than the communicator's deadline. A heartbeat table in node-shared
// memory, one slot per rank of the node that its own watchdog refreshes, tells
// the rank that finds the deadline passed which peers never arrived and why
// (stopped or dead, busy elsewhere, or waiting in another operation), so the
// message names them.
#pragma once

#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <weft/comm/node.hpp>

namespace weft::detail {

inline double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What this process' main thread is blocked in, if anything. Written by the
// main thread around every blocking weft call, read by the watchdog thread.
// `active` and `busy` form a Dekker handshake (both sequentially consistent):
// the watchdog reads the plain fields only after setting busy and seeing
// active, and the main thread does not leave a wait (and so does not reuse
// the fields, or free the communicator they point into) while busy is set.
struct WaitMark {
  std::atomic<bool> enabled{false};  // a watchdog runs in this process
  std::atomic<bool> active{false};
  std::atomic<bool> busy{false};
  const char* op = "";
  const std::string* axis = nullptr;
  const std::vector<int>* world_ranks = nullptr;  // the communicator's ranks in MPI_COMM_WORLD
  double deadline_s = 0;                          // 0: not bounded (shown in the table only)
  const char* during = nullptr;                   // optional: what the wait is part of ("during the checkpoint save at step 4")
  std::uint64_t seq = 0;                          // one more for every wait: the watchdog times each one itself
};
inline WaitMark& wait_mark() {
  static WaitMark m;
  return m;
}

/// Marks the scope of one blocking wait of the main thread for the watchdog.
/// Costs three sequentially consistent atomic operations and no clock read:
/// the watchdog times a wait from the first time it sees it, so a deadline
/// holds to within one watchdog period (0.1 s). `during`, when given, says
/// what the wait is part of (e.g. "during the checkpoint save at step 4"); the
/// deadline message prints it after the operation. Every pointer must stay
/// valid for the scope's lifetime.
class WaitScope {
 public:
  WaitScope(const char* op, const std::string& axis, const std::vector<int>& world_ranks, double deadline_s,
            const char* during = nullptr) {
    auto& m = wait_mark();
    if (!m.enabled.load(std::memory_order_relaxed)) return;
    m.op = op;
    m.axis = &axis;
    m.world_ranks = &world_ranks;
    m.deadline_s = deadline_s;
    m.during = during;
    ++m.seq;
    m.active.store(true);
    on_ = true;
  }
  WaitScope(const WaitScope&) = delete;
  WaitScope& operator=(const WaitScope&) = delete;
  ~WaitScope() {
    if (!on_) return;
    auto& m = wait_mark();
    m.active.store(false);
    while (m.busy.load()) std::this_thread::yield();
  }

 private:
  bool on_ = false;
};

// One rank's heartbeat in node-shared memory, written only by its watchdog.
// The strings are guarded by a sequence counter (odd while being written).
struct alignas(64) BeatSlot {
  std::atomic<std::uint32_t> version;
  std::atomic<std::int32_t> pid;
  std::atomic<double> beat;   // steady-clock seconds of the last refresh (CLOCK_MONOTONIC: one clock per machine)
  std::atomic<double> since;  // > 0: waiting in op/axis since then
  char op[32];
  char axis[64];
};
static_assert(std::atomic<double>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free,
              "weft's heartbeat table needs lock-free atomics in shared memory");

// In front of the node's slots: which rank reports the job's failure. The
// first rank of the node to claim it prints; every other rank of the node
// ends quietly, so a failure seen by many waiting ranks is printed once.
struct alignas(64) BeatHeader {
  std::atomic<std::int32_t> reporter;  // world rank + 1 of the rank that reports; 0: none yet (the zeroed file)
};

// Where the other ranks of a communicator are, for a wait past its deadline.
struct PeerReport {
  std::string text;             // "\n  did not arrive: ..." lines
  std::vector<int> missing;     // communicator ranks that did not arrive
  std::vector<int> waiting;     // world ranks waiting in the same operation
  // True when another rank of this node will report the same failure better:
  // a lower world rank waits in the same operation, or every rank that did
  // not arrive is itself waiting in another operation of this node (it is
  // nearer the fault). `defer_since`: the latest of their waits' starts.
  bool defer = false;
  double defer_since = 0;
  // True when every rank that did not arrive is on another node: this node
  // cannot tell which one failed, the other nodes can.
  bool only_other_nodes = false;
};

// What a reader saw in one slot.
struct BeatView {
  bool known = false;  // the rank is on this node and its slot could be read
  int pid = 0;
  double beat = 0, since = 0;
  std::string op, axis;
};

// The node's heartbeat table and the watchdog thread.
class Watchdog {
 public:
  static Watchdog& instance() {
    static Watchdog w;
    return w;
  }

  /// Seconds without a heartbeat after which a rank counts as not running.
  static constexpr double stale_s = 1.5;
  /// How often the watchdog refreshes this rank's slot and checks the mark.
  static constexpr double period_s = 0.1;
  /// How long a reporter that sees only ranks on other nodes waits before it
  /// prints and the job ends, so that the node that can name the failed rank
  /// (its deadline passes at about the same time) prints first.
  static constexpr double other_nodes_grace_s = 2.0;

  // Collective over MPI_COMM_WORLD (called by Environment on the main thread):
  // maps the node's table and starts the thread. Without node-shared memory
  // the wait is still bounded; peers just cannot be told apart.
  void start() {
    if (thread_.joinable()) return;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    MPI_Comm c = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    char key[64] = {};
    if (world_rank_ == 0)
      std::snprintf(key, sizeof key, "/weft-beat-%d-%llx", static_cast<int>(getpid()),
                    static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count()));
    MPI_Bcast(key, sizeof key, MPI_CHAR, 0, c);
    MPI_Comm node = MPI_COMM_NULL;
    if (split_by_node(c, world_rank_, &node) == MPI_SUCCESS) {
      int n = 1;
      MPI_Comm_size(node, &n);
      node_ranks_.assign(static_cast<std::size_t>(n), 0);
      MPI_Allgather(&world_rank_, 1, MPI_INT, node_ranks_.data(), 1, MPI_INT, node);
      const std::string name = std::string(key) + "-" + std::to_string(node_ranks_[0]);
      const std::size_t bytes = sizeof(BeatHeader) + sizeof(BeatSlot) * static_cast<std::size_t>(n);
      int ok = 0;
      const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
      if (fd >= 0) {
        if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
          void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          if (p != MAP_FAILED) {
            base_ = p;
            header_ = static_cast<BeatHeader*>(p);
            table_ = reinterpret_cast<BeatSlot*>(static_cast<char*>(p) + sizeof(BeatHeader));
            table_bytes_ = bytes;
            ok = 1;
          }
        }
        close(fd);
      }
      int all_ok = 0;
      MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, node);  // everyone mapped it: the name can go
      int node_rank = 0;
      MPI_Comm_rank(node, &node_rank);
      if (node_rank == 0) shm_unlink(name.c_str());
      if (!all_ok && table_ != nullptr) {
        munmap(base_, table_bytes_);
        base_ = nullptr;
        header_ = nullptr;
        table_ = nullptr;
      }
      if (table_ != nullptr) {
        for (std::size_t i = 0; i < node_ranks_.size(); ++i)
          if (node_ranks_[i] == world_rank_) mine_ = &table_[i];
        mine_->pid.store(static_cast<std::int32_t>(getpid()));
        mine_->beat.store(steady_seconds());
      }
      MPI_Comm_free(&node);
    }
    errors_ = c;
    stop_.store(false);
    wait_mark().enabled.store(true);
    thread_ = std::thread([this] { run(); });
  }

  // Stops the thread (main thread, before MPI_Finalize).
  void stop() {
    if (!thread_.joinable()) return;
    wait_mark().enabled.store(false);
    stop_.store(true);
    thread_.join();
    if (base_ != nullptr) munmap(base_, table_bytes_);
    base_ = nullptr;
    header_ = nullptr;
    table_ = nullptr;
    mine_ = nullptr;
    int fin = 0;
    MPI_Finalized(&fin);
    if (errors_ != MPI_COMM_NULL && !fin) MPI_Comm_free(&errors_);
    errors_ = MPI_COMM_NULL;
  }

  /// What the heartbeat table says of world rank w (known only for ranks of this node).
  BeatView view(int w) const {
    BeatView v;
    if (table_ == nullptr) return v;
    const auto it = std::find(node_ranks_.begin(), node_ranks_.end(), w);
    if (it == node_ranks_.end()) return v;
    const BeatSlot& s = table_[it - node_ranks_.begin()];
    for (int attempt = 0; attempt < 100; ++attempt) {
      const std::uint32_t v0 = s.version.load();
      if (v0 & 1u) {
        std::this_thread::yield();
        continue;
      }
      v.pid = s.pid.load();
      v.beat = s.beat.load();
      v.since = s.since.load();
      char op[sizeof s.op], axis[sizeof s.axis];
      std::memcpy(op, s.op, sizeof op);
      std::memcpy(axis, s.axis, sizeof axis);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.version.load() != v0) continue;
      op[sizeof op - 1] = axis[sizeof axis - 1] = '\0';
      v.op = op;
      v.axis = axis;
      v.known = true;
      return v;
    }
    return v;
  }

  /// A report of where every other rank of a communicator is, for a wait in
  /// `op` on `axis`: the ranks that did not arrive
  /// (and why, where the table can tell), the ranks that wait too, and those
  /// on other nodes. `missing` gets the communicator ranks that did not
  /// arrive; `waiting` the world ranks that wait in the same operation.
  std::string report(const char* op, const std::string& axis, const std::vector<int>& world_ranks,
                     std::vector<int>* missing = nullptr, std::vector<int>* waiting = nullptr) const {
    PeerReport r = survey(op, axis, world_ranks);
    if (missing) *missing = r.missing;
    if (waiting) *waiting = r.waiting;
    return r.text;
  }

  /// The report() of a wait, with what the election of the reporter needs.
  PeerReport survey(const char* op, const std::string& axis, const std::vector<int>& world_ranks) const {
    PeerReport r;
    const double now = steady_seconds();
    bool root = false;  // a rank that did not arrive is stopped, dead, busy, or on another node
    double lower_since = 0, elsewhere_since = 0;
    bool lower = false, elsewhere_wait = false;
    std::string gone, here, elsewhere;
    auto list = [](std::string& s, const std::string& item) { s += (s.empty() ? "" : ", ") + item; };
    auto secs = [](double s) {
      char b[32];
      std::snprintf(b, sizeof b, "%.1f s", s);
      return std::string(b);
    };
    for (std::size_t a = 0; a < world_ranks.size(); ++a) {
      const int w = world_ranks[a];
      if (w == world_rank_) continue;
      const std::string who = "rank " + std::to_string(a) + " (world rank " + std::to_string(w);
      const BeatView v = view(w);
      if (!v.known) {
        list(elsewhere, std::to_string(a));
        root = true;
        continue;
      }
      const std::string pid = ", pid " + std::to_string(v.pid) + ")";
      if (now - v.beat > stale_s) {
        list(gone, who + pid + " has not run for " + secs(now - v.beat) + ": it is stopped (SIGSTOP, a debugger) or dead");
        r.missing.push_back(static_cast<int>(a));
        root = true;
      } else if (v.since > 0 && v.op == op && v.axis == axis) {
        list(here, std::to_string(a));
        // Every rank waiting in the same operation counts, however long: a
        // lower rank whose own deadline is a moment later prints, not this one.
        r.waiting.push_back(w);
        if (w < world_rank_) {
          lower = true;
          lower_since = std::max(lower_since, v.since);
        }
      } else if (v.since > 0) {
        list(gone, who + pid + " has been waiting in " + v.op + " on axis '" + v.axis + "' for " +
                       secs(now - v.since));
        r.missing.push_back(static_cast<int>(a));
        elsewhere_wait = true;
        elsewhere_since = std::max(elsewhere_since, v.since);
      } else {
        list(gone, who + pid + " is running but not in a weft collective (computing, or blocked outside weft)");
        r.missing.push_back(static_cast<int>(a));
        root = true;
      }
    }
    if (lower) {
      r.defer = true;
      r.defer_since = lower_since;
    }
    if (elsewhere_wait && !root) {
      r.defer = true;
      r.defer_since = std::max(r.defer_since, elsewhere_since);
    }
    r.only_other_nodes = !elsewhere.empty() && r.missing.empty();
    std::string out;
    if (!gone.empty()) out += "\n  did not arrive: " + gone;
    if (!here.empty()) out += "\n  waiting in the same operation: rank(s) " + here;
    if (!elsewhere.empty())
      out += "\n  on other nodes (not observed from this one; their nodes report them): rank(s) " + elsewhere;
    if (out.empty()) out = "\n  (no other rank)";
    r.text = std::move(out);
    return r;
  }

  /// The world rank that reports the job's failure on this node, or -1 when
  /// none has claimed it yet.
  int reporter() const noexcept {
    if (header_ == nullptr) return local_reporter_.load() - 1;
    return header_->reporter.load() - 1;
  }

  /// Claims the report of the job's failure for this rank; true when this
  /// rank reports it (it claimed first, or already had). Without the
  /// node-shared table every rank reports its own.
  bool claim_report() noexcept {
    std::int32_t none = 0;
    if (header_ == nullptr) {
      local_reporter_.compare_exchange_strong(none, world_rank_ + 1);
      return true;
    }
    if (header_->reporter.compare_exchange_strong(none, world_rank_ + 1)) return true;
    return none == world_rank_ + 1;
  }

  /// Elects the rank of this node that prints the failure of a wait past its
  /// deadline; true when it is this one. A rank that another rank of the node
  /// reports better (PeerReport::defer) waits for that one's claim, at most
  /// until those ranks' own waits are `deadline_s` + 1 s old, and never longer
  /// than `deadline_s` + 1 s from now; then the first to claim prints.
  /// `out` gets the report as it stands when the election ends.
  /// A reporter whose report sees only ranks on other nodes waits
  /// other_nodes_grace_s more before it returns: the node that can name the
  /// failed rank prints, and ends the job, first; across hosts an MPI_Abort
  /// from this node could otherwise kill that rank before it prints.
  bool elect_reporter(const char* op, const std::string& axis, const std::vector<int>& world_ranks, double deadline_s,
                      PeerReport& out) {
    const double grace_s = 1.0;
    const double give_up = steady_seconds() + std::max(deadline_s, 0.0) + grace_s;
    for (;;) {
      out = survey(op, axis, world_ranks);
      const int r = reporter();
      if (r >= 0) return r == world_rank_;
      const double now = steady_seconds();
      if (!out.defer || now > give_up || now > out.defer_since + deadline_s + grace_s) {
        if (!claim_report()) return false;
        if (out.only_other_nodes) {
          const double until = now + other_nodes_grace_s;
          for (double t = now; t < until; t = steady_seconds()) {
            if (mine_ != nullptr) mine_->beat.store(t);
            std::this_thread::sleep_for(std::chrono::duration<double>(std::min(period_s, until - t)));
          }
          out = survey(op, axis, world_ranks);
        }
        return true;
      }
      if (mine_ != nullptr) mine_->beat.store(now);  // still running: the others must not count this rank stopped
      std::this_thread::sleep_for(std::chrono::duration<double>(period_s));
    }
  }

  int world_rank() const noexcept { return world_rank_; }

  /// weft's own duplicate of MPI_COMM_WORLD for agreeing on an error after
  /// a failure (never used by an operation that could be left pending).
  MPI_Comm errors_comm() const noexcept { return errors_; }

 private:
  Watchdog() = default;
  ~Watchdog() {
    // A program that never ran Environment's destructor (exit() from main)
    // must not join a thread at static destruction: detach it.
    if (thread_.joinable()) {
      stop_.store(true);
      thread_.detach();
    }
  }

  void publish(bool waiting, const char* op, const std::string* axis, double since) {
    if (mine_ == nullptr) return;
    const double now = steady_seconds();
    if (!waiting) {
      mine_->since.store(0.0);
    } else if (mine_->since.load() != since) {
      mine_->version.fetch_add(1);
      std::snprintf(mine_->op, sizeof mine_->op, "%s", op);
      std::snprintf(mine_->axis, sizeof mine_->axis, "%s", axis ? axis->c_str() : "?");
      mine_->since.store(since);
      mine_->version.fetch_add(1);
    }
    mine_->beat.store(now);
  }

  void run() {
    auto& m = wait_mark();
    std::uint64_t seen_seq = 0;
    double seen_at = 0;
    while (!stop_.load()) {
      std::this_thread::sleep_for(std::chrono::duration<double>(period_s));
      m.busy.store(true);
      if (!m.active.load()) {
        m.busy.store(false);
        publish(false, nullptr, nullptr, 0);
        continue;
      }
      const double now = steady_seconds();
      if (m.seq != seen_seq) {  // a wait not seen before: it began at most one period ago
        seen_seq = m.seq;
        seen_at = now;
      }
      publish(true, m.op, m.axis, seen_at);
      if (m.deadline_s > 0 && now - seen_at > m.deadline_s) end_job(m);  // keeps busy: the main thread stays put
      m.busy.store(false);
    }
  }

  // The deadline of the main thread's wait passed: say who did not arrive
  // (once per node: elect_reporter) and end the job on every rank.
  [[noreturn]] void end_job(const WaitMark& m) {
    PeerReport r;
    const bool printer = elect_reporter(m.op, *m.axis, *m.world_ranks, m.deadline_s, r);
    const std::string& peers = r.text;
    if (printer) {
      char head[512];
      std::snprintf(head, sizeof head,
                    "weft: %s on axis '%s' (%zu ranks)%s%s did not complete within the deadline of %g s on world rank %d "
                    "(WEFT_DEADLINE):",
                    m.op, m.axis->c_str(), m.world_ranks->size(), m.during ? " " : "", m.during ? m.during : "",
                    m.deadline_s, world_rank_);
      std::fprintf(stderr,
                   "%s%s\nweft: ending the job on every rank. If a step legitimately takes longer (large models, "
                   "slow file systems), set WEFT_DEADLINE to several times the longest step, in seconds (see "
                   "docs/cluster.md).\n",
                   head, peers.c_str());
      std::fflush(stderr);
    } else {
      // The rank that prints ends the job (after other_nodes_grace_s at
      // most); this one follows if it has not.
      std::this_thread::sleep_for(std::chrono::duration<double>(other_nodes_grace_s + 3.0));
    }
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

  std::thread thread_;
  std::atomic<bool> stop_{false};
  int world_rank_ = 0;
  std::vector<int> node_ranks_;  // world ranks of this node's slots, in slot order
  void* base_ = nullptr;  // the mapping: header, then the slots
  BeatHeader* header_ = nullptr;
  BeatSlot* table_ = nullptr;
  std::size_t table_bytes_ = 0;
  std::atomic<std::int32_t> local_reporter_{0};  // reporter() without a node-shared table
  MPI_Comm errors_ = MPI_COMM_NULL;
  BeatSlot* mine_ = nullptr;
};

}  // namespace weft::detail
