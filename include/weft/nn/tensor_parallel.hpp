// Tensor-parallel Linear layers whose placements are types:
//   weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<0>>>  column-parallel (output features split)
//   weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<1>>>  row-parallel (input features split)
// The placement names the split of the weight read as [out, in] (Megatron's
// convention); weft stores W as [in, out], so the stored weight is Shard<1>
// (column) or Shard<0> (row) of that. forward() takes and returns DistViews and
// the result's placement comes from the matmul propagation rule; an input the
// layer cannot take (a replicated tensor into a row-parallel layer, the
// output of a column-parallel layer into another one, a sequence-sharded
// tensor) does not compile, and the message names the layer, the placement it
// got, the one it needs and the redistribute that fixes it.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

#include <weft/core/allocation.hpp>
#include <weft/core/error.hpp>
#include <weft/nn/linear.hpp>
#include <weft/placement/dist_view.hpp>
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

namespace weft::nn {

/// Initialisation of a placed Linear: the name that seeds it (with the seed
/// and global indices, so every shard holds the single-process values).
struct LinearInit {
  std::string name = "linear";  ///< parameters "<name>.weight" and "<name>.bias"
  bool bias = true;             ///< whether the layer has a bias
  std::uint64_t seed = 1234;    ///< initialisation seed
  double init_std = 0.02;       ///< std of the weight
};

/// A Linear split over mesh axis Axis: Shard<0> column-parallel, Shard<1>
/// row-parallel (see the file comment).
template <class T, class Axis, class P>
class Linear<T, On<Axis, P>> {
  static_assert(is_shard_v<P> && (weft::detail::shard_dim_or_npos<P>() == 0 || weft::detail::shard_dim_or_npos<P>() == 1),
                "weft::nn::Linear<T, On<Axis, P>>: P must be Shard<0> (column-parallel: output features split) or "
                "Shard<1> (row-parallel: input features split)");

 public:
  /// Where the local weight lives and kernels run.
  using Space = Kokkos::DefaultExecutionSpace;
  /// True for the column-parallel layer.
  static constexpr bool column = weft::detail::shard_dim_or_npos<P>() == 0;
  /// Placement over Axis of the stored weight W [in, out].
  using weight_placement = std::conditional_t<column, Shard<1>, Shard<0>>;
  /// Placement over Axis the input must have: Replicate (column) or Shard<1> (row).
  using input_placement = std::conditional_t<column, Replicate, Shard<1>>;
  /// Placement over Axis of the output: Shard<1> (column) or Partial<Sum> (row), by the matmul rule.
  using output_placement = matmul_placement_t<input_placement, weight_placement>;

  /// A layer of `in` x `out` global features on `mesh`'s axis Axis; this rank
  /// holds its part, initialised to the single-process layer's values there.
  template <class MeshT>
  Linear(MeshT& mesh, std::size_t in, std::size_t out, LinearInit init = {})
      : comm_(&mesh.template axis<Axis>()),
        ctx_(std::make_shared<LayerContext>()),
        in_(in),
        out_(out),
        local_(ctx_, init.name, in, out, init.bias, init.seed, init.init_std,
               column ? LinearSplit::column(std::size_t(comm_->size()), std::size_t(comm_->rank()))
                      : LinearSplit::row(std::size_t(comm_->size()), std::size_t(comm_->rank()))) {}

  /// y = x W + b for a DistView x [tokens, in] whose placement over Axis is
  /// input_placement; y has output_placement over Axis (the other axes keep
  /// x's placements). A row-parallel layer adds its bias on rank 0 of Axis
  /// only, so the Partial<Sum> result sums to x W + b.
  template <DistributedView X>
  auto forward(const X& x) const {
    // The layer's contract first, and the matmul rule only for inputs that
    // meet it: a misused layer then reports its own message, not the generic
    // matmul one about the operands "A" and "B" (whose advice, to
    // redistribute the layer's internal weight, a layer's user cannot follow).
    constexpr bool ok = accepts<X>();
    if constexpr (!ok) {
      return x;  // not reached: a static_assert in accepts() has failed
    } else {
      using W = BasicDistView<T, dextents<2>, typename X::memory_space, On<Axis, weight_placement>>;
      using Y = matmul_result_t<X, W>;
      Y y = make_result<Y>(outputs_, x, {x.global_extent(0), out_}, local_.out(), local_name() + ".out");
      local_.forward(x.local(), y.local());
      // A split row-parallel layer leaves the bias out of its partial sum (one
      // TP rank of 1 is the whole layer, which has added it already).
      if (local_.split().kind == LinearSplit::Kind::row && comm_->rank() == 0) local_.add_bias(y.local());
      return y;
    }
  }

  /// Backward of forward(x): parameter gradients accumulate and the input
  /// gradient is returned -- Partial<Sum> over Axis for the column-parallel
  /// layer (each rank's output features contribute; all-reduce it), Shard<1>
  /// for the row-parallel one. dy has forward's output placement, except
  /// that a row-parallel layer needs it Replicate (the reduced gradient).
  template <DistributedView X, DistributedView DY>
  auto backward(const X& x, const DY& dy) {
    constexpr bool input_ok = accepts<X>();
    using PDY = typename DY::template placement_on<Axis>;
    static_assert(!column || std::is_same_v<PDY, Shard<1>>,
                  "weft::nn::Linear<On<Axis, Shard<0>>>::backward (column-parallel): the output gradient must be "
                  "Shard<1> over the layer's axis, like the output");
    static_assert(column || is_replicate_v<PDY>,
                  "weft::nn::Linear<On<Axis, Shard<1>>>::backward (row-parallel): the output gradient must be "
                  "Replicate over the layer's axis (the gradient of the reduced output); redistribute it first");
    if constexpr (!input_ok || !(column ? std::is_same_v<PDY, Shard<1>> : is_replicate_v<PDY>)) {
      return x;  // not reached: a static_assert above has failed
    } else {
      using DX = redistributed_t<X, Axis, std::conditional_t<column, Partial<Sum>, Shard<1>>>;
      DX dx = make_result<DX>(input_grads_, x, {x.global_extent(0), in_}, x.local().extent(1), local_name() + ".dx");
      local_.backward(x.local(), dy.local(), dx.local(), false);
      return dx;
    }
  }

  /// While `work` is non-null, backward() computes the input gradient and the
  /// bias gradient and queues the weight gradient's gemm on `work` instead
  /// (the split backward of zero-bubble schedules; x must stay unchanged
  /// until the work runs). Null: backward computes everything.
  void defer_weight_gradients(DeferredWork* work) { ctx_->deferred_weight_grads = work; }

  /// Host-side storage of the layer's results. forward() and backward() take
  /// their outputs' local blocks from these pools (see weft::ViewRecycler):
  /// an output whose every copy the caller has dropped is overwritten by the
  /// next call with the same extents instead of being allocated again, so a
  /// training loop allocates a layer's output and input gradient once, not
  /// once per step; one still held (an activation kept for backward, a
  /// pipeline's microbatch in flight) is never reused. Results in a memory
  /// space other than Space's are allocated on every call.
  using result_view = Kokkos::View<T**, Kokkos::LayoutRight, typename Space::memory_space>;
  /// The pool of forward()'s outputs.
  const ViewRecycler<result_view>& output_storage() const { return outputs_; }
  /// The pool of backward()'s input gradients.
  const ViewRecycler<result_view>& input_gradient_storage() const { return input_grads_; }

  /// This rank's part of the layer (its parameters, the raw-view forward).
  Linear<T, Space>& local() { return local_; }
  /// Global input features.
  std::size_t in() const { return in_; }
  /// Global output features.
  std::size_t out() const { return out_; }

 private:
  std::string local_name() const { return "weft::nn::Linear"; }

  // A result R laid out on x's mesh axes with the given global extents, its
  // local block [x's local rows, cols] from `pool` when R's block is a
  // result_view, else freshly allocated.
  template <class R, class X>
  static R make_result(ViewRecycler<result_view>& pool, const X& x, const std::array<std::size_t, 2>& global,
                       std::size_t cols, const std::string& label) {
    if constexpr (std::is_same_v<typename R::view_type, result_view>) {
      R r(weft::detail::internal_tag{}, x.axis_table(), global, pool.take(label, x.local().extent(0), cols));
      WEFT_REQUIRE(r.local().extent(0) == r.local_extent(0) && r.local().extent(1) == r.local_extent(1),
                   ShapeError, "weft::nn::Linear: the result block is ", r.local().extent(0), " x ",
                   r.local().extent(1), " but its placements give this rank ", r.local_extent(0), " x ",
                   r.local_extent(1));
      return r;
    } else {
      return R(weft::detail::internal_tag{}, x.axis_table(), global, label);
    }
  }

  // The layer's compile-time contract on its input: its placement over Axis
  // (check_input), and over every other axis it names no split of the input
  // features (the weight is whole there). Evaluated as a constant, so that
  // the compiler reports these messages before anything else.
  template <class X>
  static constexpr bool accepts() {
    using PX = typename X::template placement_on<Axis>;
    check_input<PX>();
    return std::is_same_v<PX, input_placement> && other_axes_ok(typename X::placements{});
  }
  template <class... O>
  static constexpr bool other_axes_ok(type_list<O...>) {
    return (true && ... && other_axis_ok<typename O::axis, typename O::placement>());
  }
  template <class OtherAxis, class PO>
  static constexpr bool other_axis_ok() {
    if constexpr (std::is_same_v<OtherAxis, Axis>) {
      return true;
    } else {
      static_assert(!(is_shard_v<PO> && weft::detail::shard_dim_or_npos<PO>() == 1),
                    "weft::nn::Linear<On<Axis, Shard<...>>>: the input's features are split (Shard<1>) over a mesh "
                    "axis other than the layer's (named in the instantiation note), over which the layer's weight "
                    "is whole. All-gather it over that axis first: weft::redistribute<weft::Replicate>(x, "
                    "OtherAxis{})");
      return !(is_shard_v<PO> && weft::detail::shard_dim_or_npos<PO>() == 1);
    }
  }

  // The layer's compile-time contract on its input's placement over Axis.
  template <class PX>
  static constexpr void check_input() {
    static_assert(!(is_shard_v<PX> && weft::detail::shard_dim_or_npos<PX>() == 0),
                  "weft::nn::Linear<On<Axis, Shard<...>>>: the input is sequence-sharded (Shard<0> over the layer's "
                  "axis: its tokens are split), and a sequence-sharded tensor cannot enter a matmul whose weight is "
                  "split over the same axis. All-gather it first: weft::redistribute<weft::Replicate>(x, axis) (the "
                  "all-gather sequence parallelism puts before a column-parallel layer)");
    static_assert(!is_partial_v<PX>,
                  "weft::nn::Linear<On<Axis, Shard<...>>>: the input is Partial over the layer's axis (the output of "
                  "a row-parallel layer); reduce it first with weft::redistribute<weft::Replicate>(x, axis) "
                  "(all-reduce)");
    if constexpr (column)
      static_assert(!(is_shard_v<PX> && weft::detail::shard_dim_or_npos<PX>() == 1),
                    "weft::nn::Linear<On<Axis, Shard<0>>> (column-parallel) got an input that is Shard<1> over its "
                    "axis -- the output of another column-parallel layer -- but needs it Replicate. Two "
                    "column-parallel layers in a row need a redistribute between them: feed this tensor to a "
                    "row-parallel layer (Linear<T, On<Axis, Shard<1>>>), or all-gather it first with "
                    "weft::redistribute<weft::Replicate>(x, axis)");
    else
      static_assert(!is_replicate_v<PX>,
                    "weft::nn::Linear<On<Axis, Shard<1>>> (row-parallel) got a Replicate input but needs it Shard<1> "
                    "over its axis (each rank multiplies only its own input features). Feed it the output of a "
                    "column-parallel layer (Linear<T, On<Axis, Shard<0>>>), or slice it first with "
                    "weft::redistribute<weft::Shard<1>>(x, axis) (no communication; the input's type must name the "
                    "axis, e.g. DistView<T, 2, On<Axis, Replicate>>)");
  }

  Comm* comm_;
  ContextPtr ctx_;
  std::size_t in_, out_;
  Linear<T, Space> local_;
  mutable ViewRecycler<result_view> outputs_;  // forward() is const; the pool is storage, not state
  ViewRecycler<result_view> input_grads_;
};

}  // namespace weft::nn
