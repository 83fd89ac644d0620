// Compile-time properties of Mesh types: a translation unit of static_asserts.
#include <weft/mesh/mesh.hpp>

using namespace weft;

using Dyn = Mesh<DP, PP, TP>;
static_assert(Dyn::rank == 3);
static_assert(Dyn::rank_dynamic == 3);
static_assert(Dyn::static_size() == dynamic_extent);
static_assert(Dyn::index_of<DP>() == 0 && Dyn::index_of<PP>() == 1 && Dyn::index_of<TP>() == 2);
static_assert(Dyn::has_axis<TP> && !Dyn::has_axis<CP>);
static_assert(Dyn::axis_name(2) == "tp");

using Mixed = Mesh<Axis<TP, 2>, DP>;
static_assert(Mixed::rank_dynamic == 1);
static_assert(Mixed::static_extents[0] == 2 && Mixed::static_extents[1] == dynamic_extent);

using Static = Mesh<Axis<DP, 2>, Axis<PP, 2>, Axis<TP, 2>>;
static_assert(Static::rank_dynamic == 0);
static_assert(Static::static_size() == 8);

// A user-defined axis works like the built-in ones.
struct Replica {
  static constexpr std::string_view name = "replica";
};
using User = Mesh<Replica, TP>;
static_assert(User::index_of<Replica>() == 0);
static_assert(User::axis_name(0) == "replica");
static_assert(std::is_same_v<axis_tag_t<Axis<Replica, 4>>, Replica>);

int main() { return 0; }
