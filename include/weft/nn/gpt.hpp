// nn::GPT: token (+ position) embedding, L pre-norm blocks, final norm, untied
// LM head without bias, fused softmax cross-entropy. The single-process
// reference every parallel strategy must reproduce, with explicit
// forward/backward and memory attributed by category.
//
// nn::GPT<T, S> is the model a weft::Strategy S selects. Its code depends
// only on the strategy's layer policy (weft::layer_policy_t<S>): with
// TensorParallel<> it is the same model split over the TP ranks -- heads, MLP
// hidden units and vocabulary are sharded, the loss is a vocabulary-parallel
// cross-entropy, and with tp = 1 every operation is the single-process one --
// and with TensorParallel<SequenceParallel> the residual stream's tokens are
// sharded too. Strategies that differ only in the DP mode or the schedule
// give the same type, nn::GPTModel<T, Space, LayerPolicy>.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/metrics/memory.hpp>
#include <weft/nn/block.hpp>
#include <weft/nn/embedding.hpp>
#include <weft/nn/sequence_attention.hpp>
#include <weft/ops/cross_entropy.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::nn {

namespace detail {
template <class P>
inline constexpr bool is_layer_policy_v = std::is_same_v<P, NoPolicy>;
template <class... O>
inline constexpr bool is_layer_policy_v<weft::TensorParallel<O...>> = true;

// The layer policy of nn::GPT<T, S, Space>'s S, with a sentence for an S that is not a strategy.
template <class S>
struct gpt_layer_policy {
  static_assert(is_strategy_v<S>,
                "weft::nn::GPT<T, S, Space>: S must be a weft::Strategy<...> (weft::SingleProcess for the "
                "single-process model). The execution space is the third argument: write "
                "nn::GPT<T, weft::SingleProcess, Space>, or nn::GPTModel<T, Space, LayerPolicy>");
  using type = NoPolicy;
  using precision = Precision<>;
};
template <class... E>
struct gpt_layer_policy<Strategy<E...>> {
  using type = layer_policy_t<Strategy<E...>>;
  using precision = typename Strategy<E...>::precision;
};
}  // namespace detail

/// The reference GPT, parameterised by what of a strategy changes its code:
/// LayerPolicy is weft::NoPolicy (the single-process model),
/// weft::TensorParallel<> or weft::TensorParallel<weft::SequenceParallel>;
/// Prec is the strategy's weft::Precision, whose Param sets the operand type
/// of every weight product (LayerContext::products; T must then be float: the
/// weights, activations and gradients stay fp32). A loss-scaled Prec
/// (weft::Precision<FP16, F32, DynamicLossScale>) trains through the
/// optim::train_step and parallel::train_step overloads that take a
/// weft::DynamicLossScaler; the others refuse it at compile time.
/// Usually named through nn::GPT<T, Strategy, Space>.
template <class T, class Space = Kokkos::DefaultExecutionSpace, class LayerPolicy = NoPolicy, class Prec = Precision<>>
class GPTModel {
  static_assert(is_precision_v<Prec>,
                "weft::nn::GPTModel<T, Space, LayerPolicy, Prec>: Prec must be a weft::Precision<...> (the "
                "strategy's: typename S::precision)");
  static_assert(!Prec::mixed || std::is_same_v<T, float>,
                "weft::nn::GPTModel: a mixed weft::Precision (BF16 or FP16 products) needs T = float -- the "
                "weights, activations and gradients stay fp32 and only the products' operands are 2-byte");
  static_assert(detail::is_layer_policy_v<LayerPolicy>,
                "weft::nn::GPTModel<T, Space, LayerPolicy>: LayerPolicy must be weft::NoPolicy, "
                "weft::TensorParallel<> or weft::TensorParallel<weft::SequenceParallel> (weft::layer_policy_t of a "
                "strategy)");

 public:
  /// The layer policy (weft::layer_policy_t of the strategies that select this model).
  using layer_policy = LayerPolicy;
  /// The precision policy (the strategy's weft::Precision).
  using precision = Prec;
  /// Whether the layers are split over a TP axis.
  static constexpr bool tensor_parallel_v = !std::is_same_v<LayerPolicy, NoPolicy>;
  /// Whether the residual stream's tokens are sharded over TP too.
  static constexpr bool sequence_parallel_v = [] {
    if constexpr (tensor_parallel_v) return LayerPolicy::sequence_parallel;
    else return false;
  }();
  /// What of a strategy's in-layer policies the model takes (weft::ModelPolicies):
  /// sequence parallelism when its layer policy says so; context parallelism
  /// (given at construction as a ContextParallel) and experts (MoE blocks,
  /// given as an expert split) always.
  static constexpr ModelPolicies policies{.sequence_parallel = sequence_parallel_v, .context = true, .experts = true};

  /// Builds and initialises the single-process model for config.batch
  /// sequences of config.seq tokens per forward pass. Throws ConfigError for
  /// an invalid config.
  explicit GPTModel(const GPTConfig& c)
    requires(!tensor_parallel_v)
      : GPTModel(c, TensorSplit{}, {}, 0) {}

  /// The model split over the TP communicator `tp` (this rank holds shard
  /// tp.rank() of every split layer). Throws ConfigError for an invalid
  /// config, one that does not divide over tp, or sequence parallelism on a
  /// single TP rank.
  GPTModel(const GPTConfig& c, Comm& tp)
    requires(tensor_parallel_v)
      : GPTModel(c, TensorSplit{&tp, sequence_parallel_v}, {}, 0) {}

  /// The model on `mesh`: split over mesh.axis<TP>() when the layer policy
  /// is tensor-parallel (the mesh must have a TP axis); otherwise a TP axis
  /// of the mesh, if any, must have extent 1. The other axes are the
  /// business of what wraps the model (DataParallel, the pipeline).
  template <class MeshT>
    requires requires { MeshT::template has_axis<TP>; }
  GPTModel(MeshT& mesh, const GPTConfig& c) : GPTModel(c, tensor_parallel_of(mesh), {}, 0) {}

  /// The model on `mesh` with context parallelism `cp` (from the strategy's
  /// CP policy: weft::context::attention_of<Context<Variant>, T>(mesh.axis<CP>())):
  /// every sequence of c.seq tokens is split over the CP ranks in the
  /// balanced layout. forward_backward and loss still take whole sequences
  /// (the same ids and targets on every CP rank): each rank picks its own
  /// tokens, positions come from their global index, and the loss is the
  /// mean over the whole sequences (summed over CP with its token count).
  /// Parameter gradients are this rank's part: sum them over DP x CP
  /// (DataParallel over mesh.axes<DP, CP>()). Throws ConfigError for a
  /// sequence that does not split into 2·cp chunks, and for AllToAll heads
  /// (per TP rank) that do not shard over cp, naming the sizes that work.
  template <class MeshT>
    requires requires { MeshT::template has_axis<TP>; }
  GPTModel(MeshT& mesh, const GPTConfig& c, ContextParallel<T, Space> cp)
      : GPTModel(c, tensor_parallel_of(mesh), std::move(cp), 0) {}

  /// The model on `mesh` with the mixture-of-experts blocks' routing over
  /// the ranks of `ep` (from nn::expert_split_of<Strategy>(mesh, c)): under
  /// Experts<N> each EP rank holds N / ep experts of every MoE block and
  /// tokens travel to them by all_to_allv; capacity, drops, the balancing
  /// losses and the statistics are those of the whole microbatch over
  /// ep.data (DP x EP). forward_backward takes this rank's microbatch (rank d
  /// of ep.data holds its sequences d of the whole). The gradients of this
  /// rank's experts are summed over DP, all others over DP x EP
  /// (parallel::ExpertDataParallel). Throws ConfigError for a dense config
  /// under ep > 1 and for experts that do not divide by ep.
  template <class MeshT>
    requires requires { MeshT::template has_axis<TP>; }
  GPTModel(MeshT& mesh, const GPTConfig& c, ExpertSplit ep)
      : GPTModel(c, tensor_parallel_of(mesh), {}, 0, ep) {}

  /// Both: context parallelism `cp` and the mixture-of-experts routing split
  /// `ep` (nn::expert_split_of<Strategy>(mesh, c) on a mesh with a CP axis
  /// counts the CP ranks among ep.data, each routing its share of every
  /// sequence). forward_backward takes whole sequences, as with cp alone;
  /// sum the routed experts' gradients over DP x CP and all others over DP x
  /// CP x EP (parallel::ExpertDataParallel over mesh.axes<DP, CP, EP>() and
  /// mesh.axes<DP, CP>()).
  template <class MeshT>
    requires requires { MeshT::template has_axis<TP>; }
  GPTModel(MeshT& mesh, const GPTConfig& c, ContextParallel<T, Space> cp, ExpertSplit ep)
      : GPTModel(c, tensor_parallel_of(mesh), std::move(cp), 0, ep) {}

 private:
  // Every public constructor ends here, with the run-time descriptors the layers share.
  GPTModel(const GPTConfig& c, TensorSplit tp, ContextParallel<T, Space> cp, int, ExpertSplit ep = {})
      : global_(c), cp_(std::move(cp)), cfg_(checked(c, tp, cp_, ep)),
        ctx_(std::make_shared<LayerContext>(
            LayerContext{nullptr, tp, ContextSplit{cp_.size() > 1 ? cp_.comm : nullptr}, nullptr, ep,
                    product_precision_v<Prec>, nullptr})),
        emb_(ctx_, cfg_),
        ln_f_(ctx_, "ln_f", cfg_.norm, cfg_.d_model, cfg_.norm_eps),
        head_(ctx_, "lm_head", cfg_.d_model, cfg_.vocab, false, cfg_.seed, cfg_.init_std,
              LinearSplit::column(tp.size(), tp.rank())),
        rows_(Block<T, Space>::rows(cfg_, tp)),
        hf_("ln_f.out", rows_, cfg_.d_model),
        sf_("ln_f", rows_),
        logits_("lm_head.logits", cfg_.tokens(), cfg_.vocab / tp.size()),
        dhf_("ln_f.dout", rows_, cfg_.d_model),
        ws_(std::make_shared<typename Block<T, Space>::Workspace>(cfg_, tp)) {
    // The residual stream: every block's input and the final norm's, kept for
    // backward. Under 2-byte products without recompute two float buffers
    // take turns (block l reads buffer l % 2 and writes the other) and each
    // block's input is kept as a 2-byte copy, written back before its
    // backward; the final norm's input stays in its buffer.
    narrow_ = !cfg_.recompute && ctx_->products != ProductPrecision::f32;
    for (std::size_t l = 0; l <= cfg_.layers; ++l) {
      if (narrow_ && l >= 2) xs_.push_back(xs_[l % 2]);
      else xs_.emplace_back("residual." + std::to_string(l), rows_, cfg_.d_model);
    }
    if (narrow_) {
      for (std::size_t l = 0; l < cfg_.layers; ++l) {
        x_stash_.emplace_back(ctx_->products);
        x_stash_.back().keep(xs_[l], true, "residual." + std::to_string(l));
      }
      // The last block's input buffer is free once the forward has passed it:
      // the final norm writes its output there, which the head's backward
      // reads before block L - 1's backward writes its input back.
      hf_ = xs_[(cfg_.layers + 1) % 2];
    }
    for (int i = 0; i < 2; ++i) dxs_.emplace_back("residual.grad." + std::to_string(i), rows_, cfg_.d_model);
    if (tp.sp()) {
      hf_full_ = ops::Matrix<T, Space>("ln_f.out.gathered", cfg_.tokens(), cfg_.d_model);
      dhf_full_ = ops::Matrix<T, Space>("ln_f.dout.partial", cfg_.tokens(), cfg_.d_model);
    }
    if (tp.active()) {
      ce_max_ = ops::Vector<T, Space>("cross_entropy.max", cfg_.tokens());
      ce_sums_ = ops::Matrix<T, Space>("cross_entropy.sums", cfg_.tokens(), 2);
    } else if (cfg_.moe_blocks() > 0) {
      token_loss_ = Kokkos::View<double*, Space>("cross_entropy.token_loss", cfg_.tokens());
    }
    std::shared_ptr<typename Block<T, Space>::Saved> shared;
    if (cfg_.recompute) shared = std::make_shared<typename Block<T, Space>::Saved>("blocks.shared", cfg_, tp);
    // Under 2-byte products without recompute, the dense blocks compute
    // their saved tensors in one float working set and each keeps a 2-byte
    // copy of them from its forward to its backward (Block::Saved's stash).
    if (narrow_ && cfg_.moe_blocks() < cfg_.layers) {
      std::size_t dense = 0;
      while (cfg_.moe_block(dense)) ++dense;
      working_ = std::make_shared<typename Block<T, Space>::Saved>("blocks.working", cfg_, tp, dense);
    }
    auto saved_of = [&](std::size_t l) -> std::shared_ptr<typename Block<T, Space>::Saved> {
      const std::string n = "blocks." + std::to_string(l);
      if (shared) return shared;
      if (working_ && !cfg_.moe_block(l))
        return std::make_shared<typename Block<T, Space>::Saved>(n, *working_, ctx_->products);
      return std::make_shared<typename Block<T, Space>::Saved>(n, cfg_, tp, l);
    };
    blocks_.reserve(cfg_.layers);
    for (std::size_t l = 0; l < cfg_.layers; ++l)
      blocks_.emplace_back(ctx_, l, cfg_, saved_of(l), ws_, ctx_->cp.active() ? &cp_ : nullptr);
    if (ctx_->cp.active()) {
      ids_ = ops::Tokens<Space>("context.ids", cfg_.tokens());
      targets_ = ops::Tokens<Space>("context.targets", cfg_.tokens());
    }
    if (tp.sp()) {
      std::vector<Parameter<T, Space>*> partial;
      emb_.collect_sequence_partial(partial);
      ln_f_.collect(partial);
      root_partial_ = std::make_unique<detail::PartialGrads<T, Space>>(partial);
    }
  }

 public:
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;

  /// Forward, loss and backward for one microbatch: ids and targets are
  /// [batch * seq] token ids of whole sequences. Returns the mean loss over
  /// its tokens; parameter gradients accumulate grad_scale * d(sum of token
  /// losses) (default 1/tokens: the gradient of the mean). Under context
  /// parallelism each rank takes its tokens of ids and targets, and its
  /// gradients are its tokens' part (they sum over CP to the whole).
  template <class IV, class TV>
  double forward_backward(const IV& ids_in, const TV& targets_in, double grad_scale = 0) {
    if (grad_scale == 0) grad_scale = 1.0 / double(global_.tokens());
    detail_check_ids(ids_in);
    if (ctx_->cp.active()) {
      select_local(ids_in, ids_);
      select_local(targets_in, targets_);
      return forward_backward_local(ids_, targets_, grad_scale);
    }
    return forward_backward_local(ids_in, targets_in, grad_scale);
  }

 private:
  template <class IV, class TV>
  double forward_backward_local(const IV& ids, const TV& targets, double grad_scale) {
    forward_hidden(ids);
    double sum = 0;
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "cross_entropy");
      if constexpr (tensor_parallel_v)
        sum = ctx_->tp.active() ? vocab_parallel_loss(targets, T(grad_scale), true)
                                : ops::cross_entropy_forward_backward(logits_, targets, T(grad_scale), token_loss_);
      else
        sum = ops::cross_entropy_forward_backward(logits_, targets, T(grad_scale), token_loss_);
    }
    record_route_losses();
    const std::size_t L = cfg_.layers;
    // The MoE blocks' auxiliary losses enter the gradient with the weight of the mean token loss.
    for (auto& b : blocks_)
      if (auto* m = b.moe())
        m->set_loss_weight(grad_scale * double(global_.tokens()) *
                           double(ctx_->ep.data_size() / ctx_->ep.token_shards));
    if (hooks_) hooks_->before_backward(L);
    if (root_partial_) root_partial_->begin();
    detail::head_backward(*ctx_, head_, hf_, hf_full_, logits_, dhf_, dhf_full_);
    ln_f_.backward(dhf_, xs_[L], sf_, dxs_[L % 2], false);
    for (std::size_t l = L; l-- > 0;) {
      if (hooks_) hooks_->before_backward(l);
      if (narrow_) {
        metrics::Profiler::Scope sc(ctx_->profiler, "stash");
        x_stash_[l].load();
      }
      blocks_[l].backward(xs_[l], dxs_[(l + 1) % 2], dxs_[l % 2]);
      if (hooks_) hooks_->after_backward(l);
    }
    emb_.backward(ids, dxs_[0]);
    if (root_partial_) root_partial_->finish(*ctx_);
    if (hooks_) hooks_->after_backward(L);
    return sequence_sum(sum) / double(global_.tokens());
  }

 public:
  /// Mean loss of a microbatch of whole sequences without touching gradients (evaluation).
  template <class IV, class TV>
  double loss(const IV& ids_in, const TV& targets_in) {
    detail_check_ids(ids_in);
    if (ctx_->cp.active()) {
      select_local(ids_in, ids_);
      select_local(targets_in, targets_);
      return loss_local(ids_, targets_);
    }
    return loss_local(ids_in, targets_in);
  }

  /// The context-parallel axis (inactive: whole sequences on every rank).
  const ContextSplit& context_parallel() const { return ctx_->cp; }
  /// The expert-parallel split of the MoE blocks (inactive: one process's routing).
  const ExpertSplit& expert_split() const { return ctx_->ep; }

  /// Sets every gradient to zero (before a step's first microbatch).
  void zero_grad() {
    for (auto* p : parameters()) Kokkos::deep_copy(p->grad, T(0));
  }

  /// All parameters, in a fixed order (embedding, blocks, final norm, head).
  std::vector<Parameter<T, Space>*> parameters() {
    std::vector<Parameter<T, Space>*> out;
    emb_.collect(out);
    for (auto& b : blocks_) b.collect(out);
    ln_f_.collect(out);
    head_.collect(out);
    return out;
  }

  /// Parameters by group, for strategies that work group by group: group l <
  /// layers is block l, group `layers` the root (embeddings, final norm, head).
  std::vector<std::vector<Parameter<T, Space>*>> parameter_groups() {
    std::vector<std::vector<Parameter<T, Space>*>> g(cfg_.layers + 1);
    for (std::size_t l = 0; l < cfg_.layers; ++l) blocks_[l].collect(g[l]);
    emb_.collect(g[cfg_.layers]);
    ln_f_.collect(g[cfg_.layers]);
    head_.collect(g[cfg_.layers]);
    return g;
  }

  /// The MoE blocks' auxiliary losses of the last forward pass (load
  /// balancing plus z-loss, with their coefficients, summed over the MoE
  /// blocks); 0 for a dense model. forward_backward's gradients are those
  /// of its returned loss plus this sum (with the default grad_scale).
  double moe_loss() {
    double a = 0;
    for (auto& b : blocks_)
      if (auto* m = b.moe()) a += m->last_aux_loss() + m->last_z_loss();
    return a;
  }

  /// The MoE blocks' routing statistics since the last reset, merged over
  /// the blocks (empty for a dense model).
  MoEStats moe_statistics() {
    MoEStats s;
    for (auto& b : blocks_)
      if (auto* m = b.moe()) s.merge(m->statistics());
    return s;
  }
  /// Clears every MoE block's statistics (at the start of a step).
  void reset_moe_statistics() {
    for (auto& b : blocks_)
      if (auto* m = b.moe()) m->reset_statistics();
  }
  /// The aux-loss-free balancing step: every MoE block moves its selection
  /// bias by config().bias_balance from the slots counted since the last
  /// call (MoE::update_bias). Call it after each optimizer step.
  void update_expert_bias() {
    for (auto& b : blocks_)
      if (auto* m = b.moe()) m->update_bias(global_.bias_balance);
  }
  /// The MoE layer of block l (null when block l is dense).
  MoE<T, Space>* moe_layer(std::size_t l) { return blocks_.at(l).moe(); }
  /// The routing saved by block l's last forward (block l must be a MoE
  /// block; under recompute the blocks share one set, which holds the last
  /// block that ran). Not const: a benchmark may replay its exchange
  /// (MoE::replay_exchange).
  typename MoE<T, Space>::Saved& moe_saved(std::size_t l) { return last_moe_saved(blocks_.at(l)); }

  /// Installs hooks called around each group's forward and backward (null removes them).
  void set_hooks(GroupHooks* h) { hooks_ = h; }

  /// Total number of parameter elements.
  std::size_t num_parameters() {
    std::size_t n = 0;
    for (auto* p : parameters()) n += p->size();
    return n;
  }

  /// Bytes of parameters, gradients, activations (residual stream, each
  /// block's saved tensors -- once when shared --, final norm, logits) and
  /// buffers (backward scratch shared by all blocks).
  metrics::MemoryLedger memory() {
    metrics::MemoryLedger m;
    for (auto* p : parameters()) detail::account(m, *p);
    using C = metrics::MemoryCategory;
    if (narrow_) {
      // Each block's input as its 2-byte copy, the final norm's input in
      // float; the other float buffer holds the final norm's output (ln_f below).
      for (std::size_t l = 0; l < x_stash_.size(); ++l)
        m.add(C::activations, "residual." + std::to_string(l), x_stash_[l].bytes());
      m.add(C::activations, "residual." + std::to_string(cfg_.layers), detail::bytes_of(xs_[cfg_.layers]));
    } else {
      for (const auto& x : xs_) m.add(C::activations, x.label(), detail::bytes_of(x));
    }
    const void* last = nullptr;
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      const auto* s = blocks_[l].saved().get();
      if (s == last) continue;  // shared under recompute
      m.add(C::activations, cfg_.recompute ? "blocks.shared" : "blocks." + std::to_string(l), s->bytes());
      last = s;
    }
    std::size_t context = 0;
    for (const auto& b : blocks_) context += b.context_bytes();
    if (context) m.add(C::activations, "context attention", context);
    std::size_t context_buffers = 0;  // blocks run one after another: the largest, not the sum
    for (const auto& b : blocks_) context_buffers = std::max(context_buffers, b.context_buffer_bytes());
    if (context_buffers) m.add(C::buffers, "context attention buffers", context_buffers);
    m.add(C::activations, "ln_f", detail::bytes_of(hf_) + sf_.bytes() + detail::bytes_of(hf_full_));
    m.add(C::activations, "lm_head.logits", detail::bytes_of(logits_));
    m.add(C::buffers, "block backward workspace", ws_->bytes());
    // 2-byte stashes: the float set the dense blocks compute in, one block at a time.
    if (working_) m.add(C::buffers, "block activations working set", working_->bytes());
    // 2-byte products (a mixed Precision): their operands' staging, once a product has grown it.
    if (ctx_->staging) m.add(C::buffers, "product staging", ctx_->staging->bytes());
    m.add(C::buffers, "residual gradients",
          detail::bytes_of(dxs_[0]) * 2 + detail::bytes_of(dhf_) + detail::bytes_of(dhf_full_));
    if (ctx_->tp.active())
      m.add(C::buffers, "tensor-parallel buffers",
            emb_.buffer_bytes() + detail::bytes_of(ce_max_) + detail::bytes_of(ce_sums_));
    if (token_loss_.extent(0)) m.add(C::buffers, "per-token losses (MoE route quality)", token_loss_.extent(0) * sizeof(double));
    return m;
  }

  /// Attaches a profiler (null detaches): kernel scopes then fence and time.
  void set_profiler(metrics::Profiler* p) { ctx_->profiler = p; }
  /// Block l (its layers and, through saved(), the tensors its last forward
  /// kept: under a 2-byte Precision without recompute, views of the float
  /// working set every dense block shares, which hold block l's tensors only
  /// between its forward and the next block's, or after its backward loaded
  /// its stash).
  const Block<T, Space>& block(std::size_t l) const { return blocks_.at(l); }
  /// Residual-stream tensor l (block l's input; l = layers: the final
  /// norm's input) as the model holds it now. Under a 2-byte Precision
  /// without recompute the block inputs take turns in two float buffers, so
  /// residual(l) holds block l's input only until block l + 1 runs, and
  /// again after block l's backward has written its 2-byte copy back.
  const ops::Matrix<T, Space>& residual(std::size_t l) const { return xs_.at(l); }
  /// The configuration (whole sequences, as the model was built from).
  const GPTConfig& config() const { return global_; }
  /// The tensor-parallel split (inactive: the single-process model).
  const TensorSplit& tensor_parallel() const { return ctx_->tp; }
  /// Logits of the last forward pass ([tokens, V], or this rank's [tokens,
  /// V / tp] vocabulary columns; this rank's tokens under context
  /// parallelism); after forward_backward they hold the loss gradient instead.
  const ops::Matrix<T, Space>& logits() const { return logits_; }

 private:
  template <class IV, class TV>
  double loss_local(const IV& ids, const TV& targets) {
    forward_hidden(ids);
    metrics::Profiler::Scope sc(ctx_->profiler, "cross_entropy");
    double sum = 0;
    if constexpr (tensor_parallel_v)
      if (ctx_->tp.active()) return sequence_sum(vocab_parallel_loss(targets, T(0), false)) / double(global_.tokens());
    sum = ops::cross_entropy_forward(logits_, targets);
    return sequence_sum(sum) / double(global_.tokens());
  }

  static typename MoE<T, Space>::Saved& last_moe_saved(Block<T, Space>& b) { return *b.saved()->moe; }

  // The loss sum of whole sequences: this rank's tokens' sum, summed over CP.
  double sequence_sum(double local) const {
    if (!ctx_->cp.active()) return local;
    Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(&local, 1);
    ctx_->cp.comm->all_reduce(v);
    return local;
  }

  // This rank's tokens of every sequence of a [batch * seq] token array (the balanced layout).
  template <class FV>
  void select_local(const FV& full, const ops::Tokens<Space>& local) const {
    // A free function's kernel: nvcc refuses extended lambdas in private members.
    ops::select_balanced(full, ops::BalancedPositions{0, cfg_.seq, global_.seq, ctx_->cp.size(), ctx_->cp.rank()}, local);
  }

  template <class IV>
  void forward_hidden(const IV& ids) {
    const std::size_t L = cfg_.layers;
    if (hooks_) hooks_->before_forward(L);
    emb_.forward(ids, xs_[0]);
    for (std::size_t l = 0; l < L; ++l) {
      if (hooks_) hooks_->before_forward(l);
      if (narrow_) {
        metrics::Profiler::Scope sc(ctx_->profiler, "stash");
        x_stash_[l].store();
      }
      blocks_[l].forward(xs_[l], xs_[l + 1]);
      if (hooks_) hooks_->after_forward(l);
    }
    ln_f_.forward(xs_[L], hf_, sf_);
    detail::head_forward(*ctx_, head_, hf_, hf_full_, logits_);
    if (hooks_) hooks_->after_forward(L);
  }

  // Cross-entropy over logits split by vocabulary columns (detail::vocab_parallel_loss).
  template <class TV>
  double vocab_parallel_loss(const TV& targets, T grad_scale, bool backward) {
    return detail::vocab_parallel_loss(*ctx_, logits_, targets, cfg_.vocab, ce_max_, ce_sums_, grad_scale, backward);
  }

  // The MoE blocks' route quality (MoEStats::route_loss_sum): each token's
  // loss of this microbatch, attributed to the experts its kept slots went
  // to, summed over the routing's data ranks in one all_reduce for all
  // blocks. Under tensor parallelism the loss of row i is m_i + log s_i -
  // z_t,i from the reduced vocabulary-parallel sums, the same on every TP
  // rank; under sequence parallelism TP rank r's MoE rows are rows r n ..
  // (r + 1) n - 1 of them.
  void record_route_losses() {
    if (cfg_.moe_blocks() == 0) return;
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_route_loss");
    const std::size_t rows = cfg_.tokens();
    route_loss_host_.resize(rows);
    if (ctx_->tp.active()) {
      if (ce_max_host_.extent(0) != rows) {  // once: the step loop allocates nothing
        ce_max_host_ = Kokkos::create_mirror_view(ce_max_);
        ce_sums_host_ = Kokkos::create_mirror_view(ce_sums_);
      }
      Kokkos::deep_copy(ce_max_host_, ce_max_);
      Kokkos::deep_copy(ce_sums_host_, ce_sums_);
      for (std::size_t i = 0; i < rows; ++i)
        route_loss_host_[i] =
            double(ce_max_host_(i)) + std::log(double(ce_sums_host_(i, 0))) - double(ce_sums_host_(i, 1));
    } else {
      Kokkos::deep_copy(Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
                            route_loss_host_.data(), rows),
                        token_loss_);
    }
    const std::size_t shards = ctx_->tp.sp() ? ctx_->tp.size() : 1, n = rows / shards;
    const double* mine = route_loss_host_.data() + (ctx_->tp.sp() ? ctx_->tp.rank() : 0) * n;
    route_loss_sums_.clear();
    for (auto& b : blocks_)
      if (auto* moe = b.moe()) moe->route_loss_sums(mine, n, route_loss_sums_);
    if (ctx_->ep.global())
      ctx_->ep.data->all_reduce(Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
          route_loss_sums_.data(), route_loss_sums_.size()));
    std::size_t at = 0;
    for (auto& b : blocks_)
      if (auto* moe = b.moe()) {
        moe->record_route_losses(route_loss_sums_.data() + at);
        at += 2 * cfg_.experts;
      }
  }

  // The TP descriptor of a mesh, with the checks of weft::check_strategy_mesh (at compile time) for the layer policy.
  template <class MeshT>
  static TensorSplit tensor_parallel_of(MeshT& mesh) {
    if constexpr (tensor_parallel_v) {
      static_assert(check_strategy_mesh<Strategy<On<TP, LayerPolicy>>, MeshT>());
      return TensorSplit{&mesh.template axis<TP>(), sequence_parallel_v};
    } else {
      if constexpr (MeshT::template has_axis<TP>)
        WEFT_REQUIRE(mesh.template extent<TP>() == 1, ConfigError, "nn::GPT: the mesh's tp axis has extent ",
                     mesh.template extent<TP>(),
                     " but the strategy gives it no policy, so the model is not split; add On<TP, "
                     "TensorParallel<...>> to the strategy or set tp=1");
      return TensorSplit{};
    }
  }

  static GPTConfig checked(const GPTConfig& c, const TensorSplit& tp, const ContextParallel<T, Space>& cp,
                           const ExpertSplit& ep) {
    c.validate();
    WEFT_REQUIRE(!ep.active() || c.moe_blocks() > 0, ConfigError, "nn::GPT: expert parallelism over ", ep.ep_size(),
                 " EP ranks needs mixture-of-experts blocks; set GPTConfig::experts (--experts) or ep=1");
    if (cp.size() > 1) {
      WEFT_REQUIRE(cp.make && c.seq_shards == 1, ConfigError,
                   "nn::GPT: context parallelism needs a ContextParallel from weft::context::attention_of and a "
                   "config of whole sequences");
      context::check_sequence(c.seq, cp.size(), "the sequence length (--seq)");
      check_context_precision<T, Prec>(cp, "nn::GPT");
    }
    // weft::validate_strategy's text; heads (and every other split size) are
    // checked by validate_tensor_parallel, which names the valid TP sizes.
    if constexpr (sequence_parallel_v)
      WEFT_REQUIRE(tp.size() > 1, ConfigError, weft::detail::sp_needs_tp_text, " (tp is ", tp.size(), ")");
    const GPTConfig local = cp.size() > 1 ? c.local_sequence(cp.size()) : c;
    local.validate_tensor_parallel(tp.size(), tp.sequence_parallel);
    return local;
  }
  template <class IV>
  void detail_check_ids(const IV& ids) const {
    WEFT_REQUIRE(ids.extent(0) == global_.tokens(), ShapeError, "nn::GPT: got ", ids.extent(0),
                 " token ids, but the model is built for batch ", global_.batch, " x seq ", global_.seq, " = ",
                 global_.tokens());
  }

  GPTConfig global_;             // whole sequences, as given
  ContextParallel<T, Space> cp_;  // the CP axis and its attention (empty: none)
  GPTConfig cfg_;                // this rank's share of every sequence (= global_ without CP)
  ContextPtr ctx_;
  Embedding<T, Space> emb_;
  std::vector<Block<T, Space>> blocks_;
  Norm<T, Space> ln_f_;
  Linear<T, Space> head_;
  std::size_t rows_;  // token rows of the residual stream on this rank
  std::vector<ops::Matrix<T, Space>> xs_, dxs_;
  // 2-byte products without recompute: the block inputs are kept as 2-byte
  // copies (x_stash_[l] of xs_[l]) and the dense blocks' saved tensors too.
  bool narrow_ = false;
  std::vector<ActivationStash<T, Space>> x_stash_;
  ops::Matrix<T, Space> hf_;
  typename Norm<T, Space>::Saved sf_;
  ops::Matrix<T, Space> logits_, dhf_;
  ops::Matrix<T, Space> hf_full_, dhf_full_;  // sequence parallelism: gathered final-norm output, partial gradient
  ops::Vector<T, Space> ce_max_;              // tensor parallelism: per-token maximum logit
  ops::Matrix<T, Space> ce_sums_;             // tensor parallelism: per-token sum of exp and target logit
  Kokkos::View<double*, Space> token_loss_;   // a MoE model without TP: each token's loss (route quality)
  std::vector<double> route_loss_host_, route_loss_sums_;  // record_route_losses' host buffers
  typename ops::Vector<T, Space>::HostMirror ce_max_host_;  // record_route_losses under TP
  typename ops::Matrix<T, Space>::HostMirror ce_sums_host_;
  std::shared_ptr<typename Block<T, Space>::Workspace> ws_;
  // 2-byte products without recompute: the float tensors every dense block's
  // stash aliases (null otherwise).
  std::shared_ptr<typename Block<T, Space>::Saved> working_;
  std::unique_ptr<detail::PartialGrads<T, Space>> root_partial_;  // sequence parallelism: ln_f, positions
  GroupHooks* hooks_ = nullptr;
  ops::Tokens<Space> ids_, targets_;  // context parallelism: this rank's tokens of the microbatch
};

/// The GPT a strategy selects: nn::GPTModel of its layer policy, so that
/// strategies differing only in the DP mode or the schedule share one type.
///
///   weft::nn::GPT<float> single(cfg);                              // weft::SingleProcess
///   using S = weft::Strategy<weft::On<weft::DP, weft::FullyShard>,
///                            weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>;
///   weft::nn::GPT<float, S> split(mesh, cfg);                      // split over mesh.axis<weft::TP>()
template <class T, class S = SingleProcess, class Space = Kokkos::DefaultExecutionSpace>
using GPT = GPTModel<T, Space, typename detail::gpt_layer_policy<S>::type, typename detail::gpt_layer_policy<S>::precision>;

}  // namespace weft::nn
