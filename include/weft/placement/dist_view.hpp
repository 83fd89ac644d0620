// DistView: one rank's part of a tensor distributed over a mesh. It holds the
// local Kokkos view, the global extents and the mesh's axis communicators, and
// knows, from its placement types, which global element each local one is.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <Kokkos_Core.hpp>

#include <weft/comm/comm.hpp>
#include <weft/core/allocation.hpp>
#include <weft/core/error.hpp>
#include <weft/mesh/axis.hpp>
#include <weft/mesh/mesh.hpp>
#include <weft/placement/placement.hpp>

namespace weft {

// ------------------------------------------------------------------- extents

/// Global extents of a DistView, each static (a number) or weft::dynamic_extent,
/// as in std::extents: Extents<1024, dynamic_extent>.
template <std::size_t... E>
struct Extents {
  static constexpr std::size_t rank = sizeof...(E);                           ///< number of dimensions
  static constexpr std::array<std::size_t, rank> static_extents{E...};        ///< dynamic_extent where dynamic
};

namespace detail {
template <class Seq>
struct dextents_impl;
template <std::size_t... I>
struct dextents_impl<std::index_sequence<I...>> {
  using type = Extents<((void)I, dynamic_extent)...>;
};
template <class E>
struct is_extents : std::false_type {};
template <std::size_t... E>
struct is_extents<Extents<E...>> : std::true_type {};
}  // namespace detail

/// Rank extents, all dynamic.
template <std::size_t Rank>
using dextents = typename detail::dextents_impl<std::make_index_sequence<Rank>>::type;

namespace detail {

// Kokkos spells a rank-R view of T as T* ... * (R stars).
template <class T, std::size_t R>
struct view_data {
  using type = typename view_data<T, R - 1>::type*;
};
template <class T>
struct view_data<T, 0> {
  using type = T;
};

// The communicators of a mesh's axes, by name. Copies of a DistView share the
// communicators through these pointers, so the mesh must outlive its views;
// the pointers stay valid when the mesh itself is moved.
struct AxisTable {
  static constexpr std::size_t capacity = 8;
  std::array<std::string_view, capacity> names{};
  std::array<Comm*, capacity> comms{};
  std::size_t count = 0;

  Comm* find(std::string_view name) const {
    for (std::size_t i = 0; i < count; ++i)
      if (names[i] == name) return comms[i];
    return nullptr;
  }
  std::string describe() const {
    std::string s;
    for (std::size_t i = 0; i < count; ++i) {
      if (i) s += " x ";
      s += names[i];
      s += '=';
      s += std::to_string(comms[i]->size());
    }
    return s;
  }
};

template <class M>
struct mesh_traits {
  static constexpr bool is_mesh = false;
};
template <class... Axes>
struct mesh_traits<Mesh<Axes...>> {
  static constexpr bool is_mesh = true;
  static AxisTable table(Mesh<Axes...>& m) {
    static_assert(sizeof...(Axes) <= AxisTable::capacity,
                  "weft::DistView: meshes with more than 8 axes are not supported");
    AxisTable t;
    ((t.names[t.count] = axis_tag_t<Axes>::name, t.comms[t.count] = &m.template axis<axis_tag_t<Axes>>(), ++t.count), ...);
    return t;
  }
};

// Checked where a DistView of static extents is built on a mesh of static
// extents. The template arguments name the dimension, its extent and the
// number of ranks that split it in the compiler's note.
template <std::size_t Dim, std::size_t Extent, std::size_t Parts>
struct static_shard_check {
  static_assert(Extent % Parts == 0,
                "weft::DistView: the static extent of a sharded dimension (Extent) is not divisible by the number "
                "of ranks that split it (Parts, the product of the static mesh axis extents that shard dimension "
                "Dim). weft does not pad: change the extent or the mesh.");
  static constexpr bool ok = true;
};

struct internal_tag {};

}  // namespace detail

/// A DistView's map from local to global indices, trivially copyable so that
/// kernels can capture it: the local block of every dimension is one
/// contiguous range of the global one, starting at offset[d].
template <std::size_t Rank>
struct IndexMap {
  std::size_t offset[Rank];         ///< global index of local index 0, per dimension
  std::size_t local_extent[Rank];   ///< local extents
  std::size_t global_extent[Rank];  ///< global extents

  /// The global index along dimension d of local index k.
  KOKKOS_INLINE_FUNCTION std::size_t global(std::size_t d, std::size_t k) const { return offset[d] + k; }

  /// The row-major global linear index of the element at row-major local
  /// linear index n (the i-th element of local().data()).
  KOKKOS_INLINE_FUNCTION std::size_t global_linear(std::size_t n) const {
    std::size_t g = 0, stride = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      const std::size_t k = n % local_extent[d];
      n /= local_extent[d];
      g += (offset[d] + k) * stride;
      stride *= global_extent[d];
    }
    return g;
  }
};

/// A tensor of global extents Ext (weft::Extents or weft::dextents<R>) with
/// elements T, distributed over mesh axes as the On<Axis, Placement>s say;
/// axes not named hold it replicated. Each rank holds its block in a
/// LayoutRight Kokkos view in MemorySpace. Copies share the view, like
/// Kokkos::View. The mesh it was built on must outlive it.
template <class T, class Ext, class MemorySpace, class... Ons>
class BasicDistView {
  static_assert(detail::is_extents<Ext>::value,
                "weft::BasicDistView: the second parameter must be weft::Extents<E...> or weft::dextents<Rank>");
  static_assert(Ext::rank >= 1 && Ext::rank <= 8, "weft::DistView: the rank must be between 1 and 8 (Kokkos' limit)");
  static_assert((OnPlacement<Ons> && ...),
                "weft::DistView: every placement must name its mesh axis, e.g. weft::On<weft::TP, weft::Shard<0>>, "
                "not a bare weft::Shard<0>");
  static_assert(detail::axes_unique<Ons...>(),
                "weft::DistView: a mesh axis is named twice among the placements; give each axis one placement");
  static_assert(((detail::shard_dim_or_npos<typename Ons::placement>() == detail::npos ||
                  detail::shard_dim_or_npos<typename Ons::placement>() < Ext::rank) &&
                 ...),
                "weft::DistView: a Shard<D> names a dimension D that the tensor does not have (D must be smaller "
                "than the rank)");

 public:
  /// Number of dimensions.
  static constexpr std::size_t rank = Ext::rank;
  /// Element type.
  using value_type = T;
  /// The global extents type.
  using extents_type = Ext;
  /// Where the local block lives.
  using memory_space = MemorySpace;
  /// The local block.
  using view_type = Kokkos::View<typename detail::view_data<T, rank>::type, Kokkos::LayoutRight, MemorySpace>;
  /// Where kernels on the local block run.
  using execution_space = typename view_type::execution_space;
  /// The placements, as a type_list of On<>s.
  using placements = type_list<Ons...>;
  /// The placement over Axis (Replicate when it is not named).
  template <class Axis>
  using placement_on = placement_on_t<Axis, Ons...>;

  /// An empty DistView (no mesh, no data).
  BasicDistView() = default;

  /// Allocates the local block (zero-filled) of a tensor of the given global
  /// extents on `mesh`. Throws ShapeError when a sharded extent is not
  /// divisible by the ranks that split it.
  template <class MeshT>
    requires detail::mesh_traits<MeshT>::is_mesh
  BasicDistView(MeshT& mesh, const std::array<std::size_t, rank>& global_extents,
                const std::string& label = "weft::DistView")
      : table_(detail::mesh_traits<MeshT>::table(mesh)) {
    check_mesh<MeshT>();
    layout(global_extents);
    local_ = allocate(label, Kokkos::view_alloc(label), std::make_index_sequence<rank>{});
  }

  /// As above, with the global extents as arguments: DistView<...> x(mesh, 64, 128).
  template <class MeshT, std::integral... I>
    requires(detail::mesh_traits<MeshT>::is_mesh && sizeof...(I) == rank)
  BasicDistView(MeshT& mesh, I... global_extents)
      : BasicDistView(mesh, std::array<std::size_t, rank>{checked_extent(global_extents)...}) {}

  /// Wraps an existing local block, whose extents must be those the
  /// placements give this rank (ShapeError otherwise).
  template <class MeshT>
    requires detail::mesh_traits<MeshT>::is_mesh
  BasicDistView(MeshT& mesh, const std::array<std::size_t, rank>& global_extents, view_type local)
      : table_(detail::mesh_traits<MeshT>::table(mesh)), local_(std::move(local)) {
    check_mesh<MeshT>();
    layout(global_extents);
    for (std::size_t d = 0; d < rank; ++d)
      WEFT_REQUIRE(local_.extent(d) == local_extent_[d], ShapeError, describe(), ": the local view '", local_.label(),
                   "' has extent ", local_.extent(d), " in dimension ", d, ", but the placements give this rank ",
                   local_extent_[d], " (global extents ", extents_text(global_), ")");
  }

  /// Used by redistribute: a view on the same mesh axes as another DistView,
  /// allocated without initialisation.
  BasicDistView(detail::internal_tag, const detail::AxisTable& table, const std::array<std::size_t, rank>& global_extents,
                const std::string& label)
      : table_(table) {
    layout(global_extents);
    local_ = allocate(label, Kokkos::view_alloc(label, Kokkos::WithoutInitializing), std::make_index_sequence<rank>{});
  }

  /// Used by redistribute: another placement of the same local block.
  BasicDistView(detail::internal_tag, const detail::AxisTable& table, const std::array<std::size_t, rank>& global_extents,
                view_type local)
      : table_(table), local_(std::move(local)) {
    layout(global_extents);
  }

  /// The local extents this rank's block has for a tensor of `global_extents`
  /// on `mesh` (what the allocating constructor allocates), for callers that
  /// allocate the block themselves and wrap it (weft::NodeShared). Throws
  /// ShapeError as the constructors do.
  template <class MeshT>
    requires detail::mesh_traits<MeshT>::is_mesh
  static std::array<std::size_t, rank> local_extents_on(MeshT& mesh, const std::array<std::size_t, rank>& global_extents) {
    check_mesh<MeshT>();
    BasicDistView probe;
    probe.table_ = detail::mesh_traits<MeshT>::table(mesh);
    probe.layout(global_extents);
    return probe.local_extent_;
  }

  /// This rank's block.
  const view_type& local() const noexcept { return local_; }
  /// Global extent of dimension d.
  std::size_t global_extent(std::size_t d) const noexcept { return global_[d]; }
  /// Local extent of dimension d.
  std::size_t local_extent(std::size_t d) const noexcept { return local_extent_[d]; }
  /// Global index of this rank's first element along dimension d.
  std::size_t offset(std::size_t d) const noexcept { return offset_[d]; }
  /// All global extents.
  const std::array<std::size_t, rank>& global_extents() const noexcept { return global_; }
  /// All local extents.
  const std::array<std::size_t, rank>& local_extents() const noexcept { return local_extent_; }

  /// The global index of the local element at `local_index`.
  std::array<std::size_t, rank> global_index(const std::array<std::size_t, rank>& local_index) const {
    std::array<std::size_t, rank> g{};
    for (std::size_t d = 0; d < rank; ++d) g[d] = offset_[d] + local_index[d];
    return g;
  }
  /// The local-to-global map, for kernels.
  IndexMap<rank> index_map() const noexcept {
    IndexMap<rank> m{};
    for (std::size_t d = 0; d < rank; ++d) {
      m.offset[d] = offset_[d];
      m.local_extent[d] = local_extent_[d];
      m.global_extent[d] = global_[d];
    }
    return m;
  }

  /// The communicator of mesh axis Axis (which need not be among the
  /// placements; ConfigError if the mesh has no such axis).
  template <class Axis>
  Comm& comm() const {
    static_assert(AxisTag<Axis>, "weft::DistView::comm<Axis>: Axis must be a mesh axis tag such as weft::TP");
    Comm* c = table_.find(Axis::name);
    WEFT_REQUIRE(c != nullptr, ConfigError, describe(), ": the mesh (", table_.describe(), ") has no axis '",
                 Axis::name, "'; add it to the mesh type or redistribute over an axis the mesh has");
    return *c;
  }

  /// The mesh's axis communicators (what redistribute builds its results on).
  const detail::AxisTable& axis_table() const noexcept { return table_; }

  /// "DistView<rank 2: On<tp, Shard<1>>>", for messages.
  static std::string describe() {
    std::string s = "weft::DistView<rank " + std::to_string(rank);
    if constexpr (sizeof...(Ons) > 0) {
      s += ":";
      ((s += " " + placement_name<Ons>()), ...);
    }
    return s + ">";
  }

 private:
  template <class I>
  static std::size_t checked_extent(I e) {
    if constexpr (std::is_signed_v<I>)  // nvcc warns about the test on an unsigned type
      WEFT_REQUIRE(e >= 0, ShapeError, describe(), ": a global extent is negative (", e, ")");
    return static_cast<std::size_t>(e);
  }

  static std::string extents_text(const std::array<std::size_t, rank>& e) {
    std::string s = "(";
    for (std::size_t d = 0; d < rank; ++d) {
      if (d) s += ", ";
      s += std::to_string(e[d]);
    }
    return s + ")";
  }

  // The mesh must have every named axis; static extents on both sides are
  // checked for divisibility now rather than at run time.
  template <class MeshT>
  static constexpr void check_mesh() {
    static_assert((MeshT::template has_axis<typename Ons::axis> && ...),
                  "weft::DistView: the placements name a mesh axis that this mesh does not have; add the axis to "
                  "the mesh type or remove its On<...>");
    if constexpr ((MeshT::template has_axis<typename Ons::axis> && ...)) check_static<MeshT>(std::make_index_sequence<rank>{});
  }
  template <class MeshT, std::size_t... D>
  static constexpr void check_static(std::index_sequence<D...>) {
    (check_static_dim<MeshT, D>(), ...);
  }
  template <class MeshT, std::size_t D>
  static constexpr void check_static_dim() {
    constexpr std::size_t extent = Ext::static_extents[D];
    constexpr bool all_static = (... && (detail::shard_dim_or_npos<typename Ons::placement>() != D ||
                                         MeshT::static_extents[MeshT::template index_of<typename Ons::axis>()] != dynamic_extent));
    if constexpr (extent != dynamic_extent && all_static) {
      constexpr std::size_t parts = (std::size_t(1) * ... *
                                     (detail::shard_dim_or_npos<typename Ons::placement>() == D
                                          ? MeshT::static_extents[MeshT::template index_of<typename Ons::axis>()]
                                          : std::size_t(1)));
      static_assert(detail::static_shard_check<D, extent, parts>::ok);
    }
  }

  // Local extents and offsets from the global extents and the placements.
  // Several axes may shard one dimension: the first listed splits it
  // outermost, so a rank's block index is row-major in list order.
  void layout(const std::array<std::size_t, rank>& global) {
    global_ = global;
    std::array<std::size_t, rank> parts, block;
    parts.fill(1);
    block.fill(0);
    std::array<std::string, rank> axes_text;
    auto visit = [&]<class O>(std::type_identity<O>) {
      if constexpr (is_shard_v<typename O::placement>) {
        constexpr std::size_t d = O::placement::dim;
        Comm& c = comm<typename O::axis>();
        parts[d] *= static_cast<std::size_t>(c.size());
        block[d] = block[d] * static_cast<std::size_t>(c.size()) + static_cast<std::size_t>(c.rank());
        axes_text[d] += axes_text[d].empty() ? "'" : " x '";
        axes_text[d] += O::axis::name;
        axes_text[d] += '\'';
      }
    };
    (visit(std::type_identity<Ons>{}), ...);
    (void)visit;  // a DistView without placements visits nothing
    for (std::size_t d = 0; d < rank; ++d) {
      const std::size_t s = Ext::static_extents[d];
      WEFT_REQUIRE(s == dynamic_extent || s == global[d], ShapeError, describe(), ": dimension ", d,
                   " has the static extent ", s, ", but the global extent given is ", global[d]);
      WEFT_REQUIRE(global[d] % parts[d] == 0, ShapeError, describe(), ": dimension ", d, " has global size ",
                   global[d], ", which is not divisible by ", parts[d], ", the size of mesh axis ", axes_text[d],
                   " that shards it (mesh ", table_.describe(),
                   "). weft does not pad: choose a size divisible by ", parts[d],
                   " or a mesh whose axis divides ", global[d], ".");
      local_extent_[d] = global[d] / parts[d];
      offset_[d] = block[d] * local_extent_[d];
    }
  }

  // A failed allocation is an AllocationError naming the tensor and its size.
  template <class Alloc, std::size_t... D>
  view_type allocate(const std::string& label, const Alloc& alloc, std::index_sequence<D...>) const {
    try {
      return view_type(alloc, local_extent_[D]...);
    } catch (const std::exception& e) {
      const std::size_t bytes = (sizeof(typename view_type::value_type) * ... * local_extent_[D]);
      throw ::weft::detail::allocation_error(label, bytes, view_type::memory_space::name(), e.what());
    }
  }

  detail::AxisTable table_{};
  view_type local_{};
  std::array<std::size_t, rank> global_{};
  std::array<std::size_t, rank> local_extent_{};
  std::array<std::size_t, rank> offset_{};
};

/// A DistView of Rank dynamic extents in the default memory space:
///   weft::DistView<float, 2, weft::On<weft::TP, weft::Shard<1>>> x(mesh, 64, 128);
template <class T, std::size_t Rank, class... Ons>
using DistView = BasicDistView<T, dextents<Rank>, typename Kokkos::DefaultExecutionSpace::memory_space, Ons...>;

namespace detail {
template <class T>
struct is_dist_view : std::false_type {};
template <class T, class Ext, class Space, class... Ons>
struct is_dist_view<BasicDistView<T, Ext, Space, Ons...>> : std::true_type {};

template <class DV, class List>
struct rebind_placements;
template <class T, class Ext, class Space, class... Old, class... New>
struct rebind_placements<BasicDistView<T, Ext, Space, Old...>, type_list<New...>> {
  using type = BasicDistView<T, Ext, Space, New...>;
};
}  // namespace detail

/// A weft::BasicDistView (or DistView) of any parameters.
template <class T>
concept DistributedView = detail::is_dist_view<std::remove_cvref_t<T>>::value;

/// The same DistView type with its placements replaced by the On<>s of List.
template <DistributedView DV, class List>
using with_placements_t = typename detail::rebind_placements<std::remove_cvref_t<DV>, List>::type;

}  // namespace weft
