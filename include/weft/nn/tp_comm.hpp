// The collectives a tensor-parallel model issues between its matmuls, on the
// TP axis of its LayerContext, each charged to a profiler scope ("tp.all_reduce",
// "tp.all_gather", "tp.reduce_scatter") so a run can report their exposed
// time; the row-parallel layer that closes each TP region (attention's output
// projection, the MLP's down-projection) with its collective; the
// vocabulary-parallel LM head and its cross-entropy; and the
// reduction of gradients that sequence parallelism leaves partial (norm
// scales, learned positions).
#pragma once

#include <cstddef>
#include <vector>

#include <weft/nn/parameter.hpp>
#include <weft/ops/cross_entropy.hpp>

namespace weft::nn::detail {

/// buf = sum over the TP ranks of buf.
template <class V>
void tp_all_reduce(const LayerContext& ctx, const V& buf, ReduceOp op = ReduceOp::sum) {
  metrics::Profiler::Scope s(ctx.profiler, "tp.all_reduce");
  ctx.tp.comm->all_reduce(buf, op);
}

/// full = the TP ranks' row blocks `part`, stacked in rank order.
template <class S, class F>
void tp_all_gather(const LayerContext& ctx, const S& part, const F& full) {
  metrics::Profiler::Scope s(ctx.profiler, "tp.all_gather");
  ctx.tp.comm->all_gather(part, full);
}

/// part = row block (this rank) of the sum over the TP ranks of full.
template <class F, class S>
void tp_reduce_scatter(const LayerContext& ctx, const F& full, const S& part) {
  metrics::Profiler::Scope s(ctx.profiler, "tp.reduce_scatter");
  ctx.tp.comm->reduce_scatter(full, part);
}

/// The sequence-parallel all-gather of an activation that only weight
/// products read (the attention's and the MLP's inputs, the head's): the
/// same as tp_all_gather(ctx, part, full), except under 2-byte products
/// (ctx.products bf16 or fp16), where each rank's part travels rounded to
/// the product type (nearest even, weft::convert) and `full` receives the
/// rounded values widened back. Every product rounds its operands to that
/// type anyway, so what the products compute is bit for bit what a float
/// gather gives, for half the bytes. The 2-byte buffers are the product
/// staging's operand slots 1 and 2 (nn::ProductStaging<Space>, which must
/// be the layers' Space), free between products and already as large as
/// the products need them (a gathered input is one of those operands).
template <class Space, class S, class F>
void tp_all_gather_operand(LayerContext& ctx, const S& part, const F& full) {
  if constexpr (std::is_same_v<typename F::non_const_value_type, float>) {
    if (ctx.products != ProductPrecision::f32) {
      auto& st = product_staging<Space>(ctx);
      auto gather = [&]<class H>() {
        const auto p = st.template rounded<H>(1, part);  // (the Comm fences p's execution space before MPI reads it)
        const auto f = st.template matrix<H>(2, full.extent(0), full.extent(1));
        tp_all_gather(ctx, p, f);
        weft::convert(full, f);
      };
      if (ctx.products == ProductPrecision::bf16) gather.template operator()<bf16>();
      else gather.template operator()<fp16>();
      return;
    }
  }
  tp_all_gather(ctx, part, full);
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
void row_parallel_forward(const LayerContext& ctx, const L& layer, const XV& x, const OV& out, const FV* full,
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
void row_parallel_backward(const LayerContext& ctx, L& layer, const XV& x, const DOV& dout, const DXV& dx, const FV& full) {
  if (ctx.tp.sp()) {
    tp_all_gather(ctx, dout, full);
    layer.backward(x, full, dx, false);
  } else {
    layer.backward(x, dout, dx, false);
  }
}

/// The LM head over vocabulary-split columns: logits [tokens, V / tp] of the
/// final norm's output hf; under sequence parallelism hf is this rank's token
/// shard and is first all-gathered into `hf_full` [tokens, D].
template <class L, class HV, class FV, class LV>
void head_forward(LayerContext& ctx, const L& head, const HV& hf, const FV& hf_full, const LV& logits) {
  if (ctx.tp.sp()) {
    tp_all_gather_operand<typename L::space_type>(ctx, hf, hf_full);
    head.forward(hf_full, logits);
  } else {
    head.forward(hf, logits);
  }
}

/// Backward of head_forward: dhf = the gradient of hf (overwritten) from the
/// logits' gradient, and the head's weight gradient accumulates. With tensor
/// parallelism each rank's vocabulary columns give a part of dhf: all-reduced,
/// or under sequence parallelism written to `dhf_full` [tokens, D] and
/// reduce-scattered into this rank's token shard.
template <class L, class HV, class FV, class LV, class DV, class DFV>
void head_backward(const LayerContext& ctx, L& head, const HV& hf, const FV& hf_full, const LV& logits, const DV& dhf,
                   const DFV& dhf_full) {
  if (ctx.tp.sp()) {
    head.backward(hf_full, logits, dhf_full, false);
    tp_reduce_scatter(ctx, dhf_full, dhf);
  } else {
    head.backward(hf, logits, dhf, false);
    if (ctx.tp.active()) tp_all_reduce(ctx, dhf);  // this rank's vocabulary columns' part
  }
}

/// Cross-entropy over logits split by vocabulary columns: the row maxima
/// (into `max`, [tokens]) and then the sums of exponentials and the target
/// logits (into `sums`, [tokens, 2]) are all-reduced over TP (2 collectives,
/// 3 values per token); the logits are never gathered. Returns the sum of the
/// token losses; with `backward` the logits then hold grad_scale times their
/// gradient.
template <class T, class LV, class TV, class MV, class SV>
double vocab_parallel_loss(const LayerContext& ctx, const LV& logits, const TV& targets, std::size_t vocab, const MV& max,
                           const SV& sums, T grad_scale, bool backward) {
  const std::size_t first = ctx.tp.rank() * logits.extent(1);
  ops::vocab_parallel_max(logits, max);
  tp_all_reduce(ctx, max, ReduceOp::max);
  ops::vocab_parallel_sums(logits, targets, first, vocab, max, sums);
  tp_all_reduce(ctx, sums);
  return ops::vocab_parallel_finish(logits, targets, first, max, sums, grad_scale, backward);
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
  void finish(const LayerContext& ctx) {
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
