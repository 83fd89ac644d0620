// The placement algebra at compile time: propagation rules, redistribution
// result types and placement lookups, checked by static_assert. If this file
// compiles, the rules hold; the one test case checks the run-time spellings.
#include "weft_test.hpp"

using namespace weft;

namespace {

template <class A, class B>
inline constexpr bool same = std::is_same_v<A, B>;

// ---- matmul, matrices (rank 2), the three examples first
static_assert(same<matmul_placement_t<Replicate, Shard<1>>, Shard<1>>);
static_assert(same<matmul_placement_t<Shard<1>, Shard<0>>, Partial<Sum>>);
static_assert(same<matmul_placement_t<Shard<0>, Replicate>, Shard<0>>);
static_assert(same<matmul_placement_t<Replicate, Replicate>, Replicate>);
static_assert(same<matmul_placement_t<Partial<Sum>, Replicate>, Partial<Sum>>);
static_assert(same<matmul_placement_t<Replicate, Partial<Sum>>, Partial<Sum>>);
static_assert(same<matmul_placement_t<Partial<Avg>, Replicate>, Partial<Avg>>);

// ---- matmul, batched (rank 3: (b, m, k) x (b, k, n))
static_assert(same<matmul_placement_t<Shard<0>, Shard<0>, 3>, Shard<0>>);
static_assert(same<matmul_placement_t<Shard<1>, Replicate, 3>, Shard<1>>);
static_assert(same<matmul_placement_t<Replicate, Shard<2>, 3>, Shard<2>>);
static_assert(same<matmul_placement_t<Shard<2>, Shard<1>, 3>, Partial<Sum>>);

// ---- element-wise
static_assert(same<elementwise_placement_t<Additive, Shard<1>, Shard<1>>, Shard<1>>);
static_assert(same<elementwise_placement_t<Nonlinear, Shard<0>, Shard<0>>, Shard<0>>);
static_assert(same<elementwise_placement_t<Nonlinear, Replicate, Replicate>, Replicate>);
static_assert(same<elementwise_placement_t<Additive, Partial<Sum>, Partial<Sum>>, Partial<Sum>>);
static_assert(same<elementwise_placement_t<Additive, Partial<Avg>, Partial<Avg>>, Partial<Avg>>);
static_assert(same<elementwise_placement_t<Multiplicative, Partial<Sum>, Replicate>, Partial<Sum>>);
static_assert(same<elementwise_placement_t<Multiplicative, Replicate, Partial<Sum>>, Partial<Sum>>);
static_assert(same<unary_placement_t<Multiplicative, Partial<Sum>>, Partial<Sum>>);
static_assert(same<unary_placement_t<Nonlinear, Shard<2>>, Shard<2>>);

// ---- reductions over a dimension
static_assert(same<reduction_placement_t<Shard<1>, 1, Sum>, Partial<Sum>>);
static_assert(same<reduction_placement_t<Shard<1>, 1, Max>, Partial<Max>>);
static_assert(same<reduction_placement_t<Shard<1>, 1, Avg>, Partial<Avg>>);
static_assert(same<reduction_placement_t<Shard<0>, 1, Sum>, Shard<0>>);
static_assert(same<reduction_placement_t<Shard<2>, 1, Sum>, Shard<1>>);
static_assert(same<reduction_placement_t<Shard<2>, 1, Sum, true>, Shard<2>>);
static_assert(same<reduction_placement_t<Replicate, 0, Max>, Replicate>);
static_assert(same<reduction_placement_t<Partial<Sum>, 0, Sum>, Partial<Sum>>);
static_assert(same<reduction_placement_t<Partial<Sum>, 0, Avg>, Partial<Sum>>);
static_assert(same<reduction_placement_t<Partial<Max>, 0, Max>, Partial<Max>>);

// ---- whole DistView types
using X = DistView<float, 2, On<TP, Replicate>, On<DP, Shard<0>>>;
using W = DistView<float, 2, On<TP, Shard<1>>>;
static_assert(same<matmul_result_t<X, W>, DistView<float, 2, On<TP, Shard<1>>, On<DP, Shard<0>>>>);
using H = DistView<float, 2, On<TP, Shard<1>>, On<DP, Shard<0>>>;
using W2 = DistView<float, 2, On<TP, Shard<0>>>;
static_assert(same<matmul_result_t<H, W2>, DistView<float, 2, On<TP, Partial<Sum>>, On<DP, Shard<0>>>>);
static_assert(same<elementwise_result_t<Additive, H, H>, H>);
static_assert(same<reduction_result_t<H, 1, Sum>, DistView<float, 1, On<TP, Partial<Sum>>, On<DP, Shard<0>>>>);
static_assert(same<unary_result_t<Nonlinear, H>, H>);

// ---- placement lookups and redistribution result types
static_assert(same<H::placement_on<TP>, Shard<1>>);
static_assert(same<H::placement_on<CP>, Replicate>);
static_assert(same<redistributed_t<H, TP, Replicate>, DistView<float, 2, On<TP, Replicate>, On<DP, Shard<0>>>>);
static_assert(same<redistributed_t<H, CP, Shard<1>>, DistView<float, 2, On<TP, Shard<1>>, On<DP, Shard<0>>, On<CP, Shard<1>>>>);
static_assert(same<redistributed_t<W, DP, Replicate>, W>);  // unnamed axes are already replicated
static_assert(is_shard_v<Shard<3>> && !is_shard_v<Replicate> && is_partial_v<Partial<Max>> && is_replicate_v<Replicate>);
static_assert(Placement<Partial<Min>> && !Placement<int> && OnPlacement<On<TP, Replicate>> && !OnPlacement<Replicate>);
static_assert(DistributedView<H> && !DistributedView<Kokkos::View<float**>>);
static_assert(H::rank == 2 && same<H::value_type, float>);
static_assert(same<dextents<3>, Extents<dynamic_extent, dynamic_extent, dynamic_extent>>);

// The innermost-sharder rule behind nested sharding.
static_assert(detail::innermost_sharder<1, 0, On<DP, Shard<0>>, On<TP, Shard<0>>>());
static_assert(!detail::innermost_sharder<0, 0, On<DP, Shard<0>>, On<TP, Shard<0>>>());
static_assert(detail::innermost_sharder<0, 0, On<DP, Shard<0>>, On<TP, Shard<1>>>());

}  // namespace

TEST_CASE("placement names read as in the types") {
  CHECK(placement_name<Shard<1>>() == "Shard<1>");
  CHECK(placement_name<Replicate>() == "Replicate");
  CHECK(placement_name<Partial<Avg>>() == "Partial<Avg>");
  CHECK(placement_name<On<TP, Partial<Sum>>>() == "On<tp, Partial<Sum>>");
  CHECK(H::describe() == "weft::DistView<rank 2: On<tp, Shard<1>> On<dp, Shard<0>>>");
}
