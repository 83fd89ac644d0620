// The part of a GPT one pipeline rank runs: one chunk per virtual stage it
// holds (one, or V for interleaved schedules), each a run of consecutive units
// (embedding, blocks, head) built from the nn layers with the reference
// model's parameter names, so counter-based initialisation gives every
// parameter the value it has in the single-process nn::GPT. Activations are
// kept per in-flight microbatch (a slot), which is what lets a schedule run
// several microbatches' forwards before their backwards. With
// GPTConfig::recompute (activation checkpointing) a slot keeps only its
// residual stream, each block's input; the blocks of every chunk share one
// set of saved tensors, which backward refills by running each block's
// forward again from the slot's input, in every schedule.
//
// Given a tensor-parallel axis (nn::TensorSplit: the TP communicator of a
// DP x PP x TP mesh), a stage holds the TP-split layers instead: its blocks'
// heads and MLP hidden units, the embedding's and the head's vocabulary rows
// are this TP rank's share, the loss is the vocabulary-parallel
// cross-entropy, and with sequence parallelism the residual stream between
// stages is this rank's token shard. Parameter names and initial values are
// still the single-process model's (each shard holds the values the whole
// tensor has at its global indices).
#pragma once

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <weft/comm/request.hpp>
#include <weft/metrics/memory.hpp>
#include <weft/nn/block.hpp>
#include <weft/nn/embedding.hpp>
#include <weft/nn/sequence_attention.hpp>
#include <weft/nn/tp_comm.hpp>
#include <weft/ops/cross_entropy.hpp>
#include <weft/parallel/pipeline/partition.hpp>
#include <weft/parallel/pipeline/slots.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::pipeline {

/// The chunks of one pipeline rank of a GPT and the activations of its
/// in-flight microbatches. LayerPolicy is the strategy's layer_policy_t:
/// NoPolicy (layers not split), TensorParallel<> or
/// TensorParallel<SequenceParallel>. Prec is the strategy's weft::Precision:
/// Precision<> computes in fp32; Precision<BF16> runs the weight products
/// with bf16 operands and fp32 accumulation, as nn::GPT<T, S> does (the
/// parameters, gradients and optimizer state stay fp32; without recompute
/// the slots keep 2-byte copies of their saved activations, see
/// saves_2_byte_activations(); the executor sends the activations and input
/// gradients between stages as bf16, see wire_element_t);
/// Precision<FP16, F32, DynamicLossScale> runs them on
/// fp16 operands and trains through pipeline::train_step's overload with a
/// weft::DynamicLossScaler. Users name it through pipeline::Stage<T, S>.
template <class T, class Space, class LayerPolicy, class Prec = Precision<>>
class GPTStage {
  static_assert(std::is_same_v<LayerPolicy, NoPolicy> || weft::detail::is_tp_policy<LayerPolicy>::value,
                "pipeline::GPTStage<T, Space, LayerPolicy>: LayerPolicy must be weft::layer_policy_t<Strategy> "
                "(NoPolicy or TensorParallel<...>); write pipeline::Stage<T, Strategy>");
  static_assert(is_precision_v<Prec>,
                "pipeline::GPTStage<T, Space, LayerPolicy, Prec>: Prec must be a weft::Precision<...> (the "
                "strategy's); write pipeline::Stage<T, Strategy>");
  static_assert(!Prec::mixed || std::is_same_v<T, float>,
                "pipeline::GPTStage: a mixed weft::Precision (bf16 products) needs T = float -- the fp32 master "
                "parameters the products are rounded from");
  static_assert(!Prec::mixed || std::is_same_v<typename Prec::reduce, F32>,
                "weft::pipeline::Stage<T, S>: a 2-byte gradient reduction (weft::Precision<BF16, BF16>) is not "
                "implemented yet -- gradients are reduced in fp32; use weft::Precision<weft::BF16> (= "
                "Precision<BF16, F32>)");

 public:
  using Param = nn::Parameter<T, Space>;
  using Matrix = ops::Matrix<T, Space>;
  using BlockT = nn::Block<T, Space>;
  /// The precision policy (the strategy's weft::Precision).
  using precision = Prec;
  /// Whether the layers are split over TP, and the residual stream's tokens too.
  static constexpr bool tensor_parallel_v = !std::is_same_v<LayerPolicy, NoPolicy>;
  /// The GPT's blocks split their backward (zero-bubble schedules run on it).
  static constexpr bool splits_backward = true;
  static constexpr bool sequence_parallel_v = [] {
    if constexpr (tensor_parallel_v) return LayerPolicy::sequence_parallel;
    else return false;
  }();

  /// One virtual stage on this rank: units [first_unit, end_unit).
  struct Chunk {
    std::size_t virtual_stage = 0, first_unit = 0, end_unit = 0;
    std::unique_ptr<nn::Embedding<T, Space>> emb;  ///< when it holds unit 0
    std::vector<BlockT> blocks;                    ///< blocks first_block, first_block + 1, ...
    std::size_t first_block = 0;
    std::unique_ptr<nn::Norm<T, Space>> ln_f;      ///< with head, when it holds the last unit
    std::unique_ptr<nn::Linear<T, Space>> head;
    std::vector<std::size_t> block_group;          ///< parameter group of each block
  };

  /// Activations of one microbatch on one chunk, from its forward to the end
  /// of its backward (the weight-gradient half, for split backwards), and the
  /// requests of the messages that read or write them.
  struct Slot {
    std::vector<Matrix> xs;                      ///< residual stream: xs[0] the chunk input, xs.back() its output
    std::vector<typename BlockT::Saved> saved;   ///< each block's saved tensors (none under recompute)
    /// 2-byte saved activations (saves_2_byte_activations()): each block's
    /// input as a 2-byte copy (xs[1] ... xs[n-1] are then views of the
    /// stage's two shared float buffers; xs[0] and xs.back() stay the slot's).
    std::vector<nn::ActivationStash<T, Space>> x_stash;
    Matrix hf, logits;                           ///< head chunk: final norm output; logits, then their gradient
    Matrix hf_full;                              ///< head chunk, sequence parallelism: the gathered final norm output
    typename nn::Norm<T, Space>::Saved sf;
    Matrix dy, dx;                               ///< received output gradient; input gradient to send
    Request recv_activation, recv_gradient, send_activation, send_gradient;
    nn::DeferredWork deferred;                   ///< weight-gradient work of a split backward
  };

  /// The chunks of the pipeline rank of `mesh` (its PP coordinate, of the PP
  /// extent; with a TP policy the layers split over mesh.axis<TP>()): chunk c
  /// runs virtual stage c * pp + rank of `part`, which must have pp * chunks
  /// stages. cfg.batch is the microbatch. Collective over nothing.
  ///
  /// With `cp` (weft::context::attention_of of the strategy's CP policy) every
  /// sequence is split over the CP ranks as in nn::GPT: the stage still
  /// takes whole sequences in ids(i) and targets(i), each rank runs its
  /// tokens, and the activations between stages stay sequence-sharded.
  ///
  /// With mixture-of-experts blocks (cfg.experts > 0), `experts` is the
  /// routing split (nn::expert_split_of<Strategy>(mesh, cfg)): its data
  /// ranks (the DP axis, or DP x EP) share each microbatch, so that capacity
  /// and drops are decided over the whole microbatch, as in nn::GPT. With an
  /// EP axis of extent > 1 each stage's MoE blocks hold N / ep of the experts
  /// and exchange tokens over the stage's EP ranks (which run the same
  /// schedule, so their exchanges pair up); the stage's parameters then go
  /// to a parallel::ExpertDataParallel over DP x EP, DP and EP.
  template <class MeshT>
    requires requires(MeshT& m) { m.template extent<PP>(); }
  GPTStage(MeshT& mesh, const nn::GPTConfig& cfg, const StagePartition& part, int chunks = 1,
           nn::ContextParallel<T, Space> cp = {}, nn::ExpertSplit experts = {})
      : GPTStage(cfg, part, mesh.template extent<PP>(), mesh.template coord<PP>(), chunks,
                 nn::TensorSplit{tp_checked(tp_of(mesh)), sequence_parallel_v}, std::move(cp), experts, 0) {}

  /// The chunks of pipeline rank `rank` of `ranks`: chunk c runs virtual stage
  /// c * ranks + rank of `part`, which must have ranks * chunks stages.
  /// cfg.batch is the microbatch (sequences per forward). With a TP policy,
  /// `tp` is the TP axis of this rank (sequence parallel when the policy
  /// says so) and the layers are split over it; ConfigError when the model
  /// does not divide over tp (heads, key/value heads, d_model, MLP width,
  /// vocabulary; with sequence parallelism the tokens of a microbatch).
  GPTStage(const nn::GPTConfig& cfg, const StagePartition& part, int ranks, int rank, int chunks = 1, Comm* tp_comm = nullptr)
      : GPTStage(cfg, part, ranks, rank, chunks, nn::TensorSplit{tp_checked(tp_comm), sequence_parallel_v}, {},
                 nn::ExpertSplit{}, 0) {}

 private:
  template <class MeshT>
  static Comm* tp_of(MeshT& mesh) {
    // The strategy's TP policy against the mesh type, as nn::GPT checks it
    // (a TP axis in the mesh; sequence parallelism on a static extent of 1).
    if constexpr (tensor_parallel_v) {
      static_assert(check_strategy_mesh<Strategy<On<TP, LayerPolicy>>, MeshT>());
      return &mesh.template axis<TP>();
    } else {
      return nullptr;
    }
  }
  static Comm* tp_checked(Comm* c) {
    WEFT_REQUIRE(tensor_parallel_v || c == nullptr, ConfigError,
                 "pipeline::Stage: a TP communicator was given, but the strategy has no TensorParallel policy on TP; "
                 "add On<TP, TensorParallel<...>> to the strategy");
    if constexpr (sequence_parallel_v)
      WEFT_REQUIRE(c && c->size() > 1, ConfigError, weft::detail::sp_needs_tp_text, " (tp is ", c ? c->size() : 1, ")");
    return c;
  }
  GPTStage(const nn::GPTConfig& cfg, const StagePartition& part, int ranks, int rank, int chunks, nn::TensorSplit tp,
           nn::ContextParallel<T, Space> cp, nn::ExpertSplit experts, int)
      : global_(cfg), cp_(std::move(cp)), cfg_(checked(cfg, tp, cp_)),
        ctx_(std::make_shared<nn::LayerContext>(
            nn::LayerContext{nullptr, tp, nn::ContextSplit{cp_.size() > 1 ? cp_.comm : nullptr}, nullptr, experts,
                        nn::product_precision_v<Prec>, nullptr})),
        ranks_(ranks), rank_(rank), rows_(BlockT::rows(cfg_, tp)) {
    WEFT_REQUIRE(cfg.experts > 0 || !experts.global(), ConfigError,
                 "pipeline::Stage: a routing split was given for a model without mixture-of-experts blocks");
    WEFT_REQUIRE(ranks >= 1 && rank >= 0 && rank < ranks && chunks >= 1, ConfigError, "pipeline::Stage: rank ", rank,
                 " of ", ranks, " with ", chunks, " chunks; expected 0 <= rank < ranks and chunks >= 1");
    WEFT_REQUIRE(part.stages() == std::size_t(ranks) * std::size_t(chunks), ConfigError, "pipeline::Stage: the partition has ",
                 part.stages(), " stages, but ", ranks, " ranks x ", chunks, " chunks need ", ranks * chunks,
                 "; give --stages one block count per virtual stage");
    WEFT_REQUIRE(part.bounds.front() == 0 && part.bounds.back() == unit_count(cfg.layers), ConfigError,
                 "pipeline::Stage: the partition covers units ", part.bounds.front(), "..", part.bounds.back(),
                 " but the model has units 0..", unit_count(cfg.layers));
    ws_ = std::make_shared<typename BlockT::Workspace>(cfg_, tp);
    for (auto& g : g_) g = Matrix("pipeline.grad", rows_, cfg_.d_model);
    dhf_ = Matrix("pipeline.ln_f.dout", rows_, cfg_.d_model);
    if (tp.sp()) dhf_full_ = Matrix("pipeline.ln_f.dout.partial", cfg_.tokens(), cfg_.d_model);
    if (tp.active()) {
      ce_max_ = ops::Vector<T, Space>("pipeline.cross_entropy.max", cfg_.tokens());
      ce_sums_ = Matrix("pipeline.cross_entropy.sums", cfg_.tokens(), 2);
    }
    nn::GPTConfig empty = cfg_;
    empty.batch = 0;  // a block's own Saved only receives each slot's tensors
    // Recompute (activation checkpointing): a slot keeps only its chunk's
    // residual stream, and every block of every chunk on this rank writes
    // its saved tensors into one shared set, which backward refills by
    // running the block's forward again from its input.
    if (cfg_.recompute) shared_ = std::make_shared<typename BlockT::Saved>("pipeline.blocks.shared", cfg_, tp);
    // 2-byte products without recompute: as nn::GPT, each slot keeps 2-byte
    // copies of its blocks' inputs and dense blocks' saved tensors, which
    // the blocks compute in one float working set (the rank's, one block at
    // a time); the residual stream between a chunk's blocks runs through two
    // float buffers that take turns.
    narrow_ = !cfg_.recompute && ctx_->products != nn::ProductPrecision::f32;
    const std::size_t L = cfg_.layers;
    std::size_t groups = 0;
    chunks_.resize(std::size_t(chunks));
    for (int c = 0; c < chunks; ++c) {
      Chunk& k = chunks_[std::size_t(c)];
      k.virtual_stage = std::size_t(c) * std::size_t(ranks) + std::size_t(rank);
      k.first_unit = part.begin(k.virtual_stage);
      k.end_unit = part.end(k.virtual_stage);
      WEFT_REQUIRE(k.end_unit > k.first_unit, ConfigError, "pipeline::Stage: virtual stage ", k.virtual_stage,
                   " has no layers; every stage needs at least one");
      if (k.first_unit == 0) k.emb = std::make_unique<nn::Embedding<T, Space>>(ctx_, cfg_);
      k.first_block = std::max<std::size_t>(k.first_unit, 1) - 1;
      const std::size_t end_block = std::min(k.end_unit, L + 1) - 1;
      if (end_block > k.first_block) k.blocks.reserve(end_block - k.first_block);
      for (std::size_t b = k.first_block; b < end_block; ++b) {
        k.blocks.emplace_back(ctx_, b, cfg_,
                              shared_ ? shared_ : std::make_shared<typename BlockT::Saved>("pipeline.bound", empty, tp),
                              ws_, ctx_->cp.active() ? &cp_ : nullptr);
        k.block_group.push_back(groups++);
      }
      if (k.end_unit == L + 2) {
        k.ln_f = std::make_unique<nn::Norm<T, Space>>(ctx_, "ln_f", cfg_.norm, cfg_.d_model, cfg_.norm_eps);
        k.head = std::make_unique<nn::Linear<T, Space>>(ctx_, "lm_head", cfg_.d_model, cfg_.vocab, false, cfg_.seed,
                                                        cfg_.init_std, nn::LinearSplit::column(tp.size(), tp.rank()));
      }
    }
    if (narrow_) {
      std::size_t most = 0;
      for (const auto& k : chunks_) {
        most = std::max(most, k.blocks.size());
        for (std::size_t i = 0; i < k.blocks.size() && !working_; ++i)
          if (!cfg_.moe_block(k.first_block + i))
            working_ = std::make_shared<typename BlockT::Saved>("pipeline.blocks.working", cfg_, tp, k.first_block + i);
      }
      if (most >= 2)
        for (int i = 0; i < 2; ++i) residual_[i] = Matrix("pipeline.residual.working." + std::to_string(i), rows_, cfg_.d_model);
    }
    std::vector<Param*> root;
    collect_root(root);
    root_group_ = root.empty() ? no_group : groups;
    if (tp.sp()) {
      // Gradients a sequence-parallel rank computes from its token shard only:
      // the final norm's and the learned positions'.
      std::vector<Param*> ln, pos;
      for (auto& k : chunks_) {
        if (k.ln_f) k.ln_f->collect(ln);
        if (k.emb) k.emb->collect_sequence_partial(pos);
      }
      ln_f_partial_ = std::make_unique<nn::detail::PartialGrads<T, Space>>(ln);
      pos_partial_ = std::make_unique<nn::detail::PartialGrads<T, Space>>(pos);
    }
  }

 public:
  GPTStage(const GPTStage&) = delete;
  GPTStage& operator=(const GPTStage&) = delete;

  /// The model configuration (batch = the microbatch; whole sequences).
  const nn::GPTConfig& config() const { return global_; }
  /// The context-parallel axis (inactive: whole sequences on every rank).
  const nn::ContextSplit& context_parallel() const { return ctx_->cp; }
  /// Chunks on this rank, in chunk order.
  const std::vector<Chunk>& chunks() const { return chunks_; }
  /// Chunks on this rank, in chunk order (mutable: layers and their parameters).
  std::vector<Chunk>& chunks() { return chunks_; }
  /// Number of pipeline ranks.
  int ranks() const { return ranks_; }
  /// This rank's position in the pipeline.
  int rank() const { return rank_; }
  /// The tensor-parallel split of the layers (inactive: not split).
  const nn::TensorSplit& tensor_parallel() const { return ctx_->tp; }
  /// Token rows of the residual stream (and of each activation message):
  /// the microbatch's tokens, or tokens / tp under sequence parallelism.
  std::size_t rows() const { return rows_; }
  /// The model context its layers share (profiler, deferred weight gradients).
  nn::LayerContext& context() { return *ctx_; }
  /// Chunks on this rank.
  std::size_t num_chunks() const { return chunks_.size(); }
  /// The virtual stage chunk c runs.
  std::size_t virtual_stage(int c) const { return chunks_.at(std::size_t(c)).virtual_stage; }
  /// Sequences per microbatch.
  std::size_t microbatch_samples() const { return cfg_.batch; }
  /// Loss terms per sequence (its tokens): train_step scales gradients by 1 / (batch x this).
  std::size_t loss_terms_per_sample() const { return global_.seq; }
  /// The TP communicator when the layers are split (null otherwise).
  Comm* tp_comm() const { return ctx_->tp.active() ? ctx_->tp.comm : nullptr; }
  /// Allocates the token ids and targets of `n` microbatches (the executor
  /// calls it with its microbatch count).
  void reserve_microbatches(std::size_t n) {
    if (ids_.extent(0) >= n * global_.tokens()) return;
    ids_ = ops::Tokens<Space>("pipeline.ids", n * global_.tokens());
    targets_ = ops::Tokens<Space>("pipeline.targets", n * global_.tokens());
    if (ctx_->cp.active()) {
      local_ids_ = ops::Tokens<Space>("pipeline.context.ids", n * cfg_.tokens());
      local_targets_ = ops::Tokens<Space>("pipeline.context.targets", n * cfg_.tokens());
    }
  }
  /// Token ids of microbatch i ([tokens]); fill before the executor runs.
  auto ids(std::size_t i) const {
    return Kokkos::subview(ids_, std::make_pair(i * global_.tokens(), (i + 1) * global_.tokens()));
  }
  /// Targets of microbatch i ([tokens]).
  auto targets(std::size_t i) const {
    return Kokkos::subview(targets_, std::make_pair(i * global_.tokens(), (i + 1) * global_.tokens()));
  }
  /// Forward of microbatch `mb` (its ids and targets from ids(mb), targets(mb))
  /// on chunk c; the head chunk returns the mean token loss, others 0.
  double forward_microbatch(int mb, int c, double grad_scale) {
    if (ctx_->cp.active()) {  // this rank's tokens of the microbatch's sequences (the balanced layout)
      const Chunk& k = chunks_.at(std::size_t(c));
      if (k.emb) select_local(ids(std::size_t(mb)), local(local_ids_, std::size_t(mb)));
      if (k.head) select_local(targets(std::size_t(mb)), local(local_targets_, std::size_t(mb)));
      const double sum = forward(mb, c, local(local_ids_, std::size_t(mb)), local(local_targets_, std::size_t(mb)), grad_scale);
      return sum / double(cfg_.tokens());
    }
    const double sum = forward(mb, c, ids(std::size_t(mb)), targets(std::size_t(mb)), grad_scale);
    return sum / double(cfg_.tokens());
  }
  /// Backward of microbatch `mb` on chunk c (split: the input-gradient half only).
  void backward_microbatch(int mb, int c, bool split) {
    if (ctx_->cp.active()) backward(mb, c, local(local_ids_, std::size_t(mb)), split);
    else backward(mb, c, ids(std::size_t(mb)), split);
  }
  /// Whether virtual stage `vs` is the first one (its input is token ids).
  bool first_virtual_stage(std::size_t vs) const { return vs == 0; }
  /// Whether chunk c holds the head (computes the loss).
  bool has_head(int c) const { return chunks_.at(std::size_t(c)).head != nullptr; }
  /// Whether chunk c holds the embedding.
  bool has_embedding(int c) const { return chunks_.at(std::size_t(c)).emb != nullptr; }

  /// Parameters by group, for DataParallel: one group per block (chunk order),
  /// then, when this rank holds any, the root group (embedding, final norm, head).
  std::vector<std::vector<Param*>> parameter_groups() {
    std::vector<std::vector<Param*>> g;
    for (auto& k : chunks_)
      for (auto& b : k.blocks) {
        g.emplace_back();
        b.collect(g.back());
      }
    if (root_group_ != no_group) {
      g.emplace_back();
      collect_root(g.back());
    }
    return g;
  }
  /// Every parameter on this rank.
  std::vector<Param*> parameters() {
    std::vector<Param*> out;
    for (auto& g : parameter_groups())
      for (auto* p : g) out.push_back(p);
    return out;
  }
  /// Sets every gradient to zero.
  void zero_grad() {
    for (auto* p : parameters())
      if (p->grad.extent(0)) Kokkos::deep_copy(p->grad, T(0));
  }
  /// Installs hooks called around each group's forward and backward, as
  /// nn::GPT does (null removes them).
  void set_hooks(nn::GroupHooks* h) { hooks_ = h; }
  /// Attaches a profiler (null detaches).
  void set_profiler(metrics::Profiler* p) { ctx_->profiler = p; }
  /// When non-null, the forward and backward time of each unit (fenced) is
  /// added to (*acc)[unit] (measuring costs for --stages auto).
  void set_unit_timing(std::vector<double>* acc) { unit_time_ = acc; }
  /// Called between units during forward and backward (the pipeline executor
  /// tests its pending messages there, so that MPI moves them while this
  /// rank computes). Empty: nothing is called.
  void set_progress(std::function<void()> f) { progress_ = std::move(f); }

  /// The routing split of the MoE blocks (inactive: one process's routing).
  const nn::ExpertSplit& expert_split() const { return ctx_->ep; }
  /// The whole model's MoE statistics since the last reset, as
  /// nn::GPT::moe_statistics() gives them on one process: every pipeline
  /// rank's blocks, in block order (per-expert counts of block l at l's
  /// place). Collective over `pp`, the PP axis (every rank gets the result).
  nn::MoEStats moe_statistics_over(Comm& pp) {
    const std::size_t N = cfg_.experts, L = cfg_.layers;
    // Per block: N counts; then tokens, slots, dropped, entropy, aux, z,
    // passes, a2a bytes and seconds; a flag saying the block is a MoE block
    // held here.
    constexpr std::size_t F = 10;
    Kokkos::View<double*, Kokkos::HostSpace> buf("pipeline.moe_stats", L * (N + F));
    for (auto& k : chunks_)
      for (std::size_t i = 0; i < k.blocks.size(); ++i)
        if (auto* m = k.blocks[i].moe()) {
          const nn::MoEStats st = m->statistics();
          double* o = buf.data() + (k.first_block + i) * (N + F);
          for (std::size_t e = 0; e < N && e < st.selected.size(); ++e) o[e] = st.selected[e];
          const double f[F] = {st.tokens,    st.slots,         st.dropped,   st.entropy_sum,     st.aux_loss,
                               st.z_loss,    double(st.passes), st.a2a_bytes, st.a2a_seconds,    1.0};
          for (std::size_t j = 0; j < F; ++j) o[N + j] = f[j];
        }
    pp.all_reduce(buf, ReduceOp::sum);
    nn::MoEStats s;
    for (std::size_t l = 0; l < L; ++l) {
      const double* o = buf.data() + l * (N + F);
      if (o[N + F - 1] == 0) continue;  // a dense block
      nn::MoEStats b;
      b.selected.assign(o, o + N);
      b.tokens = o[N], b.slots = o[N + 1], b.dropped = o[N + 2], b.entropy_sum = o[N + 3];
      b.aux_loss = o[N + 4], b.z_loss = o[N + 5], b.passes = std::size_t(o[N + 6] + 0.5);
      b.a2a_bytes = o[N + 7], b.a2a_seconds = o[N + 8], b.layers = 1;
      s.merge(b);
    }
    return s;
  }
  /// Clears every MoE block's statistics on this rank (at the start of a step).
  void reset_moe_statistics() {
    for (auto& k : chunks_)
      for (auto& b : k.blocks)
        if (auto* m = b.moe()) m->reset_statistics();
  }
  /// The aux-loss-free balancing step of this rank's MoE blocks
  /// (MoE::update_bias with GPTConfig::bias_balance: with 0 it only clears
  /// the step's counts).
  /// Call it after each optimizer step, on every rank.
  void update_expert_bias() {
    for (auto& k : chunks_)
      for (auto& b : k.blocks)
        if (auto* m = b.moe()) m->update_bias(global_.bias_balance);
  }

  /// The slot of (microbatch, chunk), created (or taken from the pool) on first use.
  Slot& slot(int mb, int c) {
    return slots_.get(mb, c, [&] { return make_slot(chunks_.at(std::size_t(c))); });
  }
  /// Whether (microbatch, chunk) has a slot.
  bool has_slot(int mb, int c) const { return slots_.has(mb, c); }
  /// Returns the slot to the pool (its requests must be complete).
  void release(int mb, int c) { slots_.release(mb, c); }
  /// Drops every slot (after a failed step).
  void release_all() { slots_.release_all(); }
  /// Most slots held at once so far (all chunks).
  std::size_t peak_slots() const { return slots_.peak(); }
  /// Whether the slots keep 2-byte copies of the blocks' inputs and of the
  /// dense blocks' saved tensors (a mixed Precision without recompute), as
  /// nn::GPT does; the blocks compute in float either way.
  bool saves_2_byte_activations() const { return narrow_; }
  /// Slots held now.
  std::size_t live_slots() const { return slots_.live(); }

  /// Forward of microbatch `mb` on chunk c: from ids (first virtual stage) or
  /// from the slot's xs[0] (received) to xs.back() (to send) or, on the head
  /// chunk, to the loss. The head chunk also runs the fused cross-entropy
  /// backward (its logits then hold their gradient, scaled by grad_scale) and
  /// returns the sum of its token losses; other chunks return 0.
  template <class IV, class TV>
  double forward(int mb, int c, const IV& ids, const TV& targets, double grad_scale) {
    Chunk& k = chunks_.at(std::size_t(c));
    Slot& s = slot(mb, c);
    const bool root = has_root(k);
    if (root && hooks_) hooks_->before_forward(root_group_);
    if (k.emb) {
      Timer t(this, 0);
      k.emb->forward(ids, s.xs[0]);
    }
    for (std::size_t i = 0; i < k.blocks.size(); ++i) {
      Timer t(this, k.first_block + i + 1);
      if (hooks_) hooks_->before_forward(k.block_group[i]);
      // The MoE blocks' auxiliary losses enter the gradient with the weight
      // of the mean token loss, as in nn::GPT.
      if (auto* m = k.blocks[i].moe())
        m->set_loss_weight(grad_scale * double(global_.tokens()) *
                           double(ctx_->ep.data_size() / ctx_->ep.token_shards));
      if (narrow_) s.x_stash[i].store();
      if (shared_) {  // recompute: the shared set; backward recomputes it
        k.blocks[i].forward(s.xs[i], s.xs[i + 1]);
      } else {
        auto& cur = *k.blocks[i].saved();
        cur = s.saved[i];
        k.blocks[i].forward(s.xs[i], s.xs[i + 1]);
        s.saved[i] = cur;
      }
      if (hooks_) hooks_->after_forward(k.block_group[i]);
    }
    double loss = 0;
    if (k.head) {
      Timer t(this, cfg_.layers + 1);
      k.ln_f->forward(s.xs.back(), s.hf, s.sf);
      nn::detail::head_forward(*ctx_, *k.head, s.hf, s.hf_full, s.logits);
      metrics::Profiler::Scope sc(ctx_->profiler, "cross_entropy");
      loss = ctx_->tp.active() ? nn::detail::vocab_parallel_loss(*ctx_, s.logits, targets, cfg_.vocab, ce_max_, ce_sums_,
                                                                 T(grad_scale), true)
                               : ops::cross_entropy_forward_backward(s.logits, targets, T(grad_scale));
    }
    if (root && hooks_) hooks_->after_forward(root_group_);
    return loss;
  }

  /// Backward of microbatch `mb` on chunk c: from the slot's dy (received) or,
  /// on the head chunk, from the logits' gradient, to the slot's dx (to send)
  /// or, on the first virtual stage, into the embedding tables. With
  /// `split`, only the input-gradient half runs: the Linear layers' weight
  /// gradients wait in the slot's DeferredWork for backward_weight().
  template <class IV>
  void backward(int mb, int c, const IV& ids, bool split = false) {
    Chunk& k = chunks_.at(std::size_t(c));
    Slot& s = slot(mb, c);
    const bool root = has_root(k);
    ctx_->deferred_weight_grads = split ? &s.deferred : nullptr;
    struct Reset {
      nn::LayerContext* ctx;
      ~Reset() { ctx->deferred_weight_grads = nullptr; }
    } reset{ctx_.get()};
    if (root && hooks_) hooks_->before_backward(root_group_);
    const std::size_t n = k.blocks.size();
    // Recompute: whatever the shared set holds now belongs to the last
    // forward this rank ran, which a schedule need not have run for this
    // microbatch, so every block recomputes its forward from its input.
    if (shared_) shared_->holder = -1;
    // A split backward's queued weight gradients read their Linear inputs
    // after later recomputes have overwritten the shared set: they keep copies.
    // So do a 2-byte stash's: its blocks share one float working set.
    s.deferred.set_copy_inputs(shared_ != nullptr || working_ != nullptr);
    // Where each gradient goes: the last one to be computed lands in the
    // slot's dx unless the embedding consumes it.
    Matrix cur = s.dy;
    int free_buf = 0;
    auto next_target = [&](bool last) -> Matrix {
      if (last && !k.emb) return s.dx;
      Matrix m = g_[std::size_t(free_buf)];
      free_buf ^= 1;
      return m;
    };
    if (k.head) {
      Timer t(this, cfg_.layers + 1);
      nn::detail::head_backward(*ctx_, *k.head, s.hf, s.hf_full, s.logits, dhf_, dhf_full_);
      Matrix out = next_target(n == 0);
      if (ln_f_partial_) ln_f_partial_->begin();
      k.ln_f->backward(dhf_, s.xs.back(), s.sf, out, false);
      if (ln_f_partial_) ln_f_partial_->finish(*ctx_);
      cur = out;
    }
    for (std::size_t i = n; i-- > 0;) {
      Timer t(this, k.first_block + i + 1);
      if (hooks_) hooks_->before_backward(k.block_group[i]);
      Matrix out = next_target(i == 0);
      if (!shared_) *k.blocks[i].saved() = s.saved[i];
      if (narrow_) s.x_stash[i].load();
      k.blocks[i].backward(s.xs[i], cur, out);
      if (hooks_) hooks_->after_backward(k.block_group[i]);
      cur = out;
    }
    if (k.emb) {
      Timer t(this, 0);
      if (pos_partial_) pos_partial_->begin();
      k.emb->backward(ids, cur);
      if (pos_partial_) pos_partial_->finish(*ctx_);
    }
    if (root && hooks_) hooks_->after_backward(root_group_);
  }

  /// Refuses a split backward (the executor asks before step 0 when its
  /// schedule splits backwards): ConfigError for mixture-of-experts blocks
  /// under sequence parallelism, whose TP sum of the experts' gradients
  /// cannot wait for the deferred weight halves.
  void check_split_backward() const {
    WEFT_REQUIRE(!(ctx_->tp.sp() && cfg_.moe_blocks() > 0), ConfigError, "pipeline::Stage: ", BlockT::moe_sp_split_text);
  }

  /// The weight-gradient half of a split backward of (mb, chunk c).
  void backward_weight(int mb, int c) {
    Slot& s = slot(mb, c);
    s.deferred.run();
  }

  /// Called once per step after the last action that adds weight gradients
  /// on chunk c (its last backward or backward_weight): tells the hooks that
  /// the weight gradients of its groups are complete (the root group's once
  /// every chunk holding part of it is done).
  void weights_done(int c) {
    const Chunk& k = chunks_.at(std::size_t(c));
    std::size_t holders = 0;
    for (const auto& x : chunks_) holders += has_root(x) ? 1 : 0;
    weights_done_(hooks_, k.block_group, has_root(k), holders, root_group_);
  }

  /// Bytes of parameters and gradients (at their current storage) and of the
  /// activation slots allocated so far (live and pooled), plus scratch.
  metrics::MemoryLedger memory() {
    metrics::MemoryLedger m;
    for (auto* p : parameters()) nn::detail::account(m, *p);
    using C = metrics::MemoryCategory;
    // Split backwards (zb): the copies of output gradients that deferred
    // weight-gradient gemms read, pooled per slot.
    std::size_t act = 0, deferred = 0;
    slots_.for_each([&](const Slot& s, std::size_t) {
      act += slot_bytes(s);
      deferred += s.deferred.bytes();
    });
    m.add(C::activations, "pipeline.slots", act);
    if (shared_) m.add(C::activations, "pipeline.blocks.shared", shared_->bytes());
    // 2-byte stashes: the float set the dense blocks compute in, and the two
    // residual buffers between a chunk's blocks.
    if (working_) m.add(C::buffers, "pipeline.blocks.working", working_->bytes());
    if (residual_[0].size())
      m.add(C::buffers, "pipeline.residual.working", nn::detail::bytes_of(residual_[0]) + nn::detail::bytes_of(residual_[1]));
    if (deferred) m.add(C::activations, "pipeline.deferred_output_gradients", deferred);
    std::size_t context = 0;  // context parallelism: what the attention keeps of its own, per slot
    for (const auto& k : chunks_)
      for (const auto& b : k.blocks) context += b.context_bytes();
    if (context) m.add(C::activations, "pipeline.context_attention", context);
    std::size_t context_buffers = 0;  // one block at a time: the largest
    for (const auto& k : chunks_)
      for (const auto& b : k.blocks) context_buffers = std::max(context_buffers, b.context_buffer_bytes());
    if (context_buffers) m.add(C::buffers, "pipeline.context_attention_buffers", context_buffers);
    // bf16 products (a mixed Precision): their operands' staging, once a product has grown it.
    if (ctx_->staging) m.add(C::buffers, "product staging", ctx_->staging->bytes());
    m.add(C::buffers, "pipeline.backward_workspace",
          ws_->bytes() + nn::detail::bytes_of(g_[0]) * 2 + nn::detail::bytes_of(dhf_) + nn::detail::bytes_of(dhf_full_));
    if (send_.count()) m.add(C::buffers, "pipeline.send_buffers", send_.count() * rows_ * cfg_.d_model * sizeof(T));
    if (ctx_->tp.active()) {
      std::size_t emb = 0;
      for (auto& k : chunks_)
        if (k.emb) emb += k.emb->buffer_bytes();
      m.add(C::buffers, "tensor-parallel buffers", emb + nn::detail::bytes_of(ce_max_) + nn::detail::bytes_of(ce_sums_));
    }
    return m;
  }

  /// Allocates spare buffers for input-gradient sends until `n` exist in
  /// all (none on a rank whose chunks all hold the embedding: it sends no
  /// gradients). The executor reserves its cap of detached sends up front,
  /// so that memory() does not depend on when MPI completes the sends.
  void reserve_send_buffers(std::size_t n) {
    bool sends_gradients = false;
    for (const auto& k : chunks_) sends_gradients = sends_gradients || !k.emb;
    if (!sends_gradients) return;
    send_.reserve(n, rows_, cfg_.d_model);
  }
  /// A buffer of one input-gradient message ([rows(), d_model], a slot's dx)
  /// for a send that outlives its slot (the executor detaches in-flight sends
  /// from retired slots): a returned one when there is one, else a new one,
  /// counted by memory().
  Matrix take_send_buffer() { return send_.take(rows_, cfg_.d_model); }
  /// Returns a buffer from take_send_buffer() (or a slot's, which it
  /// replaced) whose send has completed, for reuse.
  void return_send_buffer(const Matrix& m) { send_.give(m); }

  /// Bytes of one slot of chunk c (its activations for one microbatch).
  std::size_t slot_bytes_of_chunk(int c) {
    auto s = make_slot(chunks_.at(std::size_t(c)));
    return slot_bytes(*s);
  }

 private:
  static constexpr std::size_t no_group = std::size_t(-1);

  // Fenced timing of one unit, for --stages auto.
  struct Timer {
    GPTStage* st;
    std::size_t unit;
    std::chrono::steady_clock::time_point t0;
    Timer(GPTStage* s, std::size_t u) : st(s), unit(u) {
      if (st->unit_time_) {
        Kokkos::fence();
        t0 = std::chrono::steady_clock::now();
      }
    }
    ~Timer() {
      if (st->progress_ && std::uncaught_exceptions() == 0) {
        try {
          st->progress_();
        } catch (...) {
          // A failed message surfaces again, with its context, where the executor waits for it.
        }
      }
      if (!st->unit_time_) return;
      Kokkos::fence();
      (*st->unit_time_)[unit] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  };

  static nn::GPTConfig checked(const nn::GPTConfig& c, const nn::TensorSplit& tp,
                              const nn::ContextParallel<T, Space>& cp) {
    c.validate();
    if (cp.size() > 1) {
      WEFT_REQUIRE(cp.make && c.seq_shards == 1, ConfigError,
                   "pipeline::Stage: context parallelism needs a ContextParallel from weft::context::attention_of");
      context::check_sequence(c.seq, cp.size(), "the sequence length (--seq)");
      nn::check_context_precision<T, Prec>(cp, "pipeline::Stage");
    }
    const nn::GPTConfig local = cp.size() > 1 ? c.local_sequence(cp.size()) : c;
    local.validate_tensor_parallel(tp.size(), tp.sequence_parallel);
    return local;
  }

  // Microbatch i of a [n * tokens] array of this rank's tokens.
  auto local(const ops::Tokens<Space>& v, std::size_t i) const {
    return Kokkos::subview(v, std::make_pair(i * cfg_.tokens(), (i + 1) * cfg_.tokens()));
  }
  // This rank's tokens of every sequence of a [batch * seq] token array.
  template <class FV, class LV>
  void select_local(const FV& full, const LV& out) const {
    // A free function's kernel: nvcc refuses extended lambdas in private members.
    ops::select_balanced(full, ops::BalancedPositions{0, cfg_.seq, global_.seq, ctx_->cp.size(), ctx_->cp.rank()}, out);
  }

  bool has_root(const Chunk& k) const { return root_group_ != no_group && (k.emb || k.head); }

  void collect_root(std::vector<Param*>& out) {
    for (auto& k : chunks_) {
      if (k.emb) k.emb->collect(out);
      if (k.ln_f) k.ln_f->collect(out);
      if (k.head) k.head->collect(out);
    }
  }

  std::unique_ptr<Slot> make_slot(const Chunk& k) const {
    auto s = std::make_unique<Slot>();
    const std::size_t n = k.blocks.size(), tok = rows_, d = cfg_.d_model;
    const nn::TensorSplit& tp = ctx_->tp;
    for (std::size_t i = 0; i <= n; ++i) {
      if (narrow_ && i > 0 && i < n) s->xs.push_back(residual_[i % 2]);
      else s->xs.emplace_back("pipeline.residual", tok, d);
    }
    if (narrow_)
      for (std::size_t i = 0; i < n; ++i) {
        s->x_stash.emplace_back(ctx_->products);
        s->x_stash.back().keep(s->xs[i], true, "pipeline.residual." + std::to_string(k.first_block + i));
      }
    if (!shared_)
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t b = k.first_block + i;
        if (working_ && !cfg_.moe_block(b))
          s->saved.emplace_back("pipeline.block." + std::to_string(b), *working_, ctx_->products);
        else
          s->saved.emplace_back("pipeline.block", cfg_, tp);
      }
    if (k.head) {
      s->hf = Matrix("pipeline.ln_f.out", tok, d);
      s->sf = typename nn::Norm<T, Space>::Saved("pipeline.ln_f", tok);
      if (tp.sp()) s->hf_full = Matrix("pipeline.ln_f.out.gathered", cfg_.tokens(), d);
      s->logits = Matrix("pipeline.logits", cfg_.tokens(), cfg_.vocab / tp.size());
    } else {
      s->dy = Matrix("pipeline.dy", tok, d);
    }
    if (!k.emb) s->dx = Matrix("pipeline.dx", tok, d);
    return s;
  }

  static std::size_t slot_bytes(const Slot& s) {
    using nn::detail::bytes_of;
    std::size_t b = bytes_of(s.hf) + bytes_of(s.hf_full) + bytes_of(s.logits) + s.sf.bytes() + bytes_of(s.dy) +
                    bytes_of(s.dx);
    // Under a 2-byte stash xs[1] ... xs[n-1] are the stage's shared buffers.
    for (std::size_t i = 0; i < s.xs.size(); ++i)
      if (s.x_stash.empty() || i == 0 || i + 1 == s.xs.size()) b += bytes_of(s.xs[i]);
    for (const auto& x : s.x_stash) b += x.bytes();
    for (const auto& v : s.saved) b += v.bytes();
    return b;
  }

  nn::GPTConfig global_;              // whole sequences, as given
  nn::ContextParallel<T, Space> cp_;  // the CP axis and its attention (empty: none)
  nn::GPTConfig cfg_;                 // this rank's share of every sequence (= global_ without CP)
  nn::ContextPtr ctx_;
  int ranks_, rank_;
  std::size_t rows_;  // token rows of the residual stream on this rank
  std::vector<Chunk> chunks_;
  std::size_t root_group_ = no_group;
  std::shared_ptr<typename BlockT::Workspace> ws_;
  std::shared_ptr<typename BlockT::Saved> shared_;  // recompute: the saved set every block shares (null: per slot)
  bool narrow_ = false;                             // 2-byte saved activations (saves_2_byte_activations())
  std::shared_ptr<typename BlockT::Saved> working_;  // their dense blocks' float working set (null: none)
  Matrix residual_[2];                              // their residual buffers between a chunk's blocks
  Matrix g_[2], dhf_;
  Matrix dhf_full_;                 // sequence parallelism: the head's partial input gradient [tokens, D]
  ops::Vector<T, Space> ce_max_;    // tensor parallelism: per-token maximum logit
  Matrix ce_sums_;                  // tensor parallelism: per-token sum of exp and target logit
  std::unique_ptr<nn::detail::PartialGrads<T, Space>> ln_f_partial_, pos_partial_;  // sequence parallelism
  nn::GroupHooks* hooks_ = nullptr;
  std::vector<double>* unit_time_ = nullptr;
  std::function<void()> progress_;
  detail::SlotPool<Slot> slots_;
  detail::WeightsDone weights_done_;
  detail::SendBuffers<Matrix> send_;   // buffers of detached gradient sends
  ops::Tokens<Space> ids_, targets_;   // every microbatch of the step (reserve_microbatches)
  ops::Tokens<Space> local_ids_, local_targets_;  // context parallelism: this rank's tokens of them
};

/// The GPT stage a strategy S gives: its layers split as S's TP policy says,
/// its products in S's weft::Precision (the DP mode and the schedule do not
/// change the stage's type): fp32, bf16, or fp16 with loss scaling (see GPTStage).
template <class T, StrategyType S = SingleProcess, class Space = Kokkos::DefaultExecutionSpace>
using Stage = GPTStage<T, Space, layer_policy_t<S>, precision_of_t<S>>;

/// Measures what --stages auto partitions by: for each unit (embedding,
/// blocks, head) the seconds of its forward and backward on one microbatch of
/// cfg.batch sequences (fenced, the mean of `reps` runs after one warm-up),
/// and the bytes a stage holding it needs: parameters, gradients and AdamW's
/// two moments (4 copies), plus `in_flight` microbatches of its activations.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
std::vector<UnitCost> measure_unit_costs(const nn::GPTConfig& cfg, int reps = 3, double in_flight = 1) {
  const std::size_t n = unit_count(cfg.layers);
  StagePartition whole;
  whole.bounds = {0, n};
  GPTStage<T, Space, NoPolicy> st(cfg, whole, 1, 0, 1);
  ops::Tokens<Space> ids("ids", cfg.tokens()), tg("targets", cfg.tokens());
  std::vector<double> acc(n, 0.0);
  for (int r = 0; r <= reps; ++r) {
    if (r == 1) std::fill(acc.begin(), acc.end(), 0.0);  // the first run is the warm-up
    st.set_unit_timing(&acc);
    st.forward(0, 0, ids, tg, 1.0 / double(cfg.tokens()));
    st.backward(0, 0, ids);
    st.set_unit_timing(nullptr);
    st.release(0, 0);
  }
  std::vector<UnitCost> out(n);
  for (std::size_t u = 0; u < n; ++u) out[u].seconds = acc[u] / double(std::max(reps, 1));
  // Parameter bytes per unit.
  auto param_bytes = [](auto& layer) {
    std::vector<nn::Parameter<T, Space>*> ps;
    layer.collect(ps);
    double b = 0;
    for (auto* p : ps) b += double(p->size() * sizeof(T));
    return b;
  };
  auto& chunk = st.chunks().front();
  const double row = double(cfg.tokens() * cfg.d_model * sizeof(T));
  // Under recompute a slot keeps only the block's input (the shared set is one per rank, not per microbatch).
  const double block_act =
      (cfg.recompute ? 0.0 : double(typename GPTStage<T, Space, NoPolicy>::BlockT::Saved("measure", cfg).bytes())) + row;
  const double head_act = 2 * row + double(cfg.tokens() * cfg.vocab * sizeof(T)) + double(2 * cfg.tokens() * sizeof(T));
  out[0].bytes = 4 * param_bytes(*chunk.emb) + in_flight * row;
  for (std::size_t b = 0; b < cfg.layers; ++b) out[b + 1].bytes = 4 * param_bytes(chunk.blocks[b]) + in_flight * block_act;
  out[n - 1].bytes = 4 * (param_bytes(*chunk.ln_f) + param_bytes(*chunk.head)) + in_flight * head_act;
  return out;
}

}  // namespace weft::pipeline
