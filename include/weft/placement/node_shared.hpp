// NodeShared: host memory that every rank of a node can read without a system
// call, allocated in MPI shared-memory windows. A DistView whose local block
// lives there lets redistribute copy its peers' blocks straight into its
// (strided) result in one pass instead of packing around an MPI collective.
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/core/error.hpp>
#include <weft/mesh/mesh.hpp>
#include <weft/placement/dist_view.hpp>

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

// Completes a small collective of the node-shared path. In checked mode
// (Comm::set_checked) the wait has the communicator's deadline and becomes a
// CommError instead of a hang; otherwise the blocking call runs.
template <class NonBlocking, class Blocking>
void shared_collective(Comm& comm, const char* op, const std::string& what, NonBlocking&& nb, Blocking&& blocking) {
  auto fail = [&](const std::string& why) {
    throw CommError(op, comm.name(), "weft::redistribute on axis '" + comm.name() + "' (rank " +
                                         std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + "): " +
                                         what + ": " + why);
  };
  if (!comm.checked()) {
    const int rc = blocking();
    if (rc != MPI_SUCCESS) fail(mpi_error_text(rc));
    return;
  }
  MPI_Request rq = MPI_REQUEST_NULL;
  int rc = nb(&rq);
  if (rc != MPI_SUCCESS) fail(mpi_error_text(rc));
  const double end = MPI_Wtime() + comm.deadline();
  for (int done = 0; !done;) {
    rc = MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) fail(mpi_error_text(rc));
    if (!done && MPI_Wtime() > end)
      fail("not every rank arrived within the checked-mode deadline of " + std::to_string(comm.deadline()) +
           " s; every rank of the axis must make the same redistribute calls");
  }
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
  MPI_Comm c = comm.native();
  shared_collective(
      comm, "barrier", "the barrier after reading node-shared inputs",
      [&](MPI_Request* q) { return MPI_Ibarrier(c, q); }, [&] { return MPI_Barrier(c); });
  MPI_Win_sync(peers.seg->win);
  ++SharedRegistry::get().direct;
}

// Copies p chunks of n elements, one per peer, into dst: element k of peer
// r's chunk is src_r[(k / a * pa + ca) * a + k % a] (runs of `a` elements,
// this rank's chunk ca of pa in each) and goes to dst[(k / b * p + r) * b +
// k % b] (runs of `b`, block r of p). a and b are suffix products of the same
// extents, so one divides the other and runs of min(a, b) are whole on both
// sides: one std::copy_n per run.
template <class T>
void copy_peer_chunks(const std::vector<const char*>& peers, T* dst, std::size_t n, std::size_t a, std::size_t pa,
                      std::size_t ca, std::size_t b) {
  using Exec = Kokkos::DefaultHostExecutionSpace;
  const std::int64_t P = static_cast<std::int64_t>(peers.size());
  const std::size_t run = a < b ? a : b;
  const std::int64_t runs = static_cast<std::int64_t>(n / run);
  const char* const* src = peers.data();
  const std::size_t p = peers.size();
  Kokkos::parallel_for(
      "weft::redistribute::node_shared", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, P * runs),
      [=](const std::int64_t i) {
        const std::size_t r = static_cast<std::size_t>(i / runs);
        const std::size_t k = static_cast<std::size_t>(i % runs) * run;
        const T* s = reinterpret_cast<const T*>(src[r]) + (k / a * pa + ca) * a + k % a;
        std::copy_n(s, run, dst + (k / b * p + r) * b + k % b);
      });
  Exec().fence();
}

}  // namespace detail

/// Node-shared host memory for one mesh: every allocation is an MPI
/// shared-memory window (`MPI_Win_allocate_shared` over the ranks of
/// mesh.node()), of which each rank gets its own segment, placed in its own
/// memory (alloc_shared_noncontig), and reads its node peers' segments with
/// plain loads. DistViews allocated here (dist_view()) let
/// redistribute<Replicate> and redistribute<Shard<j>> from Shard<i> copy the
/// peers' blocks straight into the result, runs whole, with no MPI transfer
/// and no pack pass, over every mesh axis whose groups lie within one node;
/// over other axes, and whenever any rank's input is not in one such window,
/// redistribute falls back to its MPI collectives.
///
/// Lifetime rule: memory lives as long as the NodeShared; there is no freeing
/// of single allocations. Windows are freed together by release() (or the
/// destructor), which is collective over the node: every rank of the mesh
/// must construct, allocate from and release its NodeShared at the same
/// points of the program, in the same order — as for the Mesh and its
/// communicators. Views allocated here are unmanaged: drop them (and every
/// DistView on them) before release(). release() starts with a barrier over
/// the node, which in checked mode (Comm::set_checked, WEFT_CHECKED) has a
/// deadline, so a rank that never arrives gives a CommError instead of a
/// silent hang. The Mesh and the Environment must outlive the NodeShared.
/// Not thread-safe.
///
///   weft::NodeShared shm(mesh);
///   auto x = shm.dist_view<weft::DistView<float, 2, weft::On<weft::TP, weft::Shard<1>>>>(mesh, rows, cols);
///   auto y = weft::redistribute<weft::Replicate>(x, weft::TP{});   // one copy per peer block
class NodeShared {
 public:
  /// Collective over the mesh: duplicates its node communicator and turns on
  /// the node-shared path of redistribute (Comm::node_shared_peers) for each
  /// mesh axis whose groups all lie within one node.
  template <class... Axes>
  explicit NodeShared(Mesh<Axes...>& mesh)
      : node_(Comm::duplicate(mesh.node().native(), "node_shared")), mesh_(&mesh) {
    auto mark = [&]<class Tag>(std::type_identity<Tag>) {
      if (mesh.template within_node<Tag>()) {
        Comm& c = mesh.template axis<Tag>();
        c.use_node_shared_peers(true);
        marked_.push_back(&c);
      }
    };
    (mark(std::type_identity<axis_tag_t<Axes>>{}), ...);
  }
  NodeShared(const NodeShared&) = delete;
  NodeShared& operator=(const NodeShared&) = delete;
  NodeShared(NodeShared&&) = delete;
  NodeShared& operator=(NodeShared&&) = delete;

  /// Releases the windows (see release()); an error is printed, not thrown.
  ~NodeShared() {
    try {
      release();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft::NodeShared: releasing the node-shared windows failed, leaving them allocated: %s\n",
                   e.what());
    }
  }

  /// A zero-filled host view of the given extents (LayoutRight, unmanaged)
  /// in a new window. Collective over the node (see the lifetime rule).
  ///   Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace> a = shm.view<double>("a", 64, 32);
  template <class T, std::integral... I>
  Kokkos::View<typename detail::view_data<T, sizeof...(I)>::type, Kokkos::LayoutRight, Kokkos::HostSpace> view(
      const std::string& label, I... extents) {
    static_assert(sizeof...(I) >= 1 && sizeof...(I) <= 8, "weft::NodeShared::view: give between 1 and 8 extents");
    static_assert(std::is_trivially_copyable_v<T>, "weft::NodeShared::view: elements must be trivially copyable");
    std::array<long long, sizeof...(I)> e{static_cast<long long>(extents)...};
    std::size_t n = 1;
    for (std::size_t d = 0; d < e.size(); ++d) {
      WEFT_REQUIRE(e[d] >= 0, ShapeError, "weft::NodeShared::view '", label, "': extent ", d, " is negative (", e[d], ")");
      n *= static_cast<std::size_t>(e[d]);
    }
    T* p = static_cast<T*>(allocate(n * sizeof(T), alignof(T), label));
    using V = Kokkos::View<typename detail::view_data<T, sizeof...(I)>::type, Kokkos::LayoutRight, Kokkos::HostSpace>;
    return V(p, static_cast<std::size_t>(extents)...);
  }

  /// A DistView of type DV (host memory) of the given global extents on
  /// `mesh` (the mesh this NodeShared was made for), its local block
  /// zero-filled in a new window. Collective over the node.
  template <DistributedView DV, class MeshT>
  DV dist_view(MeshT& mesh, const std::array<std::size_t, DV::rank>& global_extents,
               const std::string& label = "weft::NodeShared::dist_view") {
    static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename DV::memory_space>::accessible,
                  "weft::NodeShared::dist_view: node-shared windows are host memory; use a DistView whose memory "
                  "space the host can access (e.g. Kokkos::HostSpace)");
    WEFT_REQUIRE(static_cast<const void*>(&mesh) == mesh_, ConfigError, "weft::NodeShared::dist_view '", label,
                 "': the mesh given is not the one this NodeShared was made for; make a NodeShared for that mesh");
    const auto local = DV::local_extents_on(mesh, global_extents);
    return make_dist_view<DV>(mesh, global_extents, local, label, std::make_index_sequence<DV::rank>{});
  }
  /// As above, with the global extents as arguments: shm.dist_view<DV>(mesh, 64, 128).
  template <DistributedView DV, class MeshT, std::integral... I>
    requires(sizeof...(I) == DV::rank)
  DV dist_view(MeshT& mesh, I... global_extents) {
    std::array<std::size_t, DV::rank> g{};
    std::size_t d = 0;
    for (long long e : {static_cast<long long>(global_extents)...}) {
      WEFT_REQUIRE(e >= 0, ShapeError, "weft::NodeShared::dist_view: global extent ", d, " is negative (", e, ")");
      g[d++] = static_cast<std::size_t>(e);
    }
    return dist_view<DV>(mesh, g);
  }

  /// Frees every window, in allocation order, after a barrier over the node;
  /// turns the node-shared path of redistribute off again for the axes it
  /// turned on. Collective over the node; a second call does nothing. Every
  /// view allocated here is invalid afterwards.
  void release() {
    if (released_) return;
    int fin = 0;
    MPI_Finalized(&fin);
    WEFT_REQUIRE(!fin, ConfigError,
                 "weft::NodeShared::release: MPI is already finalised; release the NodeShared (let it go out of "
                 "scope) before the Environment");
    released_ = true;
    for (Comm* c : marked_) c->use_node_shared_peers(false);
    marked_.clear();
    node_.barrier();
    auto& reg = detail::SharedRegistry::get();
    for (auto& s : segments_) {
      if (s->bytes > 0) reg.by_base.erase(reinterpret_cast<std::uintptr_t>(s->base));
      MPI_Win_unlock_all(s->win);
      MPI_Win_free(&s->win);
    }
    segments_.clear();
  }

  /// Whether release() has run.
  bool released() const noexcept { return released_; }
  /// Number of windows allocated (and not yet released).
  std::size_t windows() const noexcept { return segments_.size(); }
  /// Bytes of this rank's segments (not yet released).
  std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& s : segments_) n += s->bytes;
    return n;
  }
  /// How many redistributions in this process copied their peers' blocks
  /// out of node-shared memory instead of calling an MPI collective (for
  /// tests and diagnostics).
  static std::uint64_t direct_redistributions() noexcept { return detail::SharedRegistry::get().direct; }

 private:
  template <class DV, class MeshT, std::size_t... D>
  DV make_dist_view(MeshT& mesh, const std::array<std::size_t, DV::rank>& global,
                    const std::array<std::size_t, DV::rank>& local, const std::string& label, std::index_sequence<D...>) {
    using T = typename DV::value_type;
    static_assert(std::is_trivially_copyable_v<T>, "weft::NodeShared::dist_view: elements must be trivially copyable");
    std::size_t n = 1;
    for (std::size_t e : local) n *= e;
    T* p = static_cast<T*>(allocate(n * sizeof(T), alignof(T), label));
    return DV(mesh, global, typename DV::view_type(p, local[D]...));
  }

  // One window of `bytes` bytes per rank; returns this rank's zero-filled
  // segment. Collective over the node.
  void* allocate(std::size_t bytes, std::size_t align, const std::string& label) {
    WEFT_REQUIRE(!released_, ConfigError, "weft::NodeShared: allocating '", label,
                 "' after release(); allocate before releasing, or make a new NodeShared");
    auto seg = std::make_unique<detail::SharedSegment>();
    MPI_Info info = MPI_INFO_NULL;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    void* base = nullptr;
    const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, node_.native(), &base, &seg->win);
    MPI_Info_free(&info);
    if (rc != MPI_SUCCESS)
      throw CommError("win_allocate_shared", node_.name(),
                      "weft::NodeShared: allocating '" + label + "' (" + std::to_string(bytes) +
                          " bytes on this rank) in a node-shared window failed: " + detail::mpi_error_text(rc));
    seg->base = static_cast<char*>(base);
    seg->bytes = bytes;
    seg->rank = node_.rank();
    const auto p = static_cast<std::size_t>(node_.size());
    seg->bases.resize(p);
    seg->sizes.resize(p);
    bool aligned = true;
    for (std::size_t r = 0; r < p; ++r) {
      MPI_Aint size = 0;
      int unit = 0;
      void* b = nullptr;
      MPI_Win_shared_query(seg->win, static_cast<int>(r), &size, &unit, &b);
      seg->bases[r] = static_cast<char*>(b);
      seg->sizes[r] = static_cast<std::size_t>(size);
      aligned = aligned && (size == 0 || reinterpret_cast<std::uintptr_t>(b) % align == 0);
    }
    // Name the window (see SharedRegistry): the world rank of its rank 0 and
    // a serial the members agree on.
    auto& reg = detail::SharedRegistry::get();
    std::int64_t id[2] = {0, reg.next_serial};
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    id[0] = node_.rank() == 0 ? world_rank : -1;
    MPI_Allreduce(MPI_IN_PLACE, id, 2, MPI_INT64_T, MPI_MAX, node_.native());
    seg->leader = id[0];
    seg->serial = id[1];
    reg.next_serial = id[1] + 1;
    detail::SharedSegment* s = seg.get();
    segments_.push_back(std::move(seg));
    MPI_Win_lock_all(MPI_MODE_NOCHECK, s->win);  // a passive epoch for MPI_Win_sync, open until release
    WEFT_REQUIRE(aligned, ConfigError, "weft::NodeShared: MPI placed a segment of '", label,
                 "' at an address not aligned to ", align, " bytes; the element type cannot live there");
    if (bytes > 0) {
      std::memset(s->base, 0, bytes);  // first touch by the owner: its own memory
      reg.by_base[reinterpret_cast<std::uintptr_t>(s->base)] = s;
    }
    return s->base;
  }

  Comm node_;
  const void* mesh_ = nullptr;
  std::vector<Comm*> marked_;
  std::vector<std::unique_ptr<detail::SharedSegment>> segments_;
  bool released_ = false;
};

}  // namespace weft
