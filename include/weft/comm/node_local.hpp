// The node-local transports of weft::Comm (transport::NodeLocal): paths that
// move the bytes of a strided all-gather or all-to-all between the ranks of
// one node without MPI's own transfer, in front of MPI's collective.
//
//   - Node-shared inputs: when every rank's input lies in one MPI
//     shared-memory window (weft::NodeShared, placement/node_shared.hpp),
//     each rank copies its peers' chunks straight into its strided result.
//   - Cross-memory reads: each rank reads its peers' ordinary host inputs
//     with Linux process_vm_readv, straight into their places in its result.
//   - Staging: each rank copies what its peers need into its segment of the
//     communicator's node-shared scratch window, and they copy it out.
//
// The layout they serve is a ChunkLayout: the strided blocks of a
// Shard<i> -> Replicate or Shard<i> -> Shard<j> redistribution. Which path a
// step takes is decided by every rank alike, at run time; where none applies,
// the caller runs its MPI collective. docs/placement.md measures each one.
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/uio.h>  // process_vm_readv
#include <unistd.h>   // getpid
#include <cerrno>
#endif

#include <weft/comm/comm.hpp>
#include <weft/comm/node.hpp>
#include <weft/comm/transport.hpp>
#include <weft/core/error.hpp>

namespace weft {

namespace detail {

// One MPI shared-memory window: this rank's segment of it, and where every
// member's segment is mapped in this process (MPI_Win_shared_query).
struct SharedSegment {
  MPI_Win win = MPI_WIN_NULL;
  char* base = nullptr;         // this rank's segment
  std::size_t bytes = 0;        // its size
  int rank = 0;                 // this rank in the window's communicator
  std::int64_t leader = -1;     // MPI_COMM_WORLD rank of the window's rank 0
  std::int64_t serial = -1;     // agreed by the members when the window was made
  std::vector<char*> bases;     // every member's segment, as this process sees it
  std::vector<std::size_t> sizes;
};

// The windows of this process by the address of this rank's segment, so that
// redistribute can tell whether a view's data is node-shared. A window is
// named by (leader, serial): the serial is agreed (maximum) among its members
// and every member's next serial moves past it, so the windows that contain a
// given process have distinct serials, and two windows with the same leader
// and serial are the same window.
struct SharedRegistry {
  std::map<std::uintptr_t, SharedSegment*> by_base;
  std::int64_t next_serial = 0;
  std::uint64_t direct = 0;  // redistributions that took the node-shared path

  static SharedRegistry& get() {
    static SharedRegistry r;
    return r;
  }
  // The segment of this rank holding the bytes [p, p + n), or null.
  const SharedSegment* find(const void* p, std::size_t n) const {
    if (p == nullptr || n == 0 || by_base.empty()) return nullptr;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = by_base.upper_bound(a);
    if (it == by_base.begin()) return nullptr;
    --it;
    if (a + n > it->first + it->second->bytes) return nullptr;
    return it->second;
  }
};

// Where every rank of an axis holds its input, when all of them hold it in
// one node-shared window (empty `ptrs` otherwise).
struct SharedPeers {
  const SharedSegment* seg = nullptr;
  std::vector<const char*> ptrs;  // by rank of the axis communicator
  explicit operator bool() const noexcept { return seg != nullptr; }
};

// Where a small collective of the node-shared paths runs: the communicator
// and what its messages and checked mode need, copied out of a Comm so that a
// communicator being freed can still be synchronised on.
struct SyncSite {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string name;
  int rank = 0, size = 1;
  bool checked = false;
  double deadline = 60.0;
  std::vector<int> world_ranks;  // the communicator's ranks in MPI_COMM_WORLD, for the watchdog's report
};
inline SyncSite sync_site(const Comm& c) {
  return {c.native(), c.name(), c.rank(), c.size(), c.checked(), c.deadline(), c.world_ranks()};
}

// Completes a small collective of the node-shared paths. In checked mode
// (Comm::set_checked) the wait has the communicator's deadline and becomes a
// CommError instead of a hang; otherwise the blocking call runs, marked for
// the watchdog like every blocking collective of Comm, so the default mode's
// deadline bounds it too and the report names the ranks that did not arrive.
template <class NonBlocking, class Blocking>
void shared_collective(const SyncSite& site, const char* op, const std::string& what, NonBlocking&& nb,
                       Blocking&& blocking) {
  auto fail = [&](const std::string& why) {
    throw CommError(op, site.name, "weft::redistribute on axis '" + site.name + "' (rank " +
                                       std::to_string(site.rank) + " of " + std::to_string(site.size) + "): " + what +
                                       ": " + why);
  };
  if (!site.checked) {
    int rc = MPI_SUCCESS;
    {
      weft::detail::WaitScope scope(op, site.name, site.world_ranks, site.deadline);
      rc = blocking();
    }
    if (rc != MPI_SUCCESS) fail(mpi_error_text(rc));
    return;
  }
  MPI_Request rq = MPI_REQUEST_NULL;
  int rc = nb(&rq);
  if (rc != MPI_SUCCESS) fail(mpi_error_text(rc));
  const double end = MPI_Wtime() + site.deadline;
  for (int done = 0; !done;) {
    rc = MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) fail(mpi_error_text(rc));
    if (!done && MPI_Wtime() > end)
      fail("not every rank arrived within the checked-mode deadline of " + std::to_string(site.deadline) +
           " s; every rank of the axis must make the same redistribute calls");
  }
}
template <class NonBlocking, class Blocking>
void shared_collective(Comm& comm, const char* op, const std::string& what, NonBlocking&& nb, Blocking&& blocking) {
  shared_collective(sync_site(comm), op, what, std::forward<NonBlocking>(nb), std::forward<Blocking>(blocking));
}

// A barrier of the node-shared paths (with checked mode's deadline).
inline void shared_barrier(const SyncSite& site, const std::string& what) {
  MPI_Comm c = site.comm;
  shared_collective(
      site, "barrier", what, [&](MPI_Request* q) { return MPI_Ibarrier(c, q); }, [&] { return MPI_Barrier(c); });
}

// One MPI shared-memory window over `comm` (whose ranks must share a node)
// with `bytes` bytes on this rank: its segment zero-filled by its owner (so
// placed in its memory: alloc_shared_noncontig), every member's segment
// queried, and a passive epoch open (MPI_Win_lock_all) for MPI_Win_sync until
// free_shared_segment. `aligned` tells whether every segment starts on an
// `align`-byte boundary. Collective over comm. Used by NodeShared and by the
// staging window.
inline std::unique_ptr<SharedSegment> allocate_shared_segment(MPI_Comm comm, const std::string& comm_name,
                                                              std::size_t bytes, std::size_t align,
                                                              const std::string& label, bool& aligned) {
  auto seg = std::make_unique<SharedSegment>();
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, comm, &base, &seg->win);
  MPI_Info_free(&info);
  if (rc != MPI_SUCCESS)
    throw CommError("win_allocate_shared", comm_name,
                    "weft: allocating '" + label + "' (" + std::to_string(bytes) +
                        " bytes on this rank) in a node-shared window over '" + comm_name +
                        "' failed: " + mpi_error_text(rc));
  seg->base = static_cast<char*>(base);
  seg->bytes = bytes;
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  seg->rank = rank;
  const auto p = static_cast<std::size_t>(size);
  seg->bases.resize(p);
  seg->sizes.resize(p);
  aligned = true;
  for (std::size_t r = 0; r < p; ++r) {
    MPI_Aint sz = 0;
    int unit = 0;
    void* b = nullptr;
    MPI_Win_shared_query(seg->win, static_cast<int>(r), &sz, &unit, &b);
    seg->bases[r] = static_cast<char*>(b);
    seg->sizes[r] = static_cast<std::size_t>(sz);
    aligned = aligned && (sz == 0 || reinterpret_cast<std::uintptr_t>(b) % align == 0);
  }
  MPI_Win_lock_all(MPI_MODE_NOCHECK, seg->win);
  if (bytes > 0) std::memset(seg->base, 0, bytes);  // first touch by the owner: its own memory
  return seg;
}

// Ends the window's epoch and frees it. Collective over its communicator:
// call it after a barrier that shows every member done with the window.
inline void free_shared_segment(SharedSegment& seg) {
  if (seg.win == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(seg.win);
  MPI_Win_free(&seg.win);
  seg.base = nullptr;
  seg.bytes = 0;
}

// Collective over `comm` when comm.node_shared_peers() (otherwise no call at
// all, on every rank alike): the ranks exchange where their `bytes` bytes at
// `mine` lie (one small MPI_Allgather, which is also the point from which
// every rank's input is complete) and all of them reach the same answer, so
// all take the same path. On success, peers' writes made before the call are
// visible here (MPI_Win_sync on both sides of the exchange, the unified
// memory model's rule for load/store access to a shared window).
inline SharedPeers find_shared_peers(Comm& comm, const void* mine, std::size_t bytes) {
  SharedPeers out;
  if (!comm.node_shared_peers() || comm.size() < 2) return out;
  const SharedSegment* seg = SharedRegistry::get().find(mine, bytes);
  // leader, serial, rank in the window, offset in the rank's segment, bytes
  std::int64_t info[5] = {-1, -1, -1, 0, static_cast<std::int64_t>(bytes)};
  if (seg != nullptr) {
    info[0] = seg->leader;
    info[1] = seg->serial;
    info[2] = seg->rank;
    info[3] = static_cast<std::int64_t>(static_cast<const char*>(mine) - seg->base);
    MPI_Win_sync(seg->win);  // this rank's writes reach memory before the others read
  }
  const auto p = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> all(5 * p);
  MPI_Comm c = comm.native();
  shared_collective(
      comm, "all_gather", "agreeing on node-shared inputs",
      [&](MPI_Request* q) { return MPI_Iallgather(info, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, c, q); },
      [&] { return MPI_Allgather(info, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, c); });
  for (std::size_t r = 0; r < p; ++r) {
    const std::int64_t* q = &all[5 * r];
    if (q[0] < 0 || q[0] != all[0] || q[1] != all[1] || q[4] != all[4]) return out;
  }
  // This rank's entry passed too, so seg is its window (the same on every rank).
  for (std::size_t r = 0; r < p; ++r)
    if (all[5 * r + 2] < 0 || static_cast<std::size_t>(all[5 * r + 2]) >= seg->bases.size()) return out;
  // Every rank's input is in the window this rank found (see SharedRegistry).
  out.ptrs.resize(p);
  for (std::size_t r = 0; r < p; ++r) {
    const std::int64_t* q = &all[5 * r];
    out.ptrs[r] = seg->bases[static_cast<std::size_t>(q[2])] + q[3];
  }
  MPI_Win_sync(seg->win);  // and this rank sees theirs
  out.seg = seg;
  return out;
}

// After reading peers' inputs: nobody may change its input (or free it)
// before every rank has read it.
inline void release_shared_peers(Comm& comm, const SharedPeers& peers) {
  MPI_Win_sync(peers.seg->win);
  shared_barrier(sync_site(comm), "the barrier after reading node-shared inputs");
  MPI_Win_sync(peers.seg->win);
  ++SharedRegistry::get().direct;
}

// Copies one chunk of n elements from src into dst: element k of the chunk
// is src[(k / a * pa + ca) * a + k % a] (runs of `a` elements, chunk ca of
// pa in each) and goes to dst[(k / b * p + r) * b + k % b] (runs of `b`,
// block r of p). a and b are suffix products of the same extents, so one
// divides the other and runs of min(a, b) are whole on both sides: one
// std::copy_n per run. Does not fence.
template <class T>
void copy_chunk(const T* src, T* dst, std::size_t n, std::size_t a, std::size_t pa, std::size_t ca, std::size_t b,
                std::size_t p, std::size_t r) {
  using Exec = Kokkos::DefaultHostExecutionSpace;
  const std::size_t run = a < b ? a : b;
  if (n == 0 || run == 0) return;
  Kokkos::parallel_for(
      "weft::redistribute::node_shared",
      Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, static_cast<std::int64_t>(n / run)),
      [=](const std::int64_t i) {
        const std::size_t k = static_cast<std::size_t>(i) * run;
        std::copy_n(src + (k / a * pa + ca) * a + k % a, run, dst + (k / b * p + r) * b + k % b);
      });
}

// Copies p chunks of n elements, one per peer, into dst: chunk r comes from
// peers[r] (copy_chunk with a, pa, ca) and is block r of p in dst (runs of b).
template <class T>
void copy_peer_chunks(const std::vector<const char*>& peers, T* dst, std::size_t n, std::size_t a, std::size_t pa,
                      std::size_t ca, std::size_t b) {
  const std::size_t p = peers.size();
  for (std::size_t r = 0; r < p; ++r) copy_chunk(reinterpret_cast<const T*>(peers[r]), dst, n, a, pa, ca, b, p, r);
  Kokkos::DefaultHostExecutionSpace().fence();
}

// ---------------------------------------------------------------- staging
// The node-shared staging window of one communicator (Comm::staging_state):
// a scratch window over the communicator itself, of which each rank's
// segment holds a copy of its input while its peers copy their chunks out.
// It lives in the communicator's state and is freed, collectively, just
// before the communicator (Comm::release), with NodeShared's lifetime rule:
// a barrier (with checked mode's deadline) first, and when that fails, or the
// process is leaving with an error (an exception unwinding, a communicator
// whose deadline passed), or MPI is already finalised, the window is left
// allocated and nothing is waited for.
struct StagingWindow {
  SyncSite site;
  std::unique_ptr<SharedSegment> seg;
  std::size_t* bytes_out = nullptr;  // CommCore::staging_bytes, kept equal to seg->bytes

  StagingWindow(const StagingWindow&) = delete;
  StagingWindow& operator=(const StagingWindow&) = delete;
  StagingWindow(SyncSite s, std::size_t* out) : site(std::move(s)), bytes_out(out) {}
  ~StagingWindow() {
    if (!seg) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin || std::uncaught_exceptions() > 0 || comm_poisoned()) return;
    try {
      shared_barrier(site, "the barrier before freeing the node-shared staging window");
      free_shared_segment(*seg);
      *bytes_out = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft: freeing the node-shared staging window of '%s' failed, leaving it allocated: %s\n",
                   site.name.c_str(), e.what());
    }
  }

  // Each segment holds two buffers of `capacity` bytes, used by turns
  // (`turn`, the same on every rank): a rank may fill one buffer while a
  // slower peer still reads the other from the previous step, so a step
  // needs no closing barrier (see stage_through_node_shared). The buffers
  // start at the segment's first 64-byte boundary (Open MPI places segments
  // 8 bytes past a page boundary; mappings keep the offset within the page,
  // so every process finds the same boundaries).
  std::vector<char*> data;
  std::size_t capacity = 0;
  int turn = 0;
  static constexpr std::size_t align = 64;

  // Rank r's buffer of this turn.
  char* buffer(std::size_t r) const { return data[r] + static_cast<std::size_t>(turn) * capacity; }

  // Replaces the window by one with two buffers of `bytes` bytes (a multiple
  // of 64) per rank. Collective over the communicator; every member must be
  // done with the old window (it is, once every rank has entered the step
  // that grows it).
  void grow(std::size_t bytes) {
    if (seg) free_shared_segment(*seg);
    seg.reset();
    data.clear();
    capacity = 0;
    turn = 0;
    *bytes_out = 0;
    bool aligned = true;
    seg = allocate_shared_segment(site.comm, site.name, 2 * bytes + align, 1, "weft::redistribute::staging", aligned);
    *bytes_out = seg->bytes;
    for (char* b : seg->bases) {
      const auto a = reinterpret_cast<std::uintptr_t>(b);
      data.push_back(b + (align - a % align) % align);
    }
    capacity = bytes;
  }
};

// Whether every rank of `comm` shares this rank's node. Collective over comm
// the first time (MPI_Comm_split_type); the answer is kept in the
// communicator's state, and is the same on every rank.
inline bool comm_within_node(Comm& comm) {
  auto& st = comm.staging_state();
  if (st.within_node < 0) {
    MPI_Comm node = MPI_COMM_NULL;
    int rc = split_by_node(comm.native(), 0, &node);
    if (rc != MPI_SUCCESS)
      throw CommError("comm_split_type", comm.name(),
                      "weft::redistribute on axis '" + comm.name() +
                          "': finding the ranks that share this node failed: " + mpi_error_text(rc));
    int n = 0;
    MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
    st.within_node = n == comm.size() ? 1 : 0;  // a group that spans nodes is smaller on every rank
  }
  return st.within_node == 1;
}

// The most bytes a rank copies into the staging window in one step (all of
// its input for Shard -> Replicate, the (p - 1) / p of it its peers need for
// Shard -> Shard) for the step to stage; larger steps take the MPI path.
// 512 KiB by default: on 2 ranks of one node (docs/placement.md, "Node-shared
// staging") staging beat the MPI path up to there and lost from 1 MiB per
// rank on, where a peer's freshly written buffer no longer comes from a
// nearby cache. The environment variable WEFT_NODE_SHARED_STAGING_MAX_BYTES
// overrides it. Read once.
// The byte count in environment variable `name`, or `fallback` when it is
// unset; ConfigError (showing `example`) when it is not a byte count.
inline std::size_t env_byte_count(const char* name, const char* example, std::size_t fallback) {
  const char* e = std::getenv(name);
  if (e == nullptr) return fallback;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(e, &end, 10);
  WEFT_REQUIRE(end != e && *end == '\0', ConfigError, name, " must be a byte count such as ", example, ", got '", e, "'");
  return static_cast<std::size_t>(n);
}

inline std::size_t node_shared_staging_max_bytes() {
  static const std::size_t v = env_byte_count("WEFT_NODE_SHARED_STAGING_MAX_BYTES", "524288", std::size_t(512) << 10);
  return v;
}

// How many redistributions in this process took the staging path.
inline std::uint64_t& staged_count() {
  static std::uint64_t n = 0;
  return n;
}

// The staging path of a Shard -> Replicate or Shard -> Shard step on host
// memory (n, a, pa, ca, b as for copy_peer_chunks; pa is 1 for Replicate and
// the axis size for Shard). When comm.node_shared_staging() is on, the
// communicator has 2 or more ranks and they all share a node (the same answer
// on every rank): each rank copies what its peers need of its `bytes`-byte
// input `src` into its buffer of this turn in the communicator's staging
// window (all of it for Replicate; for Shard, chunk r packed into region r,
// for r != this rank); one MPI_Allreduce synchronises and agrees on the
// window's size (when any rank's input does not fit, all grow the window to
// the largest input, copy again and meet at a barrier); each rank copies its
// peers' chunks out of their buffers into dst (its own straight from src).
// Buffers alternate between steps (StagingWindow::turn), which stands in for
// a closing barrier. Steps that would copy more than
// node_shared_staging_max_bytes() into the window do not stage. Returns false, having done nothing collective beyond
// comm_within_node, when staging does not apply: the caller then takes its
// MPI path, on every rank alike.
template <class T>
bool stage_through_node_shared(Comm& comm, const T* src, std::size_t bytes, T* dst, std::size_t n, std::size_t a,
                               std::size_t pa, std::size_t ca, std::size_t b) {
  if (bytes == 0 || !comm.node_shared_staging() || comm.size() < 2) return false;
  const std::size_t p = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  // Blocks are equal on every rank, so every rank decides alike.
  if ((pa == 1 ? bytes : bytes / p * (p - 1)) > node_shared_staging_max_bytes() || !comm_within_node(comm))
    return false;
  auto& st = comm.staging_state();
  if (!st.staging_window) st.staging_window = std::make_shared<StagingWindow>(sync_site(comm), &st.staging_bytes);
  auto& w = *static_cast<StagingWindow*>(st.staging_window.get());
  w.site = sync_site(comm);  // checked mode may have changed since
  // Shard -> Replicate (pa == 1): every peer needs the whole input, copied
  // as it is. Shard -> Shard (pa == p): peer r needs only chunk r, which is
  // packed into region r (n elements) of this rank's segment; this rank's
  // own chunk never goes through the window.
  auto copy_in = [&] {
    T* mine = reinterpret_cast<T*>(w.buffer(me));
    if (pa == 1) {
      std::memcpy(mine, src, bytes);
    } else {
      for (std::size_t r = 0; r < p; ++r)
        if (r != me) copy_chunk(src, mine + r * n, n, a, pa, r, n, 1, 0);
      Kokkos::DefaultHostExecutionSpace().fence();
    }
    MPI_Win_sync(w.seg->win);  // this rank's writes reach memory before the others read
  };
  static_assert(alignof(T) <= StagingWindow::align, "weft::redistribute: element alignment above 64 bytes");
  const bool fits = w.seg && bytes <= w.capacity;
  if (fits) copy_in();
  // The largest input, and whether any rank's did not fit; the allreduce is
  // also the point from which every rank's copy is complete.
  std::int64_t v[2] = {static_cast<std::int64_t>(bytes), fits ? 0 : 1};
  MPI_Comm c = comm.native();
  shared_collective(
      w.site, "all_reduce", "agreeing on the node-shared staging window",
      [&](MPI_Request* q) { return MPI_Iallreduce(MPI_IN_PLACE, v, 2, MPI_INT64_T, MPI_MAX, c, q); },
      [&] { return MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_INT64_T, MPI_MAX, c); });
  if (v[1] != 0) {
    // Grown to the largest input, rounded up to whole 64 KiB: every rank
    // computes the same size from the agreed values.
    const std::size_t need = static_cast<std::size_t>(v[0]);
    w.grow(std::max<std::size_t>((need + 65535) / 65536 * 65536, 65536));
    copy_in();
    shared_barrier(w.site, "the barrier after staging inputs in the node-shared window");
  }
  MPI_Win_sync(w.seg->win);  // and this rank sees theirs
  for (std::size_t r = 0; r < p; ++r) {
    if (r == me)
      copy_chunk(src, dst, n, a, pa, ca, b, p, r);
    else if (pa == 1)
      copy_chunk(reinterpret_cast<const T*>(w.buffer(r)), dst, n, a, 1, 0, b, p, r);
    else
      copy_chunk(reinterpret_cast<const T*>(w.buffer(r)) + me * n, dst, n, n, 1, 0, b, p, r);
  }
  Kokkos::DefaultHostExecutionSpace().fence();
  // No closing barrier: the next step writes the other buffer, and the step
  // after it writes this one only after its allreduce, to which every peer
  // contributes after finishing these reads.
  w.turn ^= 1;
  ++staged_count();
  return true;
}

// ------------------------------------------------------ cross-memory reads
// How many redistributions in this process read their peers' inputs with
// cross-memory attach.
inline std::uint64_t& cross_memory_count() {
  static std::uint64_t n = 0;
  return n;
}

// A value that identifies this process, at a fixed address: a peer reads it
// along with the data and compares it with what this process published, so
// that a process id that names another process (ranks in different pid
// namespaces) fails the read instead of copying the wrong memory.
inline const std::uint64_t& process_identity() {
  static const std::uint64_t v = [] {
    std::uint64_t x = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    x ^= reinterpret_cast<std::uintptr_t>(&x) * 0x9E3779B97F4A7C15ull;
#if defined(__linux__)
    x ^= static_cast<std::uint64_t>(::getpid()) << 32;
#endif
    return x | 1;  // never 0, which the reader's slot starts as
  }();
  return v;
}

// The cross-memory path of a Shard -> Replicate or Shard -> Shard step on host
// memory (n, a, pa, ca, b as for copy_peer_chunks). When
// comm.cross_memory_attach() is on and the communicator's 2 or more ranks
// share a node (the same answer on every rank): the ranks exchange their
// process ids and input addresses (one small all-gather, from which every
// input is complete); each rank reads its chunk of every peer's input
// straight into its place in dst with process_vm_readv (runs of min(a, b)
// elements, merged on each side where contiguous, up to 1024 vectors a side
// per call) and
// copies its own; one MPI_Allreduce then agrees that every read succeeded,
// and is the point after which a peer may change its input again. If any
// read failed, cross_memory_attach() goes off for good on the communicator,
// on every rank, and false is returned, as when the path does not apply: the
// caller then takes its other paths, which rewrite all of dst.
template <class T>
bool read_peers_cross_memory(Comm& comm, const T* src, std::size_t bytes, T* dst, std::size_t n, std::size_t a,
                             std::size_t pa, std::size_t ca, std::size_t b) {
#if defined(__linux__)
  if (bytes == 0 || !comm.cross_memory_attach() || comm.size() < 2 || !comm_within_node(comm)) return false;
  const std::size_t p = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  const std::uint64_t& id = process_identity();
  std::int64_t info[4] = {static_cast<std::int64_t>(::getpid()),
                          static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(src)),
                          static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(&id)), static_cast<std::int64_t>(id)};
  std::vector<std::int64_t> all(4 * p);
  MPI_Comm c = comm.native();
  shared_collective(
      comm, "all_gather", "exchanging input addresses for cross-memory reads",
      [&](MPI_Request* q) { return MPI_Iallgather(info, 4, MPI_INT64_T, all.data(), 4, MPI_INT64_T, c, q); },
      [&] { return MPI_Allgather(info, 4, MPI_INT64_T, all.data(), 4, MPI_INT64_T, c); });
  copy_chunk(src, dst, n, a, pa, ca, b, p, me);
  int ok = 1, err = 0;
  const std::size_t run = a < b ? a : b;
  std::vector<iovec> local, remote;
  local.reserve(1024);
  remote.reserve(1024);
  // Whether bytes at `at` continue the last vector of v; append extends it then.
  auto joins = [](const std::vector<iovec>& v, std::uintptr_t at) {
    return !v.empty() && reinterpret_cast<std::uintptr_t>(v.back().iov_base) + v.back().iov_len == at;
  };
  auto append = [&](std::vector<iovec>& v, std::uintptr_t at, std::size_t len) {
    if (joins(v, at)) v.back().iov_len += len;
    else v.push_back({reinterpret_cast<void*>(at), len});
  };
  pid_t pid = 0;
  std::size_t want = 0;
  auto flush = [&] {
    if (local.empty()) return;
    const ssize_t got = ::process_vm_readv(pid, local.data(), local.size(), remote.data(), remote.size(), 0);
    if (got < 0 || static_cast<std::size_t>(got) != want) {
      ok = 0;
      err = got < 0 ? errno : 0;
    }
    local.clear();
    remote.clear();
    want = 0;
  };
  std::uint64_t seen = 0;  // the peer's identity, read with its first batch
  for (std::size_t r = 0; r < p && ok && run > 0; ++r) {
    if (r == me) continue;
    pid = static_cast<pid_t>(all[4 * r]);
    const auto base = static_cast<std::uintptr_t>(all[4 * r + 1]);
    seen = 0;
    local.push_back({&seen, sizeof seen});
    remote.push_back({reinterpret_cast<void*>(static_cast<std::uintptr_t>(all[4 * r + 2])), sizeof seen});
    want += sizeof seen;
    for (std::size_t k = 0; k < n && ok; k += run) {
      const std::uintptr_t from = base + ((k / a * pa + ca) * a + k % a) * sizeof(T);
      const auto to = reinterpret_cast<std::uintptr_t>(dst + (k / b * p + r) * b + k % b);
      const std::size_t len = run * sizeof(T);
      // The two sides are streams of the same runs in the same order, so each
      // merges its own contiguous runs: a peer's contiguous chunk read into
      // strided rows is one remote vector and one local vector per row (the
      // kernel pins the remote pages once per remote vector).
      if ((!joins(local, to) && local.size() == 1024) || (!joins(remote, from) && remote.size() == 1024)) flush();
      append(local, to, len);
      append(remote, from, len);
      want += len;
    }
    flush();
    if (seen != static_cast<std::uint64_t>(all[4 * r + 3])) ok = 0;  // another process than the peer
  }
  Kokkos::DefaultHostExecutionSpace().fence();
  shared_collective(
      comm, "all_reduce", "agreeing that the cross-memory reads succeeded",
      [&](MPI_Request* q) { return MPI_Iallreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, c, q); },
      [&] { return MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, c); });
  if (!ok) {
    comm.staging_state().cma_failed = true;
    if (err != 0)
      std::fprintf(stderr, "weft: rank %d of axis '%s': cross-memory reads failed (%s); redistribute uses its other "
                   "paths on this axis from now on\n", comm.rank(), comm.name().c_str(), std::strerror(err));
    return false;
  }
  ++cross_memory_count();
  return true;
#else
  (void)comm, (void)src, (void)bytes, (void)dst, (void)n, (void)a, (void)pa, (void)ca, (void)b;
  return false;
#endif
}

// The size from which MPI's derived datatypes (Comm's BlockLayout) move a
// strided host exchange faster than the pack kernels and the cross-memory
// reads: 8 MiB by default; the environment variable
// WEFT_BLOCKED_LAYOUT_MIN_BYTES overrides it (0: always; the tests run both
// paths that way). Read once. Measured on 2 ranks of one node
// (docs/placement.md): the datatype path wins from 16 MiB on and loses at
// 1-4 MiB.
inline std::size_t blocked_layout_min_bytes() {
  static const std::size_t v = env_byte_count("WEFT_BLOCKED_LAYOUT_MIN_BYTES", "8388608", std::size_t(8) << 20);
  return v;
}

}  // namespace detail

/// The strided blocks of one all-gather or all-to-all among the p ranks of a
/// communicator, as the node-local transports move them (the layouts of
/// redistribute's Shard<i> -> Replicate and Shard<i> -> Shard<j> steps).
/// Each rank receives one chunk of `chunk` elements from every peer r:
/// element k of it is the peer's src[(k / src_run * src_chunks + src_index)
/// * src_run + k % src_run] (runs of src_run elements, chunk src_index of
/// src_chunks in each), and it becomes block r of p in dst: dst[(k /
/// dst_run * p + r) * dst_run + k % dst_run]. src_run and dst_run are suffix
/// products of the same extents, so one divides the other.
struct ChunkLayout {
  std::size_t chunk = 0;       ///< elements each rank receives from each peer
  std::size_t src_run = 1;     ///< run length on the sending side
  std::size_t src_chunks = 1;  ///< 1: every peer gets the whole input (all-gather); p: chunk r goes to rank r
  std::size_t src_index = 0;   ///< which of src_chunks this rank receives (its rank for an all-to-all, else 0)
  std::size_t dst_run = 1;     ///< run length on the receiving side
  bool packs = false;          ///< MPI would need a pack or unpack pass, or a derived datatype (a strided side)
};

/// Moves one exchange of `layout` over `comm` by the node-local paths of
/// transport Tr, when one applies: for transport::NodeLocal, in this order,
/// the peers' inputs read in place out of one node-shared window (when
/// comm.node_shared_peers()), cross-memory reads (a packing layout below
/// detail::blocked_layout_min_bytes(), comm.cross_memory_attach()) and the
/// staging window (a packing layout, comm.node_shared_staging()). `src`
/// holds this rank's `src_elems` elements in memory the host can access,
/// ready once Exec is fenced; dst receives p blocks. The copy is recorded in
/// comm's statistics as one call of `kind` moving `bytes`. Returns true when
/// the exchange is done; false, on every rank alike and with dst untouched,
/// when the caller must run its MPI collective (always, for transport::Mpi).
/// Collective over comm.
template <Transport Tr, class Exec, class T>
bool exchange_in_node(Comm& comm, const T* src, std::size_t src_elems, T* dst, const ChunkLayout& layout,
                      CommKind kind, std::uint64_t bytes) {
  if constexpr (!std::is_same_v<Tr, transport::NodeLocal>) {
    (void)comm, (void)src, (void)src_elems, (void)dst, (void)layout, (void)kind, (void)bytes;
    return false;
  } else {
    const std::size_t n = layout.chunk, a = layout.src_run, pa = layout.src_chunks, ca = layout.src_index,
                      b = layout.dst_run;
    const std::size_t src_bytes = src_elems * sizeof(T);
    if (comm.node_shared_peers()) {
      const double t0 = detail::now_seconds();
      Exec().fence();
      const detail::SharedPeers peers = detail::find_shared_peers(comm, src, src_bytes);
      if (peers) {
        detail::copy_peer_chunks<T>(peers.ptrs, dst, n, a, pa, ca, b);
        detail::release_shared_peers(comm, peers);
        comm.record(kind, bytes, detail::now_seconds() - t0);
        return true;
      }
    }
    // Below the size from which MPI's derived datatypes place the blocks:
    // above it, MPI's pipelined copies measured faster than one rank reading
    // a whole strided chunk (docs/placement.md, "Cross-memory reads").
    if (layout.packs && bytes < detail::blocked_layout_min_bytes() && comm.cross_memory_attach()) {
      const double t0 = detail::now_seconds();
      Exec().fence();
      if (detail::read_peers_cross_memory<T>(comm, src, src_bytes, dst, n, a, pa, ca, b)) {
        comm.record(kind, bytes, detail::now_seconds() - t0);
        return true;
      }
    }
    if (layout.packs && comm.node_shared_staging()) {
      const double t0 = detail::now_seconds();
      Exec().fence();
      if (detail::stage_through_node_shared<T>(comm, src, src_bytes, dst, n, a, pa, ca, b)) {
        comm.record(kind, bytes, detail::now_seconds() - t0);
        return true;
      }
    }
    return false;
  }
}

/// How many redistributions in this process staged ordinary host inputs
/// through a communicator's node-shared scratch window
/// (Comm::node_shared_staging) instead of calling an MPI collective (for
/// tests and diagnostics).
inline std::uint64_t staged_redistributions() noexcept { return detail::staged_count(); }

/// How many redistributions in this process read their peers' host inputs
/// directly with cross-memory attach (Comm::cross_memory_attach) instead of
/// calling an MPI collective (for tests and diagnostics).
inline std::uint64_t cross_memory_redistributions() noexcept { return detail::cross_memory_count(); }

}  // namespace weft
