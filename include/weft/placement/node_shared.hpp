// NodeShared: host memory that every rank of a node can read without a system
// call, allocated in MPI shared-memory windows. A DistView whose local block
// lives there lets redistribute copy its peers' blocks straight into its
// (strided) result in one pass instead of packing around an MPI collective
// (the node-shared path of transport::NodeLocal, weft/comm/node_local.hpp).
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/comm/node_local.hpp>
#include <weft/core/error.hpp>
#include <weft/mesh/mesh.hpp>
#include <weft/placement/dist_view.hpp>

namespace weft {

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
      detail::free_shared_segment(*s);
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
    bool aligned = true;
    auto seg = detail::allocate_shared_segment(node_.native(), node_.name(), bytes, align, label, aligned);
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
    segments_.push_back(std::move(seg));  // freed by release() even if the check below fails
    WEFT_REQUIRE(aligned, ConfigError, "weft::NodeShared: MPI placed a segment of '", label,
                 "' at an address not aligned to ", align, " bytes; the element type cannot live there");
    if (bytes > 0) reg.by_base[reinterpret_cast<std::uintptr_t>(s->base)] = s;
    return s->base;
  }

  Comm node_;
  const void* mesh_ = nullptr;
  std::vector<Comm*> marked_;
  std::vector<std::unique_ptr<detail::SharedSegment>> segments_;
  bool released_ = false;
};

}  // namespace weft
