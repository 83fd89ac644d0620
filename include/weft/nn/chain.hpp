// A block declared as a sequence of steps over placed tensors, with its
// backward generated from the sequence: nn::Chain<X, Steps...> runs
// y = s_n(...s_1(s_0(x))) forward, keeping each step's input, and backward
// runs the steps' backwards in reverse, each fed the gradient of its output.
// A step is any object with
//
//   auto forward(const In& x)                  -> Out
//   auto backward(const In& x, const DOut& dy) -> DIn
//
// which a placed weft::nn::Linear<T, On<Axis, Shard<D>>> is, and so are the
// element-wise steps here (nn::Gelu, nn::Relu, nn::Silu) and nn::Reduce<Axis>
// (a Partial<Sum> tensor all-reduced to Replicate). Between two steps the
// chain converts each input gradient to its input's placement: a Replicate
// input that fed a split computation gets a Partial<Sum> gradient (each rank
// holds its share of the sum), which the chain all-reduces
// (weft::redistribute<Replicate>). So the user writes the sequence once; the
// placements are checked at compile time as for the placed operations
// themselves; and a step that is truly the user's own brings its own
// backward. nn::Residual<Chain> adds the skip connection: y = x + f(x).
//
// The split backward of zero-bubble schedules reaches every step that has
// defer_weight_gradients (the placed Linear); the parameters every step that
// has collect(params) or local().collect(params).
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/nn/parameter.hpp>
#include <weft/ops/elementwise.hpp>
#include <weft/placement/dist_view.hpp>
#include <weft/placement/elementwise.hpp>
#include <weft/placement/redistribute.hpp>

namespace weft::nn {

namespace detail {
// dx(i) = op(dy(i), x(i)) over the flat local blocks (a functor, not a
// lambda: nvcc refuses extended lambdas inside generic ones).
template <class G, class X, class O, class Op>
struct ActivationGrad {
  G g;
  X x;
  O o;
  Op op;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { o.data()[i] = op(g.data()[i], x.data()[i]); }
};
struct ReluGrad {
  static constexpr const char* grad_label = "weft::nn::Relu.dx";
  template <class X>
  static auto forward(const X& x) {
    return weft::relu(x);
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T x) const {
    return x > T(0) ? g : T(0);
  }
};
struct SiluGrad {  // d/dx x s(x) = s (1 + x (1 - s))
  static constexpr const char* grad_label = "weft::nn::Silu.dx";
  template <class X>
  static auto forward(const X& x) {
    return weft::silu(x);
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T x) const {
    const T s = ops::detail::sigmoid(x);
    return g * s * (T(1) + x * (T(1) - s));
  }
};
struct GeluGrad {  // the gradient is weft::ops::gelu_backward
  static constexpr const char* grad_label = "weft::nn::Gelu.dx";
  template <class X>
  static auto forward(const X& x) {
    return weft::gelu(x);
  }
};

// The element-wise steps' backward: dx = f'(x) * dy, laid out as dy (which
// must have x's placements: the activation keeps them).
template <class Op, class X, class DY>
auto activation_backward(const char* name, const X& x, const DY& dy) {
  static_assert(std::is_same_v<typename std::remove_cvref_t<X>::placements, typename std::remove_cvref_t<DY>::placements>,
                "weft::nn::Chain: an activation step's output gradient must have the placements of its input (an "
                "activation keeps them); the step after it returned a gradient placed otherwise");
  using DX = std::remove_cvref_t<DY>;
  DX dx(weft::detail::internal_tag{}, dy.axis_table(), dy.global_extents(), std::string(name));
  const auto g = weft::detail::as_matrix(dy.local());
  const auto v = weft::detail::as_matrix(x.local());
  const auto o = weft::detail::as_matrix(dx.local());
  if constexpr (std::is_same_v<Op, GeluGrad>) {
    ops::gelu_backward(g, v, o);
  } else {
    using Exec = typename DX::execution_space;
    Kokkos::parallel_for(name, Kokkos::RangePolicy<Exec>(0, o.size()),
                         ActivationGrad<decltype(g), decltype(v), decltype(o), Op>{g, v, o, Op{}});
  }
  return dx;
}

// The gradient of an input placed as In, from a step's input gradient d:
// every axis over which In is Replicate and d Partial<Sum> is all-reduced.
template <class In, class D>
auto gradient_as(const D& d, weft::type_list<>) {
  return d;
}
template <class In, class D, class First, class... Rest>
auto gradient_as(const D& d, weft::type_list<First, Rest...>) {
  using Axis = typename First::axis;
  using P = typename First::placement;
  using Want = typename std::remove_cvref_t<In>::template placement_on<Axis>;
  if constexpr (weft::is_partial_v<P> && weft::is_replicate_v<Want>) {
    auto r = weft::redistribute<weft::Replicate>(d, Axis{});
    return gradient_as<In>(r, typename decltype(r)::placements{});
  } else {
    return gradient_as<In>(d, weft::type_list<Rest...>{});
  }
}

template <class S>
concept DefersWeightGradients = requires(S& s, DeferredWork* w) { s.defer_weight_gradients(w); };

template <class S, class T, class Space>
void collect_of(S& s, std::vector<Parameter<T, Space>*>& out) {
  if constexpr (requires { s.collect(out); }) s.collect(out);
  else if constexpr (requires { s.local().collect(out); }) s.local().collect(out);
}

// The input types of Steps... fed X: In_0 = X, In_{i+1} = step i's output.
template <class X, class... Steps>
struct chain_inputs {
  using type = std::tuple<>;
  using output = X;
};
template <class X, class First, class... Rest>
struct chain_inputs<X, First, Rest...> {
  using out = std::remove_cvref_t<decltype(std::declval<First&>().forward(std::declval<const X&>()))>;
  using type = decltype(std::tuple_cat(std::declval<std::tuple<X>>(), std::declval<typename chain_inputs<out, Rest...>::type>()));
  using output = typename chain_inputs<out, Rest...>::output;
};
}  // namespace detail

namespace detail {
// An element-wise activation as a chain step: Act::forward(x) (the placed
// weft::gelu, relu or silu, which keep x's placements) and
// activation_backward<Act> (dx = f'(x) dy on the local blocks).
template <class Act>
struct ActivationStep {
  template <DistributedView X>
  auto forward(const X& x) const {
    return Act::forward(x);
  }
  template <DistributedView X, DistributedView DY>
  auto backward(const X& x, const DY& dy) const {
    return activation_backward<Act>(Act::grad_label, x, dy);
  }
};
}  // namespace detail

/// Element-wise GELU (tanh form, weft::gelu) as a chain step; its backward
/// is weft::ops::gelu_backward on the local blocks (placements unchanged).
using Gelu = detail::ActivationStep<detail::GeluGrad>;
/// Element-wise ReLU (weft::relu) as a chain step.
using Relu = detail::ActivationStep<detail::ReluGrad>;
/// Element-wise SiLU (weft::silu, x sigmoid(x)) as a chain step.
using Silu = detail::ActivationStep<detail::SiluGrad>;

/// A Partial<Sum> tensor over Axis all-reduced to Replicate (a row-parallel
/// matmul's output joined), as a chain step. Backward hands the Replicate
/// output gradient to every rank's partial term unchanged (d/dx_r of
/// sum_r x_r is the identity), the placement a row-parallel Linear's
/// backward takes.
template <class Axis>
struct Reduce {
  /// Backward does not read the input: the chain does not keep it.
  static constexpr bool needs_input = false;
  template <DistributedView X>
  auto forward(const X& x) const {
    return weft::redistribute<weft::Replicate>(x, Axis{});
  }
  template <DistributedView X, DistributedView DY>
  auto backward(const X&, const DY& dy) const {
    return dy;
  }
};

/// A sequence of steps fed an input of DistView type X (see the file
/// comment). Steps are held by value, in order; forward and backward are
/// generated from them. A step whose backward does not read its input
/// declares `static constexpr bool needs_input = false` (nn::Reduce), and
/// the chain does not keep that input.
template <DistributedView X, class... Steps>
class Chain {
  static_assert(sizeof...(Steps) >= 1, "weft::nn::Chain: name at least one step");

 public:
  /// The input type.
  using input_type = X;
  /// The output type: the last step's.
  using output_type = typename detail::chain_inputs<X, Steps...>::output;
  /// What forward keeps for backward: the input of every step that needs
  /// it, in order (DistView handles; the first is the chain's input; the
  /// others stay empty). Empty until the first forward.
  struct Saved {
    typename detail::chain_inputs<X, Steps...>::type inputs;
  };

  /// The steps, moved in.
  explicit Chain(Steps... steps) : steps_(std::move(steps)...) {}

  /// Runs every step on x in order; keeps their inputs in s.
  output_type forward(const X& x, Saved& s) { return run_forward<0>(x, s); }

  /// The input gradient from the output gradient dy (placed as the
  /// output), after forward(x, s): each step's backward in reverse order,
  /// each input gradient converted to its input's placement (Partial<Sum>
  /// over an axis where the input was Replicate is all-reduced). The
  /// result has X's placements.
  template <DistributedView DY>
  auto backward(const DY& dy, Saved& s) {
    return run_backward<sizeof...(Steps) - 1>(dy, s);
  }

  /// Forwarded to every step that has it (the placed Linear): while `work`
  /// is non-null their weight gradients are queued there (zero-bubble split
  /// backward).
  void defer_weight_gradients(DeferredWork* work) {
    std::apply([&](auto&... st) { ((defer(st, work)), ...); }, steps_);
  }

  /// Appends the steps' parameters, in step order.
  template <class T, class Space>
  void collect(std::vector<Parameter<T, Space>*>& out) {
    std::apply([&](auto&... st) { (detail::collect_of(st, out), ...); }, steps_);
  }

  /// Bytes of the tensors s keeps that the chain's steps produced (every
  /// kept input but the chain's own, which is the caller's).
  std::size_t saved_bytes(const Saved& s) const {
    std::size_t b = 0;
    std::apply([&](const auto& x0, const auto&... xs) {
      (void)x0;
      ((b += xs.local().span() * sizeof(typename std::remove_cvref_t<decltype(xs)>::value_type)), ...);
    }, s.inputs);
    return b;
  }

  /// Step I.
  template <std::size_t I>
  auto& step() {
    return std::get<I>(steps_);
  }

 private:
  template <class S>
  static void defer(S& st, DeferredWork* work) {
    if constexpr (detail::DefersWeightGradients<S>) st.defer_weight_gradients(work);
  }
  template <class S>
  static constexpr bool keeps_input() {
    if constexpr (requires { S::needs_input; }) return S::needs_input;
    else return true;
  }
  template <std::size_t I, class In>
  output_type run_forward(const In& x, Saved& s) {
    if constexpr (keeps_input<std::tuple_element_t<I, std::tuple<Steps...>>>()) std::get<I>(s.inputs) = x;
    auto y = std::get<I>(steps_).forward(x);
    if constexpr (I + 1 == sizeof...(Steps)) return y;
    else return run_forward<I + 1>(y, s);
  }
  template <std::size_t I, class DY>
  auto run_backward(const DY& dy, Saved& s) {
    const auto& x = std::get<I>(s.inputs);
    auto d = std::get<I>(steps_).backward(x, dy);
    auto dx = detail::gradient_as<std::remove_cvref_t<decltype(x)>>(d, typename decltype(d)::placements{});
    if constexpr (I == 0) return dx;
    else return run_backward<I - 1>(dx, s);
  }

  std::tuple<Steps...> steps_;
};

/// y = x + f(x) for a Chain f whose output has its input's placements (a
/// residual block): forward writes y, backward writes dx = dy + df/dx^T dy.
template <class F>
class Residual {
 public:
  using input_type = typename F::input_type;
  using Saved = typename F::Saved;

  /// The body, moved in.
  explicit Residual(F f) : f_(std::move(f)) {}

  /// y = x + f(x), written into y (placed as x).
  void forward(const input_type& x, const input_type& y, Saved& s) { weft::add(x, f_.forward(x, s), y); }
  /// dx = dy + the body's input gradient, written into dx (placed as x).
  void backward(const input_type& dy, const input_type& dx, Saved& s) { weft::add(dy, f_.backward(dy, s), dx); }

  /// See Chain::defer_weight_gradients.
  void defer_weight_gradients(DeferredWork* work) { f_.defer_weight_gradients(work); }
  /// See Chain::collect.
  template <class T, class Space>
  void collect(std::vector<Parameter<T, Space>*>& out) {
    f_.collect(out);
  }
  /// The body.
  F& body() { return f_; }
  /// The body.
  const F& body() const { return f_; }
  /// See Chain::saved_bytes.
  std::size_t saved_bytes(const Saved& s) const { return f_.saved_bytes(s); }

 private:
  F f_;
};

}  // namespace weft::nn
