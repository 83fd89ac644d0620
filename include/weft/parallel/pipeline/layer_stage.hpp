// The part of a model of a user's own layers (nn::LayeredModel: an input
// layer, blocks, a loss layer) that one pipeline rank runs: one chunk per
// virtual stage it holds, activations per in-flight microbatch, the group
// hooks DataParallel needs, and what the executor needs (PipelineStage). The
// same stage at pp = 1 is how a user model trains without a pipeline, so the
// data-parallel modes, clipping and the memory ledger work on it unchanged.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <weft/comm/request.hpp>
#include <weft/metrics/memory.hpp>
#include <weft/nn/layer.hpp>
#include <weft/nn/parameter.hpp>
#include <weft/parallel/pipeline/partition.hpp>
#include <weft/vocabulary/strategy.hpp>
#include <weft/parallel/pipeline/slots.hpp>

namespace weft::pipeline {

/// The chunks of one pipeline rank of a LayeredModel. Units are numbered as
/// for the GPT: 0 the input layer, 1..blocks() the blocks, blocks() + 1 the
/// loss layer; `part` splits them into ranks x chunks virtual stages.
template <nn::LayeredModel Model>
class LayerStage {
 public:
  /// What the model takes of a strategy's in-layer policies (its own
  /// `policies`; what DataParallelOf's strategy check reads).
  static constexpr ModelPolicies policies = model_policies<Model>();
  using T = typename Model::value_type;
  using Space = typename Model::execution_space;
  using Matrix = ops::Matrix<T, Space>;
  using Param = nn::Parameter<T, Space>;
  using Block = typename Model::Block;
  using Input = typename Model::Input;
  using Head = typename Model::Head;
  using Batch = typename Model::Batch;
  /// Whether the blocks split their backward (zero-bubble schedules need it).
  static constexpr bool splits_backward = nn::SplitBackwardLayer<Block>;

  /// One virtual stage on this rank: units [first_unit, end_unit).
  struct Chunk {
    std::size_t virtual_stage = 0, first_unit = 0, end_unit = 0;
    std::unique_ptr<Input> input;                ///< when it holds unit 0
    std::vector<std::unique_ptr<Block>> blocks;  ///< blocks first_block, first_block + 1, ...
    std::size_t first_block = 0;
    std::unique_ptr<Head> head;                  ///< when it holds the last unit
    std::vector<std::size_t> block_group;        ///< parameter group of each block
  };

  /// One microbatch's activations on one chunk, and its messages' requests.
  struct Slot {
    std::vector<Matrix> xs;                   ///< residual stream: xs[0] the chunk input, xs.back() its output
    std::vector<typename Block::Saved> saved;  ///< each block's saved tensors
    std::optional<typename Head::Saved> head_saved;
    Matrix dy, dx;                             ///< received output gradient; input gradient to send
    Request recv_activation, recv_gradient, send_activation, send_gradient;
    nn::DeferredWork deferred;                 ///< weight-gradient work of a split backward
  };

  /// The chunks of pipeline rank `rank` of `ranks` for `model` (which must
  /// outlive the stage): chunk c runs virtual stage c * ranks + rank of
  /// `part`, which must have ranks * chunks stages covering the model's units.
  LayerStage(Model& model, const StagePartition& part, int ranks, int rank, int chunks = 1)
      : model_(model), ranks_(ranks), rank_(rank) {
    WEFT_REQUIRE(ranks >= 1 && rank >= 0 && rank < ranks && chunks >= 1, ConfigError, "pipeline::LayerStage: rank ", rank,
                 " of ", ranks, " with ", chunks, " chunks; expected 0 <= rank < ranks and chunks >= 1");
    WEFT_REQUIRE(part.stages() == std::size_t(ranks) * std::size_t(chunks), ConfigError, "pipeline::LayerStage: the partition has ",
                 part.stages(), " stages, but ", ranks, " ranks x ", chunks, " chunks need ", ranks * chunks,
                 "; give one block count per virtual stage");
    const std::size_t L = model.blocks();
    WEFT_REQUIRE(part.bounds.front() == 0 && part.bounds.back() == unit_count(L), ConfigError,
                 "pipeline::LayerStage: the partition covers units ", part.bounds.front(), "..", part.bounds.back(),
                 " but the model has units 0..", unit_count(L), " (input, ", L, " blocks, loss)");
    for (auto& g : g_) g = Matrix("pipeline.grad", model.rows(), model.width());
    std::size_t groups = 0;
    chunks_.resize(std::size_t(chunks));
    for (int c = 0; c < chunks; ++c) {
      Chunk& k = chunks_[std::size_t(c)];
      k.virtual_stage = std::size_t(c) * std::size_t(ranks) + std::size_t(rank);
      k.first_unit = part.begin(k.virtual_stage);
      k.end_unit = part.end(k.virtual_stage);
      WEFT_REQUIRE(k.end_unit > k.first_unit, ConfigError, "pipeline::LayerStage: virtual stage ", k.virtual_stage,
                   " has no layers; every stage needs at least one");
      if (k.first_unit == 0) k.input = model.make_input();
      k.first_block = std::max<std::size_t>(k.first_unit, 1) - 1;
      const std::size_t end_block = std::min(k.end_unit, L + 1) - 1;
      for (std::size_t b = k.first_block; b < end_block; ++b) {
        k.blocks.push_back(model.make_block(b));
        k.block_group.push_back(groups++);
      }
      if (k.end_unit == L + 2) k.head = model.make_head();
    }
    std::vector<Param*> root;
    collect_root(root);
    root_group_ = root.empty() ? no_group : groups;
  }
  /// The whole model on this rank, one chunk (pp = 1): with
  /// Executor(stage, Pipeline<GPipe>(1, m)) it trains without a PP axis.
  explicit LayerStage(Model& model) : LayerStage(model, equal_partition(model.blocks(), 1), 1, 0) {}
  LayerStage(const LayerStage&) = delete;
  LayerStage& operator=(const LayerStage&) = delete;

  /// The model it was built from.
  Model& model() { return model_; }
  /// Chunks on this rank, in chunk order.
  std::vector<Chunk>& chunks() { return chunks_; }
  /// Number of pipeline ranks.
  int ranks() const { return ranks_; }
  /// This rank's position in the pipeline.
  int rank() const { return rank_; }
  /// Chunks on this rank.
  std::size_t num_chunks() const { return chunks_.size(); }
  /// The virtual stage chunk c runs.
  std::size_t virtual_stage(int c) const { return chunks_.at(std::size_t(c)).virtual_stage; }
  /// Whether chunk c holds the loss layer.
  bool has_head(int c) const { return chunks_.at(std::size_t(c)).head != nullptr; }
  /// Whether chunk c holds the input layer.
  bool has_input(int c) const { return chunks_.at(std::size_t(c)).input != nullptr; }
  /// Samples per microbatch (the model's).
  std::size_t microbatch_samples() const { return model_.microbatch_samples(); }
  /// Loss terms per sample (the model's).
  std::size_t loss_terms_per_sample() const { return model_.loss_terms_per_sample(); }
  /// The TP communicator the blocks are split over (null: not split).
  Comm* tp_comm() const { return model_.tp_comm(); }
  /// How the model splits its sequences over the CP axis (nn::ContextSplit),
  /// for a model that takes context parallelism (nn::ContextLayeredModel).
  /// The executor then gives the CP ranks of one DP rank the same samples
  /// and DataParallel runs over DP x CP.
  const nn::ContextSplit& context_parallel() const
    requires nn::ContextLayeredModel<Model>
  {
    return model_.context_parallel();
  }

  /// Parameters by group, for DataParallel: one group per block (chunk
  /// order), then, when this rank holds any, the root group (input and loss layers).
  std::vector<std::vector<Param*>> parameter_groups() {
    std::vector<std::vector<Param*>> g;
    for (auto& k : chunks_)
      for (auto& b : k.blocks) {
        g.emplace_back();
        b->collect(g.back());
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
  /// Installs hooks called around each group's forward and backward (null removes them).
  void set_hooks(nn::GroupHooks* h) { hooks_ = h; }
  /// Called between blocks during forward and backward (the executor tests its messages there).
  void set_progress(std::function<void()> f) { progress_ = std::move(f); }

  /// Allocates the data of `n` microbatches (the executor calls it with its microbatch count).
  void reserve_microbatches(std::size_t n) {
    while (batches_.size() < n) batches_.push_back(model_.make_batch());
  }
  /// The data of microbatch i (fill it before the executor runs).
  Batch& batch(std::size_t i) { return batches_.at(i); }

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
  /// Slots held now.
  std::size_t live_slots() const { return slots_.live(); }

  /// Forward of microbatch `mb` on chunk c, from batch(mb) (input chunk) or
  /// the received xs[0] to xs.back() or, on the loss chunk, to the loss;
  /// returns the microbatch's mean loss on the loss chunk, else 0.
  double forward_microbatch(int mb, int c, double grad_scale) {
    Chunk& k = chunks_.at(std::size_t(c));
    Slot& s = slot(mb, c);
    const bool root = has_root(k);
    if (root && hooks_) hooks_->before_forward(root_group_);
    if (k.input) k.input->forward(batch(std::size_t(mb)), s.xs[0]);
    for (std::size_t i = 0; i < k.blocks.size(); ++i) {
      if (hooks_) hooks_->before_forward(k.block_group[i]);
      k.blocks[i]->forward(s.xs[i], s.xs[i + 1], s.saved[i]);
      if (hooks_) hooks_->after_forward(k.block_group[i]);
      progress();
    }
    double loss = 0;
    // The mean over this rank's terms: under context parallelism the head
    // sees 1 / cp of each sequence's terms (and grad_scale counts whole ones).
    if (k.head)
      loss = k.head->forward(s.xs.back(), batch(std::size_t(mb)), *s.head_saved, grad_scale) /
             (double(model_.microbatch_samples() * model_.loss_terms_per_sample()) / double(context_ranks()));
    if (root && hooks_) hooks_->after_forward(root_group_);
    return loss;
  }

  /// Backward of microbatch `mb` on chunk c, from the received dy or the loss
  /// layer to dx (to send) or into the input layer. With `split` (zero-bubble
  /// schedules; only for blocks that meet SplitBackwardLayer) the blocks
  /// queue their weight gradients for backward_weight().
  void backward_microbatch(int mb, int c, bool split) {
    Chunk& k = chunks_.at(std::size_t(c));
    Slot& s = slot(mb, c);
    const bool root = has_root(k);
    if (root && hooks_) hooks_->before_backward(root_group_);
    const std::size_t n = k.blocks.size();
    Matrix cur = s.dy;
    int free_buf = 0;
    auto next_target = [&](bool last) -> Matrix {
      if (last && !k.input) return s.dx;
      Matrix m = g_[std::size_t(free_buf)];
      free_buf ^= 1;
      return m;
    };
    if (k.head) {
      Matrix out = next_target(n == 0);
      k.head->backward(s.xs.back(), *s.head_saved, out);
      cur = out;
    }
    for (std::size_t i = n; i-- > 0;) {
      if (hooks_) hooks_->before_backward(k.block_group[i]);
      Matrix out = next_target(i == 0);
      if constexpr (splits_backward) {
        if (split) k.blocks[i]->backward_input(s.xs[i], cur, out, s.saved[i], s.deferred);
        else k.blocks[i]->backward(s.xs[i], cur, out, s.saved[i]);
      } else {
        WEFT_REQUIRE(!split, ConfigError, "pipeline::LayerStage: a split backward was asked of blocks that do not "
                                          "split theirs (nn::SplitBackwardLayer)");
        k.blocks[i]->backward(s.xs[i], cur, out, s.saved[i]);
      }
      if (hooks_) hooks_->after_backward(k.block_group[i]);
      cur = out;
      progress();
    }
    if (k.input) k.input->backward(batch(std::size_t(mb)), cur);
    if (root && hooks_) hooks_->after_backward(root_group_);
  }

  /// The weight-gradient half of a split backward of (mb, chunk c).
  void backward_weight(int mb, int c) { slot(mb, c).deferred.run(); }

  /// After the last action of the step that adds weight gradients on chunk
  /// c: tells the hooks its groups' weight gradients are complete (the root
  /// group's once every chunk holding part of it is done).
  void weights_done(int c) {
    const Chunk& k = chunks_.at(std::size_t(c));
    std::size_t holders = 0;
    for (const auto& x : chunks_) holders += has_root(x) ? 1 : 0;
    weights_done_(hooks_, k.block_group, has_root(k), holders, root_group_);
  }

  /// Bytes of parameters and gradients (at their current storage), of the
  /// activation slots allocated so far (live and pooled: residual stream,
  /// what each block and the loss layer saved, messages), of the deferred
  /// weight-gradient inputs, and of the stage's scratch and send buffers.
  metrics::MemoryLedger memory() {
    metrics::MemoryLedger m;
    for (auto* p : parameters()) nn::detail::account(m, *p);
    using C = metrics::MemoryCategory;
    std::size_t act = 0, deferred = 0;
    auto add = [&](const Slot& s, std::size_t c) {
      act += slot_bytes(s, chunks_[c]);
      deferred += s.deferred.bytes();
    };
    slots_.for_each(add);
    m.add(C::activations, "pipeline.slots", act);
    if (deferred) m.add(C::activations, "pipeline.deferred_output_gradients", deferred);
    m.add(C::buffers, "pipeline.backward_workspace", nn::detail::bytes_of(g_[0]) * 2);
    if (send_.count()) m.add(C::buffers, "pipeline.send_buffers", send_.count() * model_.rows() * model_.width() * sizeof(T));
    return m;
  }

  /// Allocates spare buffers for input-gradient sends until `n` exist (none
  /// on a rank whose chunks all hold the input layer: it sends no gradients).
  void reserve_send_buffers(std::size_t n) {
    bool sends_gradients = false;
    for (const auto& k : chunks_) sends_gradients = sends_gradients || !k.input;
    if (!sends_gradients) return;
    send_.reserve(n, model_.rows(), model_.width());
  }
  /// A buffer of one input-gradient message for a send that outlives its slot.
  Matrix take_send_buffer() { return send_.take(model_.rows(), model_.width()); }
  /// Returns a buffer from take_send_buffer() (or a slot's, which it
  /// replaced) whose send has completed, for reuse.
  void return_send_buffer(const Matrix& m) { send_.give(m); }

 private:
  static constexpr std::size_t no_group = std::size_t(-1);

  bool has_root(const Chunk& k) const { return root_group_ != no_group && (k.input || k.head); }

  void collect_root(std::vector<Param*>& out) {
    for (auto& k : chunks_) {
      if (k.input) k.input->collect(out);
      if (k.head) k.head->collect(out);
    }
  }

  void progress() {
    if (!progress_) return;
    try {
      progress_();
    } catch (...) {
      // A failed message surfaces again, with its context, where the executor waits for it.
    }
  }

  std::unique_ptr<Slot> make_slot(const Chunk& k) {
    auto s = std::make_unique<Slot>();
    const std::size_t rows = model_.rows(), d = model_.width();
    for (std::size_t i = 0; i <= k.blocks.size(); ++i) s->xs.emplace_back("pipeline.residual", rows, d);
    for (auto& b : k.blocks) s->saved.push_back(b->make_saved(rows));
    if (k.head) s->head_saved.emplace(k.head->make_saved(rows));
    else s->dy = Matrix("pipeline.dy", rows, d);
    if (!k.input) s->dx = Matrix("pipeline.dx", rows, d);
    return s;
  }

  std::size_t slot_bytes(const Slot& s, const Chunk& k) const {
    using nn::detail::bytes_of;
    std::size_t b = bytes_of(s.dy) + bytes_of(s.dx);
    for (const auto& x : s.xs) b += bytes_of(x);
    for (std::size_t i = 0; i < s.saved.size(); ++i) b += k.blocks[i]->saved_bytes(s.saved[i]);
    if (s.head_saved) b += k.head->saved_bytes(*s.head_saved);
    return b;
  }

  // CP ranks the model's sequences are split over (1 without context parallelism).
  std::size_t context_ranks() const {
    if constexpr (nn::ContextLayeredModel<Model>) return model_.context_parallel().size();
    else return 1;
  }
  Model& model_;
  int ranks_, rank_;
  std::vector<Chunk> chunks_;
  std::size_t root_group_ = no_group;
  Matrix g_[2];
  nn::GroupHooks* hooks_ = nullptr;
  std::function<void()> progress_;
  std::vector<Batch> batches_;
  detail::SlotPool<Slot> slots_;
  detail::WeightsDone weights_done_;
  detail::SendBuffers<Matrix> send_;
};

}  // namespace weft::pipeline
