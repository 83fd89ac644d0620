// Element-wise operations on DistViews -- gelu, relu, silu, scale, add (the
// residual), mul (a gate's product) and bias_add -- with placements checked at compile time; each runs
// on the view's execution space and returns a DistView of the propagated placement.
//
// A combination that would give a wrong result (gelu of partial sums, a bias
// or a replicated tensor added to partial sums) does not compile, and the
// message names the operation, the placement and the redistribute that fixes it.
//
// The checks see only DistViews: a kernel applied to x.local() escapes them.
// gelu on the .local() block of a Partial<Sum> tensor (a row-parallel matmul's
// output before its all-reduce) compiles and sums gelu of the partial values,
// which is not gelu of their sum; weft::gelu(x) on that tensor does not
// compile, and weft::gelu(weft::redistribute<weft::Replicate>(x, axis)) is the
// single-process result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <Kokkos_Core.hpp>

#include <weft/core/error.hpp>
#include <weft/ops/elementwise.hpp>
#include <weft/placement/dist_view.hpp>
#include <weft/placement/placement.hpp>
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

namespace weft {

namespace detail {

// The activations, as functors the kernels call (the formulas of weft::ops).
struct GeluOp {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const {
    return ops::detail::gelu_value(x);
  }
};
struct ReluOp {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const {
    return x > T(0) ? x : T(0);
  }
};
struct SiluOp {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const {
    return x * ops::detail::sigmoid(x);
  }
};

template <class P>
inline constexpr bool never_v = !std::is_same_v<P, P>;

// ----------------------------------------------------- per-axis checks
// Each takes the axis and the placements as template arguments, so that the
// compiler's instantiation note names them next to the message.

template <class Op, class Axis, class P>
constexpr bool activation_accepts() {
  if constexpr (std::is_same_v<Op, GeluOp>)
    static_assert(!is_partial_v<P>,
                  "weft::gelu: the input is Partial over a mesh axis (the axis and the placement, e.g. Partial<Sum>, "
                  "are in the instantiation note), and gelu of partial values is not gelu of their reduction: "
                  "summing gelu(x_r) over the ranks gives a wrong result. Reduce it first: "
                  "weft::gelu(weft::redistribute<weft::Replicate>(x, axis)) (all-reduce), or "
                  "weft::redistribute<weft::Shard<D>>(x, axis) (reduce-scatter).");
  else if constexpr (std::is_same_v<Op, ReluOp>)
    static_assert(!is_partial_v<P>,
                  "weft::relu: the input is Partial over a mesh axis (the axis and the placement, e.g. Partial<Sum>, "
                  "are in the instantiation note), and relu of partial values is not relu of their reduction. "
                  "Reduce it first: weft::relu(weft::redistribute<weft::Replicate>(x, axis)) (all-reduce), or "
                  "weft::redistribute<weft::Shard<D>>(x, axis) (reduce-scatter).");
  else
    static_assert(!is_partial_v<P>,
                  "weft::silu: the input is Partial over a mesh axis (the axis and the placement, e.g. Partial<Sum>, "
                  "are in the instantiation note), and silu of partial values is not silu of their reduction. "
                  "Reduce it first: weft::silu(weft::redistribute<weft::Replicate>(x, axis)) (all-reduce), or "
                  "weft::redistribute<weft::Shard<D>>(x, axis) (reduce-scatter).");
  return unary_valid<Nonlinear, P>();
}

template <class Axis, class P>
constexpr bool scale_accepts() {
  static_assert(!is_partial_v<P> || linear_partial<P>(),
                "weft::scale: the input is Partial<Max> or Partial<Min> over a mesh axis (named in the instantiation "
                "note); a negative factor turns the maximum of the partial values into the minimum of the scaled "
                "ones, so a * x is no Partial<Max> of the scaled tensor. Reduce it first: "
                "weft::scale(a, weft::redistribute<weft::Replicate>(x, axis)) (all-reduce). Partial<Sum> and "
                "Partial<Avg> scale as they are.");
  return unary_valid<Multiplicative, P>();
}

template <class Axis, class PA, class PB>
constexpr bool add_accepts() {
  if constexpr (is_partial_v<PA> && is_partial_v<PB>) {
    static_assert(std::is_same_v<PA, PB>,
                  "weft::add: the operands are Partial with different reductions over one mesh axis (the axis and "
                  "both placements are in the instantiation note), so their sum is no partial of either. Reduce one "
                  "first: weft::redistribute<weft::Replicate>(b, axis) (all-reduce).");
    static_assert(!std::is_same_v<PA, PB> || linear_partial<PA>(),
                  "weft::add: both operands are Partial<Max> (or both Partial<Min>) over a mesh axis, and the maximum "
                  "of sums is not the sum of maxima. Reduce them first: weft::redistribute<weft::Replicate>(x, axis) "
                  "(all-reduce). Partial<Sum> + Partial<Sum> adds as it is.");
  } else if constexpr (is_partial_v<PA> || is_partial_v<PB>) {
    static_assert(!is_replicate_v<PA> && !is_replicate_v<PB>,
                  "weft::add: one operand is Partial (e.g. Partial<Sum>, a row-parallel matmul's output) and the "
                  "other Replicate over the same mesh axis (the axis and both placements are in the instantiation "
                  "note): every rank would add the Replicate operand to its partial values, so the reduced sum would "
                  "hold it once per rank of the axis. All-reduce the Partial operand first: "
                  "weft::add(weft::redistribute<weft::Replicate>(x, axis), y).");
    static_assert(!is_shard_v<PA> && !is_shard_v<PB>,
                  "weft::add: one operand is Partial and the other Shard<D> over the same mesh axis (named in the "
                  "instantiation note); a partial whole tensor and a block of final values do not add up. "
                  "Reduce-scatter the Partial operand to the same Shard<D> first: "
                  "weft::redistribute<weft::Shard<D>>(x, axis).");
  } else if constexpr (is_shard_v<PA> && is_shard_v<PB>) {
    static_assert(std::is_same_v<PA, PB>,
                  "weft::add: the operands are Shard over different dimensions of one mesh axis (the axis and both "
                  "placements are in the instantiation note), so the ranks hold different blocks of them. "
                  "Redistribute one to the other's Shard<D>: weft::redistribute<weft::Shard<D>>(b, axis) "
                  "(all-to-all), or both to Replicate (all-gather).");
  } else if constexpr (is_shard_v<PA> || is_shard_v<PB>) {
    static_assert(never_v<PA>,
                  "weft::add: one operand is Shard<D> and the other Replicate over the same mesh axis (the axis and "
                  "both placements are in the instantiation note); element-wise operands must have the same "
                  "placement. Slice the Replicate operand: weft::redistribute<weft::Shard<D>>(y, axis) (a local "
                  "slice, no communication), or all-gather the Shard one: weft::redistribute<weft::Replicate>(x, "
                  "axis).");
  }
  return elementwise_valid<Additive, PA, PB>();
}

template <class Axis, class PA, class PB>
constexpr bool mul_accepts() {
  if constexpr (is_partial_v<PA> && is_partial_v<PB>) {
    static_assert(never_v<PA>,
                  "weft::mul: both operands are Partial over one mesh axis (the axis and both placements are in the "
                  "instantiation note), and the product of two partial sums is not a partial of the product: "
                  "(a1 + a2)(b1 + b2) is not a1 b1 + a2 b2. Reduce one first: "
                  "weft::mul(weft::redistribute<weft::Replicate>(a, axis), b) (all-reduce).");
  } else if constexpr (is_partial_v<PA> || is_partial_v<PB>) {
    static_assert(!is_shard_v<PA> && !is_shard_v<PB>,
                  "weft::mul: one operand is Partial and the other Shard<D> over the same mesh axis (named in the "
                  "instantiation note); a partial whole tensor and a block of final values do not multiply "
                  "element by element. Reduce-scatter the Partial operand to the same Shard<D> first: "
                  "weft::redistribute<weft::Shard<D>>(x, axis).");
    static_assert(is_shard_v<PA> || is_shard_v<PB> || linear_partial<PA>() || linear_partial<PB>(),
                  "weft::mul: the Partial operand is Partial<Max> or Partial<Min> over a mesh axis (named in the "
                  "instantiation note); a negative factor turns the maximum of the partial values into the minimum "
                  "of the products. Reduce it first: weft::redistribute<weft::Replicate>(x, axis) (all-reduce). "
                  "Partial<Sum> and Partial<Avg> times a Replicate operand stay Partial.");
  } else if constexpr (is_shard_v<PA> && is_shard_v<PB>) {
    static_assert(std::is_same_v<PA, PB>,
                  "weft::mul: the operands are Shard over different dimensions of one mesh axis (the axis and both "
                  "placements are in the instantiation note), so the ranks hold different blocks of them. "
                  "Redistribute one to the other's Shard<D>: weft::redistribute<weft::Shard<D>>(b, axis) "
                  "(all-to-all), or both to Replicate (all-gather).");
  } else if constexpr (is_shard_v<PA> || is_shard_v<PB>) {
    static_assert(never_v<PA>,
                  "weft::mul: one operand is Shard<D> and the other Replicate over the same mesh axis (the axis and "
                  "both placements are in the instantiation note); element-wise operands must have the same "
                  "placement. Slice the Replicate operand: weft::redistribute<weft::Shard<D>>(y, axis) (a local "
                  "slice, no communication), or all-gather the Shard one: weft::redistribute<weft::Replicate>(x, "
                  "axis).");
  }
  return elementwise_valid<Multiplicative, PA, PB>();
}

template <class Axis, class PX, class PB, std::size_t Rank>
constexpr bool bias_accepts() {
  if constexpr (is_partial_v<PX>) {
    static_assert(never_v<PX>,
                  "weft::bias_add: the tensor is Partial over a mesh axis (e.g. Partial<Sum>, a row-parallel "
                  "matmul's output before its all-reduce; the axis and the placement are in the instantiation "
                  "note): adding the bias on every rank adds it once per rank of the axis, so the reduced sum holds "
                  "it tp times over TP. All-reduce first: weft::bias_add(weft::redistribute<weft::Replicate>(x, "
                  "axis), b), or reduce-scatter to Shard<D> first (a placed row-parallel nn::Linear adds its own "
                  "bias on one rank only).");
  } else if constexpr (is_partial_v<PB>) {
    static_assert(never_v<PB>,
                  "weft::bias_add: the bias is Partial over a mesh axis (named in the instantiation note), and a "
                  "bias must hold its final values. All-reduce it first: weft::redistribute<weft::Replicate>(b, "
                  "axis).");
  } else if constexpr (is_shard_v<PX> && shard_dim_or_npos<PX>() + 1 == Rank) {
    static_assert(std::is_same_v<PB, Shard<0>>,
                  "weft::bias_add: the tensor is Shard over its last (feature) dimension over a mesh axis, so each "
                  "rank holds a slice of the features and needs the same slice of the bias, which must be Shard<0> "
                  "over that axis (the axis and both placements are in the instantiation note). Slice it first: "
                  "weft::redistribute<weft::Shard<0>>(b, axis) (a local slice, no communication).");
  } else {
    static_assert(is_replicate_v<PB>,
                  "weft::bias_add: the tensor holds every feature on each rank of a mesh axis (Replicate over it, "
                  "or Shard over a leading, token dimension), so the bias must be Replicate over that axis, but it "
                  "is Shard<0> (the axis and both placements are in the instantiation note). All-gather it first: "
                  "weft::redistribute<weft::Replicate>(b, axis).");
  }
  return bias_valid<PX, PB, Rank>();
}

// ------------------------------------------------ whole-tensor checks

template <class Op, class... O>
constexpr bool activation_accepts_all(type_list<O...>) {
  return (true && ... && activation_accepts<Op, typename O::axis, typename O::placement>());
}
template <class... O>
constexpr bool scale_accepts_all(type_list<O...>) {
  return (true && ... && scale_accepts<typename O::axis, typename O::placement>());
}
// Over every axis either operand names (an axis one does not name is
// Replicate there).
template <class DVA, class DVB, class... A, class... B>
constexpr bool add_accepts_all(type_list<A...>, type_list<B...>) {
  return (true && ... &&
          add_accepts<typename A::axis, typename A::placement, typename DVB::template placement_on<typename A::axis>>()) &&
         (true && ... && add_accepts<typename B::axis, Replicate, typename B::placement>());
}
template <class DVA, class DVB, class... A, class... B>
constexpr bool mul_accepts_all(type_list<A...>, type_list<B...>) {
  return (true && ... &&
          mul_accepts<typename A::axis, typename A::placement, typename DVB::template placement_on<typename A::axis>>()) &&
         (true && ... && mul_accepts<typename B::axis, Replicate, typename B::placement>());
}
template <class DVX, class DVB, class... A, class... B>
constexpr bool bias_accepts_all(type_list<A...>, type_list<B...>) {
  return (true && ... &&
          bias_accepts<typename A::axis, typename A::placement, typename DVB::template placement_on<typename A::axis>,
                       DVX::rank>()) &&
         (true && ... && bias_accepts<typename B::axis, Replicate, typename B::placement, DVX::rank>());
}

// --------------------------------------------------------- kernels

// A contiguous LayoutRight block seen as a [rows, last extent] matrix, so
// that the kernels of weft::ops (which take matrices) apply to any rank.
template <class V>
auto as_matrix(const V& v) {
  const std::size_t cols = V::rank == 0 ? 1 : v.extent(V::rank - 1);
  const std::size_t rows = cols == 0 ? 0 : v.size() / cols;
  return Kokkos::View<typename V::value_type**, Kokkos::LayoutRight, typename V::memory_space,
                      Kokkos::MemoryTraits<Kokkos::Unmanaged>>(v.data(), rows, cols);
}

// dst(i) = op(src(i)) over the flat local blocks, on the view's execution space.
template <class Exec, class Op, class Src, class Dst>
void map_flat(const char* label, const Src& src, const Dst& dst, Op op) {
  auto s = flat(src);
  auto d = flat(dst);
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, std::int64_t(s.size())),
                       KOKKOS_LAMBDA(const std::int64_t i) { d(i) = op(s(i)); });
}

template <class Exec, class T, class Src, class Dst>
void scale_flat(T alpha, const Src& src, const Dst& dst) {
  auto s = flat(src);
  auto d = flat(dst);
  Kokkos::parallel_for("weft::scale",
                       Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, std::int64_t(s.size())),
                       KOKKOS_LAMBDA(const std::int64_t i) { d(i) = alpha * s(i); });
}

// d(i) = a(i) * b(i) over the flat local blocks (d may be a or b).
template <class Exec, class A, class B, class D>
void mul_flat(const A& a, const B& b, const D& dst) {
  auto x = flat(a);
  auto y = flat(b);
  auto d = flat(dst);
  Kokkos::parallel_for("weft::mul", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, std::int64_t(d.size())),
                       KOKKOS_LAMBDA(const std::int64_t i) { d(i) = x(i) * y(i); });
}

// Whether two DistViews were built on the same mesh (the same axis communicators).
inline bool same_mesh(const AxisTable& a, const AxisTable& b) {
  if (a.count != b.count) return false;
  for (std::size_t i = 0; i < a.count; ++i)
    if (a.names[i] != b.names[i] || a.comms[i] != b.comms[i]) return false;
  return true;
}

template <class DVA, class DVB>
void require_same_mesh(const char* op, const DVA& a, const DVB& b) {
  WEFT_REQUIRE(same_mesh(a.axis_table(), b.axis_table()), ConfigError, op, ": the operands ", DVA::describe(), " and ",
               DVB::describe(), " live on different meshes (", a.axis_table().describe(), " and ",
               b.axis_table().describe(), "); build both on the same Mesh object");
}

// The run-time checks of a binary element-wise operation into y: one mesh,
// and equal global extents.
template <class DVA, class DVB, class DVY>
void require_same_shape(const char* op, const DVA& a, const DVB& b, const DVY& y) {
  require_same_mesh(op, a, b);
  require_same_mesh(op, a, y);
  for (std::size_t d = 0; d < DVA::rank; ++d)
    WEFT_REQUIRE(a.global_extent(d) == b.global_extent(d) && a.global_extent(d) == y.global_extent(d), ShapeError, op,
                 ": the operands' global extents differ in dimension ", d, " (", a.global_extent(d), ", ",
                 b.global_extent(d), " and the result's ", y.global_extent(d),
                 "); element-wise operands must have the same shape");
}

template <class Op, class X>
auto activation(const char* name, const X& x) {
  using DV = std::remove_cvref_t<X>;
  constexpr bool ok = activation_accepts_all<Op>(typename DV::placements{});
  if constexpr (!ok) {
    return x;  // not reached: the static_assert above has failed
  } else {
    using Y = unary_result_t<Nonlinear, DV>;
    Y y(internal_tag{}, x.axis_table(), x.global_extents(), std::string(name));
    if constexpr (std::is_same_v<Op, GeluOp>) ops::gelu_forward(as_matrix(x.local()), as_matrix(y.local()));
    else map_flat<typename DV::execution_space>(name, x.local(), y.local(), Op{});
    return y;
  }
}

}  // namespace detail

// ------------------------------------------------------------ activations

/// y = gelu(x) (tanh approximation, the formula of weft::ops::gelu_forward),
/// element by element; y has x's placements. Does not compile when x is
/// Partial over any axis: reduce it first,
/// weft::gelu(weft::redistribute<weft::Replicate>(x, axis)).
template <DistributedView X>
auto gelu(const X& x) {
  return detail::activation<detail::GeluOp>("weft::gelu", x);
}

/// y = max(x, 0) element by element; y has x's placements. Does not compile
/// when x is Partial over any axis (reduce it first, as for gelu).
template <DistributedView X>
auto relu(const X& x) {
  return detail::activation<detail::ReluOp>("weft::relu", x);
}

/// y = x * sigmoid(x) (SiLU, the gate of SwiGLU) element by element; y has
/// x's placements. Does not compile when x is Partial over any axis (reduce
/// it first, as for gelu).
template <DistributedView X>
auto silu(const X& x) {
  return detail::activation<detail::SiluOp>("weft::silu", x);
}

namespace detail {
// The compile-time rules of weft::add, each a static_assert with its fix;
// true when a + b is allowed.
template <class DVA, class DVB>
constexpr bool add_checked() {
  static_assert(DVA::rank == DVB::rank,
                "weft::add: the operands have different ranks; element-wise operands must have the same shape. "
                "Reshape one of them, or add tensors of the same rank.");
  static_assert(same_element_and_space<DVA, DVB>(),
                "weft::add: the operands have different element types or memory spaces; convert one (deep_copy into "
                "a DistView of the other's type) first.");
  if constexpr (DVA::rank == DVB::rank && same_element_and_space<DVA, DVB>())
    return add_accepts_all<DVA, DVB>(typename DVA::placements{}, typename binary_axes<DVA, DVB>::b_only{});
  else
    return false;
}
}  // namespace detail

// ------------------------------------------------------------- linear ops

/// y = a * x element by element. Scaling is linear, so every placement
/// passes through, Partial<Sum> and Partial<Avg> included (y keeps x's
/// placements); Partial<Max> and Partial<Min> do not compile (a negative
/// factor swaps max and min).
template <DistributedView X>
auto scale(typename std::remove_cvref_t<X>::value_type a, const X& x) {
  using DV = std::remove_cvref_t<X>;
  constexpr bool ok = detail::scale_accepts_all(typename DV::placements{});
  if constexpr (!ok) {
    return x;  // not reached: the static_assert above has failed
  } else {
    using Y = unary_result_t<Multiplicative, DV>;
    Y y(detail::internal_tag{}, x.axis_table(), x.global_extents(), std::string("weft::scale"));
    detail::scale_flat<typename DV::execution_space>(a, x.local(), y.local());
    return y;
  }
}

/// y = a + b element by element (the residual connection): same element
/// type, memory space, rank and global extents (ShapeError otherwise), built
/// on the same mesh (ConfigError otherwise). Over every mesh axis either
/// names, the placements must agree (Shard<D> + Shard<D> and Replicate +
/// Replicate keep theirs), or both be Partial<Sum> (or both Partial<Avg>),
/// which stays Partial: the sum of partial sums is a partial sum. Partial +
/// Replicate does not compile (the Replicate operand would be counted once
/// per rank), nor do Partial + Shard, Shard + Replicate and Shard<i> +
/// Shard<j>; each message names the redistribute that fixes it. The result
/// type is elementwise_result_t<Additive, A, B>.
template <DistributedView A, DistributedView B>
auto add(const A& a, const B& b) {
  using DVA = std::remove_cvref_t<A>;
  using DVB = std::remove_cvref_t<B>;
  constexpr bool ok = detail::add_checked<DVA, DVB>();
  if constexpr (!ok) {
    return a;  // not reached: a static_assert in add_checked has failed
  } else {
    using Y = elementwise_result_t<Additive, DVA, DVB>;
    Y y(detail::internal_tag{}, a.axis_table(), a.global_extents(), std::string("weft::add"));
    add(a, b, y);
    return y;
  }
}

/// y = a + b into an existing y (no allocation; y may be a or b): the same
/// rules as add(a, b), and y must have the result's type,
/// elementwise_result_t<Additive, A, B>, with a's global extents and mesh.
template <DistributedView A, DistributedView B, DistributedView Y>
void add(const A& a, const B& b, const Y& y) {
  using DVA = std::remove_cvref_t<A>;
  using DVB = std::remove_cvref_t<B>;
  constexpr bool ok = detail::add_checked<DVA, DVB>();
  if constexpr (ok) {
    static_assert(std::is_same_v<std::remove_cvref_t<Y>, elementwise_result_t<Additive, DVA, DVB>>,
                  "weft::add(a, b, y): y must have the type of a + b (weft::elementwise_result_t<weft::Additive, A, "
                  "B>: the same element type, memory space, rank and placements); use add(a, b) for a new tensor");
    detail::require_same_shape("weft::add", a, b, y);
    ops::add(detail::as_matrix(y.local()), detail::as_matrix(a.local()), detail::as_matrix(b.local()));
  }
}

namespace detail {
// The compile-time rules of weft::mul; true when a * b is allowed.
template <class DVA, class DVB>
constexpr bool mul_checked() {
  static_assert(DVA::rank == DVB::rank,
                "weft::mul: the operands have different ranks; element-wise operands must have the same shape. "
                "Reshape one of them, or multiply tensors of the same rank.");
  static_assert(same_element_and_space<DVA, DVB>(),
                "weft::mul: the operands have different element types or memory spaces; convert one (deep_copy into "
                "a DistView of the other's type) first.");
  if constexpr (DVA::rank == DVB::rank && same_element_and_space<DVA, DVB>())
    return mul_accepts_all<DVA, DVB>(typename DVA::placements{}, typename binary_axes<DVA, DVB>::b_only{});
  else
    return false;
}
}  // namespace detail

/// y = a * b element by element (the product of a gate and its value, as in
/// SwiGLU or a user's gated block): same element type, memory space, rank
/// and global extents (ShapeError otherwise), built on the same mesh
/// (ConfigError otherwise). Over every mesh axis either names: equal
/// placements (Shard<D> * Shard<D>, Replicate * Replicate) keep theirs, and
/// Partial<Sum> (or Partial<Avg>) times Replicate, in either order, stays
/// Partial, since the product is linear in the partial operand. Partial *
/// Partial does not compile (a product of sums is not the sum of products),
/// nor do Partial<Max> or Partial<Min> times anything, Partial * Shard,
/// Shard * Replicate and Shard<i> * Shard<j>; each message names the
/// redistribute that fixes it. The result type is
/// elementwise_result_t<Multiplicative, A, B>.
template <DistributedView A, DistributedView B>
auto mul(const A& a, const B& b);

/// y = a * b into an existing y (no allocation; y may be a or b): the same
/// rules as mul(a, b), and y must have the result's type,
/// elementwise_result_t<Multiplicative, A, B>, with a's global extents and mesh.
template <DistributedView A, DistributedView B, DistributedView Y>
void mul(const A& a, const B& b, const Y& y) {
  using DVA = std::remove_cvref_t<A>;
  using DVB = std::remove_cvref_t<B>;
  constexpr bool ok = detail::mul_checked<DVA, DVB>();
  if constexpr (ok) {
    static_assert(std::is_same_v<std::remove_cvref_t<Y>, elementwise_result_t<Multiplicative, DVA, DVB>>,
                  "weft::mul(a, b, y): y must have the type of a * b (weft::elementwise_result_t<weft::Multiplicative, "
                  "A, B>: the same element type, memory space, rank and placements); use mul(a, b) for a new tensor");
    detail::require_same_shape("weft::mul", a, b, y);
    detail::mul_flat<typename DVA::execution_space>(a.local(), b.local(), y.local());
  }
}

template <DistributedView A, DistributedView B>
auto mul(const A& a, const B& b) {
  using DVA = std::remove_cvref_t<A>;
  using DVB = std::remove_cvref_t<B>;
  constexpr bool ok = detail::mul_checked<DVA, DVB>();
  if constexpr (!ok) {
    return a;  // not reached: a static_assert in mul_checked has failed
  } else {
    using Y = elementwise_result_t<Multiplicative, DVA, DVB>;
    Y y(detail::internal_tag{}, a.axis_table(), a.global_extents(), std::string("weft::mul"));
    mul(a, b, y);
    return y;
  }
}

/// y(..., j) = x(..., j) + b(j): a bias b (rank 1, as many global elements as
/// x's last dimension, the same element type and memory space, built on the
/// same mesh) added along x's last (feature) dimension; y has x's
/// placements. The bias's placement follows x's over each axis
/// (bias_placement_t): Replicate where every rank holds every feature of x
/// (x Replicate, or Shard over a leading, token dimension), Shard<0> where x
/// is Shard over its last dimension (each rank adds its slice of the bias:
/// Shard<1> for a [tokens, features] x). x Partial over any axis does not
/// compile: every rank would add the bias, so the reduced sum would hold it
/// once per rank of the axis; all-reduce x first
/// (weft::redistribute<weft::Replicate>(x, axis)). A placed row-parallel
/// nn::Linear adds its own bias to its Partial<Sum> output on one rank only,
/// which this operation cannot know; it is the layer's business.
template <DistributedView X, DistributedView B>
auto bias_add(const X& x, const B& b) {
  using DVX = std::remove_cvref_t<X>;
  using DVB = std::remove_cvref_t<B>;
  static_assert(DVB::rank == 1,
                "weft::bias_add: the bias must be a vector (rank 1) along the tensor's last dimension; pass a "
                "DistView<T, 1, ...> of as many elements as the tensor has features.");
  static_assert(detail::same_element_and_space<DVX, DVB>(),
                "weft::bias_add: the tensor and the bias have different element types or memory spaces; convert "
                "the bias (deep_copy into a DistView of the tensor's type) first.");
  constexpr bool ok = DVB::rank == 1 && detail::same_element_and_space<DVX, DVB>() &&
                      detail::bias_accepts_all<DVX, DVB>(typename DVX::placements{},
                                                         typename detail::binary_axes<DVX, DVB>::b_only{});
  if constexpr (!ok) {
    return x;  // not reached: a static_assert above has failed
  } else {
    detail::require_same_mesh("weft::bias_add", x, b);
    WEFT_REQUIRE(b.global_extent(0) == x.global_extent(DVX::rank - 1), ShapeError, "weft::bias_add: the bias has ",
                 b.global_extent(0), " elements but the tensor's last dimension has ", x.global_extent(DVX::rank - 1),
                 "; the bias needs one element per feature");
    DVX y(detail::internal_tag{}, x.axis_table(), x.global_extents(), std::string("weft::bias_add"));
    Kokkos::deep_copy(y.local(), x.local());
    ops::bias_add(detail::as_matrix(y.local()), b.local());
    return y;
  }
}

}  // namespace weft
