// Mesh<Axes...>: the ranks of a communicator arranged as an N-dimensional grid
// whose axes are strategy tags (DP, TP, PP, CP, EP or the user's own), with a
// communicator per axis and per axis group, and the node topology.
#pragma once

#include <mpi.h>

#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/comm/node.hpp>
#include <weft/core/error.hpp>
#include <weft/mesh/axis.hpp>

namespace weft {

/// Extents named by axis, for meshes over the built-in tags:
///   Mesh<DP, PP, TP> mesh(env.world(), {.dp = 2, .pp = 2, .tp = 2});
/// 0 means "not given": at most one axis of the mesh may be left at 0, and its
/// extent is then the communicator size divided by the others. Axes the mesh
/// does not have must be 0 or 1.
/// Designated initialisers must follow the member order: dp, pp, tp, cp, ep.
struct MeshSizes {
  int dp = 0;  ///< data-parallel extent
  int pp = 0;  ///< pipeline-parallel extent
  int tp = 0;  ///< tensor-parallel extent
  int cp = 0;  ///< context-parallel extent
  int ep = 0;  ///< expert-parallel extent
};

namespace detail {
// The member of MeshSizes that holds an axis' extent. The pointer-to-member
// type has a name of its own: nvcc writes `int MeshSizes::* f()` back out as
// `int (MeshSizes::*f())`, which g++ -Wparentheses warns about.
using MeshSizesMember = int MeshSizes::*;
template <class Tag>
constexpr MeshSizesMember mesh_sizes_member() {
  if constexpr (std::is_same_v<Tag, DP>) return &MeshSizes::dp;
  else if constexpr (std::is_same_v<Tag, TP>) return &MeshSizes::tp;
  else if constexpr (std::is_same_v<Tag, PP>) return &MeshSizes::pp;
  else if constexpr (std::is_same_v<Tag, CP>) return &MeshSizes::cp;
  else if constexpr (std::is_same_v<Tag, EP>) return &MeshSizes::ep;
  else return nullptr;
}

template <class T, class... Ts>
inline constexpr bool tag_is_unique = (0 + ... + int(std::is_same_v<T, Ts>)) == 1;
}  // namespace detail

/// A grid of ranks. Axes are listed outermost to innermost; the innermost axis
/// gets consecutive ranks (so it lands inside a node: put TP there). Each axis
/// is a tag (dynamic extent) or Axis<Tag, N> (static extent N).
template <class... Axes>
class Mesh {
 public:
  /// Number of axes.
  static constexpr std::size_t rank = sizeof...(Axes);
  static_assert(rank >= 1, "weft::Mesh: a mesh needs at least one axis, e.g. weft::Mesh<weft::DP>");
  static_assert((detail::tag_is_unique<axis_tag_t<Axes>, axis_tag_t<Axes>...> && ...),
                "weft::Mesh: an axis tag appears twice; every axis of a mesh needs its own tag");

  /// The static extent of each axis (dynamic_extent where it is dynamic).
  static constexpr std::array<std::size_t, rank> static_extents{detail::axis_traits<Axes>::static_extent...};
  /// Number of axes whose extent is dynamic.
  static constexpr std::size_t rank_dynamic = (0 + ... + std::size_t(detail::axis_traits<Axes>::static_extent == dynamic_extent));

  /// The tag of axis I (0 = outermost).
  template <std::size_t I>
  using tag_at = std::tuple_element_t<I, std::tuple<axis_tag_t<Axes>...>>;

  /// Whether the mesh has an axis tagged Tag.
  template <class Tag>
  static constexpr bool has_axis = (std::is_same_v<Tag, axis_tag_t<Axes>> || ...);

  /// Position of Tag's axis (0 = outermost).
  template <class Tag>
  static constexpr std::size_t index_of() {
    static_assert(has_axis<Tag>, "weft::Mesh: this mesh has no axis with the requested tag; add the axis to the "
                                 "mesh type (e.g. weft::Mesh<weft::DP, weft::TP>) or ask for an axis it has");
    constexpr bool same[] = {std::is_same_v<Tag, axis_tag_t<Axes>>...};
    for (std::size_t i = 0; i < rank; ++i)
      if (same[i]) return i;
    return rank;
  }

  /// The product of the static extents when all are static (else dynamic_extent).
  static constexpr std::size_t static_size() {
    if constexpr (rank_dynamic != 0) return dynamic_extent;
    else return (std::size_t(1) * ... * detail::axis_traits<Axes>::static_extent);
  }

  /// Builds the mesh over `parent` (collective over it) with the dynamic
  /// extents given in axis order: Mesh<DP, TP>(world, 2, 4);
  /// Mesh<Axis<DP, 2>, Axis<TP, 4>>(world).
  template <std::integral... I>
    requires(sizeof...(I) == rank_dynamic)
  explicit Mesh(const Comm& parent, I... dynamic_extents) : all_(parent.split(0, parent.rank(), parent.name())) {
    const std::array<long long, rank_dynamic> dyn{static_cast<long long>(dynamic_extents)...};
    std::size_t d = 0;
    for (std::size_t i = 0; i < rank; ++i) {
      const long long e = static_extents[i] == dynamic_extent ? dyn[d++] : static_cast<long long>(static_extents[i]);
      WEFT_REQUIRE(e >= 1 && e <= all_.size(), ConfigError, signature(), ": the extent of axis '", names_[i],
                   "' must be between 1 and the communicator size ", all_.size(), ", got ", e);
      extents_[i] = static_cast<int>(e);
    }
    build();
  }

  /// Rejects a wrong number of extents with a readable message.
  template <std::integral... I>
    requires(sizeof...(I) != rank_dynamic)
  explicit Mesh(const Comm&, I...) {
    static_assert(sizeof...(I) == rank_dynamic,
                  "weft::Mesh: give exactly one extent per dynamic axis, in axis order (static axes, "
                  "weft::Axis<Tag, N>, take none), or name them: Mesh<DP, TP>(comm, {.dp = 2, .tp = 4})");
  }

  /// Builds the mesh over `parent` (collective over it) with extents named by
  /// axis; see MeshSizes.
  Mesh(const Comm& parent, const MeshSizes& sizes) : all_(parent.split(0, parent.rank(), parent.name())) {
    int given[5] = {sizes.dp, sizes.tp, sizes.pp, sizes.cp, sizes.ep};
    const std::string_view builtin[5] = {DP::name, TP::name, PP::name, CP::name, EP::name};
    bool in_mesh[5] = {has_axis<DP>, has_axis<TP>, has_axis<PP>, has_axis<CP>, has_axis<EP>};
    for (int k = 0; k < 5; ++k) {
      WEFT_REQUIRE(given[k] >= 0, ConfigError, signature(), ": size ", builtin[k], "=", given[k], " is negative");
      WEFT_REQUIRE(in_mesh[k] || given[k] <= 1, ConfigError, signature(), ": the sizes name ", builtin[k], "=",
                   given[k], " but this mesh has no '", builtin[k], "' axis; add it to the mesh type or leave it out");
    }
    const int from_sizes[rank] = {member_or_zero<axis_tag_t<Axes>>(sizes)...};
    int unknown = -1;
    long long known = 1;
    for (std::size_t i = 0; i < rank; ++i) {
      int e = from_sizes[i];
      if (static_extents[i] != dynamic_extent) {
        WEFT_REQUIRE(e == 0 || e == static_cast<int>(static_extents[i]), ConfigError, signature(), ": axis '",
                     names_[i], "' has the static extent ", static_extents[i], " but the sizes give ", names_[i], "=", e);
        e = static_cast<int>(static_extents[i]);
      }
      WEFT_REQUIRE(e != 0 || unknown < 0, ConfigError, signature(), ": the extents of both '", names_[unknown],
                   "' and '", names_[i], "' are missing; give all but one of them (the one left out is inferred)");
      if (e == 0) unknown = static_cast<int>(i);
      else known *= e;
      extents_[i] = e;
    }
    if (unknown >= 0) {
      WEFT_REQUIRE(all_.size() % known == 0, ConfigError, signature(), ": cannot infer the extent of axis '",
                   names_[unknown], "': the other extents multiply to ", known, ", which does not divide the ",
                   all_.size(), " ranks of '", all_.name(), "'");
      extents_[static_cast<std::size_t>(unknown)] = static_cast<int>(all_.size() / known);
    }
    build();
  }

  Mesh(Mesh&&) noexcept = default;
  Mesh& operator=(Mesh&&) noexcept = default;

  /// Number of ranks in the mesh.
  int size() const noexcept { return all_.size(); }
  /// This process' rank in the mesh (= its rank in the parent communicator).
  int rank_in_mesh() const noexcept { return all_.rank(); }
  /// The extent of Tag's axis.
  template <class Tag>
  int extent() const noexcept {
    return extents_[index_of<Tag>()];
  }
  /// All extents, outermost first.
  const std::array<int, rank>& extents() const noexcept { return extents_; }
  /// This rank's coordinate along Tag's axis.
  template <class Tag>
  int coord() const noexcept {
    return coords_[index_of<Tag>()];
  }
  /// This rank's coordinates, outermost first.
  const std::array<int, rank>& coords() const noexcept { return coords_; }
  /// The coordinates of mesh rank r.
  std::array<int, rank> coords_of(int r) const {
    WEFT_REQUIRE(r >= 0 && r < size(), ConfigError, signature(), "::coords_of: rank ", r, " is outside 0..", size() - 1);
    std::array<int, rank> c{};
    for (std::size_t i = rank; i-- > 0;) {
      c[i] = r % extents_[i];
      r /= extents_[i];
    }
    return c;
  }
  /// The mesh rank at coordinates c.
  int rank_of(const std::array<int, rank>& c) const {
    int r = 0;
    for (std::size_t i = 0; i < rank; ++i) {
      WEFT_REQUIRE(c[i] >= 0 && c[i] < extents_[i], ConfigError, signature(), "::rank_of: coordinate ", c[i],
                   " on axis '", names_[i], "' is outside 0..", extents_[i] - 1);
      r = r * extents_[i] + c[i];
    }
    return r;
  }
  /// The name of axis i, e.g. "tp".
  static constexpr std::string_view axis_name(std::size_t i) { return names_[i]; }

  /// The communicator over Tag's axis: the ranks that differ from this one in
  /// that coordinate only, ordered by it (its rank() == coord<Tag>()).
  template <class Tag>
  Comm& axis() {
    return axis_comms_[index_of<Tag>()];
  }
  /// The communicator over a group of axes (e.g. axes<DP, CP>()): the ranks
  /// that differ from this one in those coordinates only, ordered row-major in
  /// mesh order. Created on first use, which is collective over the mesh.
  template <class... Tags>
  Comm& axes() {
    static_assert(sizeof...(Tags) >= 1, "weft::Mesh::axes: name at least one axis");
    const unsigned mask = (0u | ... | (1u << index_of<Tags>()));
    return group(mask);
  }
  /// The whole mesh as one communicator.
  Comm& all() noexcept { return all_; }
  /// The ranks of this mesh that share this rank's node (shared memory).
  Comm& node() noexcept { return *node_; }
  /// Number of nodes the mesh spans.
  int num_nodes() const noexcept { return num_nodes_; }

  /// Whether every group of the named axes lies inside one node (e.g. check
  /// that TP stays on the fastest links). Collective over the mesh on first use.
  template <class... Tags>
  bool within_node() {
    const unsigned mask = (0u | ... | (1u << index_of<Tags>()));
    auto it = within_node_.find(mask);
    if (it != within_node_.end()) return it->second;
    Comm& g = group(mask);
    int mm[2] = {node_id_, -node_id_};
    int out[2];
    g.all_reduce(Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(mm, 2),
                 Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(out, 2), ReduceOp::max);
    int local = out[0] == -out[1] ? 1 : 0;
    all_.all_reduce(Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(&local, 1), ReduceOp::min);
    return within_node_[mask] = local != 0;
  }

  /// "dp=2 x tp=4"
  std::string describe() const {
    std::string s;
    for (std::size_t i = 0; i < rank; ++i) {
      if (i) s += " x ";
      s += std::string(names_[i]) + "=" + std::to_string(extents_[i]);
    }
    return s;
  }

  /// This rank's communication totals per axis (and axis group) and kind.
  void print_stats(std::ostream& os) const {
    CommStats::print_header(os);
    for_each_comm([&](const Comm& c) { c.stats().print(os, c.name()); });
  }
  /// {"tp": {"all_reduce": {...}}, ...} for this rank.
  std::string stats_json() const {
    std::string out = "{";
    bool first = true;
    for_each_comm([&](const Comm& c) {
      if (c.stats().total().calls == 0) return;
      out += (first ? "\"" : ", \"") + c.name() + "\": " + c.stats().to_json();
      first = false;
    });
    return out + "}";
  }
  /// Forgets the statistics of every communicator of the mesh.
  void reset_stats() {
    all_.reset_stats();
    node_->reset_stats();
    for (auto& c : axis_comms_) c.reset_stats();
    for (auto& [m, c] : groups_) c.reset_stats();
  }

 private:
  static constexpr std::array<std::string_view, rank> names_{std::string_view(axis_tag_t<Axes>::name)...};

  template <class Tag>
  static int member_or_zero(const MeshSizes& s) {
    constexpr auto m = detail::mesh_sizes_member<Tag>();
    if constexpr (m == nullptr) return 0;
    else return s.*m;
  }

  static std::string signature() {
    std::string s = "weft::Mesh<";
    for (std::size_t i = 0; i < rank; ++i) {
      if (i) s += ", ";
      s += names_[i];
      if (static_extents[i] != dynamic_extent) {
        s += '=';
        s += std::to_string(static_extents[i]);
      }
    }
    return s + ">";
  }

  void build() {
    long long product = 1;
    std::string terms;
    for (std::size_t i = 0; i < rank; ++i) {
      product *= extents_[i];
      if (i) terms += " x ";
      terms += std::string(names_[i]) + "=" + std::to_string(extents_[i]);
    }
    WEFT_REQUIRE(product == all_.size(), ConfigError, signature(), ": the extents ", terms, " = ", product,
                 " do not match the ", all_.size(), " ranks of communicator '", all_.name(),
                 "'; choose extents whose product is ", all_.size(), " (or run on ", product, " ranks)");
    coords_ = coords_of(all_.rank());
    axis_comms_.reserve(rank);
    for (std::size_t i = 0; i < rank; ++i) axis_comms_.push_back(make_group(1u << i));
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = detail::split_by_node(all_.native(), all_.rank(), &nc);
    if (rc != MPI_SUCCESS) throw CommError("split_type", all_.name(), "weft::Mesh: MPI_Comm_split_type failed: " + detail::mpi_error_text(rc));
    node_.emplace(Comm::adopt(nc, "node"));
    // A node is identified by its lowest mesh rank.
    int id = all_.rank();
    node_->all_reduce(Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(&id, 1), ReduceOp::min);
    node_id_ = id;
    int leader = node_->rank() == 0 ? 1 : 0;
    all_.all_reduce(Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(&leader, 1));
    num_nodes_ = leader;
    all_.reset_stats();
    node_->reset_stats();
  }

  Comm make_group(unsigned mask) const {
    // color: the coordinates outside the group; key: those inside, row-major.
    int color = 0, key = 0;
    std::string name;
    for (std::size_t i = 0; i < rank; ++i) {
      if (mask & (1u << i)) {
        key = key * extents_[i] + coords_[i];
        if (!name.empty()) name += '*';
        name += names_[i];
      } else {
        color = color * extents_[i] + coords_[i];
      }
    }
    return all_.split(color, key, name);
  }

  Comm& group(unsigned mask) {
    if ((mask & (mask - 1)) == 0) {
      for (std::size_t i = 0; i < rank; ++i)
        if (mask == (1u << i)) return axis_comms_[i];
    }
    auto it = groups_.find(mask);
    if (it == groups_.end()) it = groups_.emplace(mask, make_group(mask)).first;
    return it->second;
  }

  template <class F>
  void for_each_comm(F&& f) const {
    f(all_);
    for (const auto& c : axis_comms_) f(c);
    for (const auto& [m, c] : groups_) f(c);
  }

  Comm all_;
  std::optional<Comm> node_;
  std::array<int, rank> extents_{};
  std::array<int, rank> coords_{};
  std::vector<Comm> axis_comms_;
  std::map<unsigned, Comm> groups_;
  std::map<unsigned, bool> within_node_;
  int node_id_ = 0;
  int num_nodes_ = 1;
};

}  // namespace weft
