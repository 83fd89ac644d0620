// The collectives a tensor-parallel model issues between its matmuls, on the
// TP axis of its Context, each charged to a profiler scope ("tp.all_reduce",
// "tp.all_gather", "tp.reduce_scatter") so a run can report their exposed
// time; the row-parallel layer that closes each TP region (attention's output
// projection, the MLP's down-projection) with its collective; and the
// reduction of gradients that sequence parallelism leaves partial (norm
// scales, learned positions).
#pragma once

#include <vector>

#include <weft/nn/parameter.hpp>

namespace weft::nn::detail {

/// buf = sum over the TP ranks of buf.
template <class V>
void tp_all_reduce(const Context& ctx, const V& buf, ReduceOp op = ReduceOp::sum) {
  metrics::Profiler::Scope s(ctx.profiler, "tp.all_reduce");
  ctx.tp.comm->all_reduce(buf, op);
}

/// full = the TP ranks' row blocks `part`, stacked in rank order.
template <class S, class F>
void tp_all_gather(const Context& ctx, const S& part, const F& full) {
  metrics::Profiler::Scope s(ctx.profiler, "tp.all_gather");
  ctx.tp.comm->all_gather(part, full);
}

/// part = row block (this rank) of the sum over the TP ranks of full.
template <class F, class S>
void tp_reduce_scatter(const Context& ctx, const F& full, const S& part) {
  metrics::Profiler::Scope s(ctx.profiler, "tp.reduce_scatter");
  ctx.tp.comm->reduce_scatter(full, part);
}

/// out = x W + b through `layer`, the row-parallel Linear that closes a TP
/// region (attention's output projection, the MLP's down-projection; without
/// TP a plain Linear). Each rank multiplies its input features x [tokens,
/// in / tp] and the partial sums are joined over the TP axis: all-reduced
/// into out [tokens, D], or under sequence parallelism written to `full`
/// [tokens, D] and reduce-scattered into this rank's token shard out; the
/// bias is added once, after the join. `full` may be null without sequence
/// parallelism; `who` names the caller in the error when it is null with it.
template <class L, class XV, class OV, class FV>
void row_parallel_forward(const Context& ctx, const L& layer, const XV& x, const OV& out, const FV* full,
                          const char* who) {
  if (!ctx.tp.active()) {
    layer.forward(x, out);
    return;
  }
  if (!ctx.tp.sp()) {
    layer.forward(x, out);  // partial sums, no bias
    tp_all_reduce(ctx, out);
  } else {
    WEFT_REQUIRE(full != nullptr, Error, who, ": sequence parallelism needs the workspace in forward");
    layer.forward(x, *full);
    tp_reduce_scatter(ctx, *full, out);
  }
  layer.add_bias(out);
}

/// Backward of row_parallel_forward: dx [tokens, in / tp] = dout W^T
/// (overwritten) and the layer's parameter gradients accumulate. dout has
/// forward's rows of out; under sequence parallelism it is first all-gathered
/// into `full` [tokens, D] (the whole output gradient every rank's features
/// need).
template <class L, class XV, class DOV, class DXV, class FV>
void row_parallel_backward(const Context& ctx, L& layer, const XV& x, const DOV& dout, const DXV& dx, const FV& full) {
  if (ctx.tp.sp()) {
    tp_all_gather(ctx, dout, full);
    layer.backward(x, full, dx, false);
  } else {
    layer.backward(x, dout, dx, false);
  }
}

/// Gradients of replicated parameters that a sequence-parallel rank computes
/// from its token shard only (norm scales and shifts, learned positions): each
/// rank holds a partial sum. begin() sets the gradients aside and zeroes them;
/// finish() all-reduces what this microbatch added over the TP axis (one
/// call for all of them) and adds back what was set aside, so gradients
/// accumulated over earlier microbatches are not counted tp times.
template <class T, class Space>
class PartialGrads {
 public:
  /// Over the given parameters (none: begin and finish do nothing).
  explicit PartialGrads(std::vector<Parameter<T, Space>*> params = {}) : params_(std::move(params)) {
    std::size_t n = 0;
    for (auto* p : params_) n += p->size();
    if (n) {
      stash_ = Kokkos::View<T*, Space>("tp.partial_grads.stash", n);
      flat_ = Kokkos::View<T*, Space>("tp.partial_grads.flat", n);
    }
  }
  /// Sets the gradients aside and zeroes them (before the group's backward).
  void begin() {
    std::size_t off = 0;
    for (auto* p : params_) {
      Kokkos::deep_copy(Kokkos::subview(stash_, std::make_pair(off, off + p->size())), p->grad);
      Kokkos::deep_copy(p->grad, T(0));
      off += p->size();
    }
  }
  /// Sums this microbatch's parts over TP and adds back the set-aside values.
  void finish(const Context& ctx) {
    if (params_.empty()) return;
    std::size_t off = 0;
    for (auto* p : params_) {
      Kokkos::deep_copy(Kokkos::subview(flat_, std::make_pair(off, off + p->size())), p->grad);
      off += p->size();
    }
    tp_all_reduce(ctx, flat_);
    off = 0;
    for (auto* p : params_) {
      auto g = p->grad;
      auto f = Kokkos::subview(flat_, std::make_pair(off, off + p->size()));
      auto st = Kokkos::subview(stash_, std::make_pair(off, off + p->size()));
      Kokkos::parallel_for(
          "weft::tp_partial_grads", Kokkos::RangePolicy<typename Space::execution_space>(0, g.extent(0)),
          KOKKOS_LAMBDA(std::size_t i) { g(i) = f(i) + st(i); });
      off += p->size();
    }
  }
  /// Elements all-reduced per finish().
  std::size_t size() const { return flat_.extent(0); }

 private:
  std::vector<Parameter<T, Space>*> params_;
  Kokkos::View<T*, Space> stash_, flat_;
};

}  // namespace weft::nn::detail
