// What a user's own layers must offer for weft's strategies to run them: a
// block of the residual stream (forward, backward, its parameters, the
// memory it saves per microbatch, and optionally a backward split into its
// input and weight halves), the input layer that turns a microbatch of data
// into the residual stream, the loss layer at the end, and the model that
// builds them. pipeline::LayerStage runs any model that meets LayeredModel
// under every schedule, DataParallel mode and gradient clipping.
#pragma once

#include <concepts>
#include <cstddef>
#include <memory>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/nn/parameter.hpp>
#include <weft/ops/common.hpp>

namespace weft::nn {

/// The residual-stream matrix of a layer L: [rows, width] on L's execution space.
template <class L>
using layer_matrix_t = ops::Matrix<typename L::value_type, typename L::execution_space>;

/// A block: maps the residual stream x [rows, width] to y [rows, width].
///   - `Saved` holds what one microbatch's forward keeps for its backward;
///     `make_saved(rows)` allocates one (the stage keeps one per in-flight
///     microbatch) and `saved_bytes(s)` says how large it is (the memory ledger);
///   - `forward(x, y, s)` writes y and fills s;
///   - `backward(x, dy, dx, s)` writes dx and adds the parameter gradients;
///   - `collect(ps)` appends the block's parameters (a strategy may re-point
///     their value and grad views between calls: read them at every call).
/// A block is one parameter group of DataParallel (fully sharded modes gather
/// and free it as a unit).
template <class B>
concept Layer = requires(B& b, const B& cb, const layer_matrix_t<B>& x, const layer_matrix_t<B>& y,
                         typename B::Saved& s, const typename B::Saved& cs, std::size_t rows,
                         std::vector<Parameter<typename B::value_type, typename B::execution_space>*>& ps) {
  typename B::value_type;
  typename B::execution_space;
  typename B::Saved;
  { b.make_saved(rows) } -> std::same_as<typename B::Saved>;
  { cb.saved_bytes(cs) } -> std::convertible_to<std::size_t>;
  b.forward(x, y, s);
  b.backward(x, y, y, s);
  b.collect(ps);
};

/// A block whose backward splits into the input-gradient half and the
/// weight-gradient half (what zero-bubble schedules need):
/// `backward_input(x, dy, dx, s, work)` writes dx and queues the weight
/// gradients' work on `work` (nn::DeferredWork), which the stage runs later;
/// the queued work may read x and s, which stay unchanged until then.
template <class B>
concept SplitBackwardLayer = Layer<B> && requires(B& b, const layer_matrix_t<B>& x, typename B::Saved& s,
                                                  DeferredWork& w) {
  b.backward_input(x, x, x, s, w);
};

/// The first layer: a microbatch of data (Batch) into the residual stream.
/// `forward(batch, x0)`, `backward(batch, dx0)` (parameter gradients only), `collect(ps)`.
template <class I, class Batch>
concept InputLayer = requires(I& in, const Batch& batch, const layer_matrix_t<I>& x,
                              std::vector<Parameter<typename I::value_type, typename I::execution_space>*>& ps) {
  typename I::value_type;
  typename I::execution_space;
  in.forward(batch, x);
  in.backward(batch, x);
  in.collect(ps);
};

/// The last layer: the residual stream and the microbatch's targets into a
/// loss. `forward(x, batch, s, grad_scale)` returns the sum of the
/// microbatch's loss terms and keeps in s what backward needs;
/// `backward(x, s, dx)` writes dx = grad_scale * d(sum)/dx and adds
/// grad_scale times the parameter gradients.
template <class H, class Batch>
concept LossLayer = requires(H& h, const H& ch, const Batch& batch, const layer_matrix_t<H>& x, typename H::Saved& s,
                             const typename H::Saved& cs, double scale, std::size_t rows,
                             std::vector<Parameter<typename H::value_type, typename H::execution_space>*>& ps) {
  typename H::Saved;
  { h.make_saved(rows) } -> std::same_as<typename H::Saved>;
  { ch.saved_bytes(cs) } -> std::convertible_to<std::size_t>;
  { h.forward(x, batch, s, scale) } -> std::convertible_to<double>;
  h.backward(x, s, x);
  h.collect(ps);
};

/// A model of a user's layers: an input layer, `blocks()` blocks and a loss
/// layer over a residual stream of `rows()` x `width()` per microbatch on
/// this rank. Each microbatch is `microbatch_samples()` samples of
/// `loss_terms_per_sample()` loss terms each (the loss is their mean).
/// make_input / make_block(i) / make_head build the layers (each built once,
/// on the rank that holds it, initialised from the seed and global indices
/// so every mesh holds the same model); make_batch allocates one
/// microbatch's data. tp_comm() is the TP communicator when the blocks are
/// split over it (null otherwise), for the gradient norm.
template <class M>
concept LayeredModel = requires(M& m, const M& cm, std::size_t i) {
  typename M::value_type;
  typename M::execution_space;
  typename M::Input;
  typename M::Block;
  typename M::Head;
  typename M::Batch;
  requires Layer<typename M::Block>;
  requires InputLayer<typename M::Input, typename M::Batch>;
  requires LossLayer<typename M::Head, typename M::Batch>;
  { cm.blocks() } -> std::convertible_to<std::size_t>;
  { cm.rows() } -> std::convertible_to<std::size_t>;
  { cm.width() } -> std::convertible_to<std::size_t>;
  { cm.microbatch_samples() } -> std::convertible_to<std::size_t>;
  { cm.loss_terms_per_sample() } -> std::convertible_to<std::size_t>;
  { m.make_input() } -> std::same_as<std::unique_ptr<typename M::Input>>;
  { m.make_block(i) } -> std::same_as<std::unique_ptr<typename M::Block>>;
  { m.make_head() } -> std::same_as<std::unique_ptr<typename M::Head>>;
  { m.make_batch() } -> std::same_as<typename M::Batch>;
  { cm.tp_comm() } -> std::convertible_to<Comm*>;
};

/// A LayeredModel that runs under a Context<...> strategy: it declares
/// `static constexpr weft::ModelPolicies policies{.context = true}` and says
/// how its sequences are split, `context_parallel()` (an nn::ContextSplit over
/// the mesh's CP axis). Then:
///   - every CP rank of one DP rank is given the same samples (whole
///     sequences in its Batch); the input layer keeps this rank's tokens, in
///     the balanced layout (weft::context::global_index), and the blocks and
///     the head see rows() = samples x T / cp of them;
///   - loss_terms_per_sample() counts the terms of a whole sequence, and the
///     head returns the sum over this rank's terms only;
///   - attention-like layers exchange keys and values over the CP axis, e.g.
///     through weft::context::ContextAttention<Variant, T>(cp, heads,
///     kv_heads, T, head_dim, causal);
///   - parameter gradients are this rank's part: weft::parallel::DataParallelOf
///     sums them over DP x CP.
template <class M>
concept ContextLayeredModel = LayeredModel<M> && requires(const M& cm) {
  { cm.context_parallel() } -> std::convertible_to<const ContextSplit&>;
};

}  // namespace weft::nn
