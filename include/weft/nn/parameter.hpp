// A trainable tensor of a layer: its global name (which seeds its counter-based
// initialisation), its value and gradient storage, and whether weight decay
// applies. Also the per-model context layers share (profiler, seed).
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/core/allocation.hpp>
#include <weft/metrics/memory.hpp>
#include <weft/metrics/profiler.hpp>
#include <weft/ops/common.hpp>
#include <weft/core/half.hpp>
#include <weft/precision/convert.hpp>
#include <weft/precision/policy.hpp>

namespace weft::nn {

/// One rectangle of a global tensor that a rank holds: global rows
/// [row0, row0 + rows) and columns [col0, col0 + cols), stored at local
/// columns [local_col0, local_col0 + cols) of every local row (a rank's
/// part of a parameter is one band, or several side by side for the fused
/// Q | K | V and gate | value projections under tensor parallelism).
struct GlobalBand {
  std::size_t row0 = 0, col0 = 0, rows = 0, cols = 0, local_col0 = 0;
};

/// A rank-2 view onto a parameter's flat storage.
template <class T, class Space>
using MatrixRef = Kokkos::View<T**, Kokkos::LayoutRight, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// The element type of the operands of a model's weight products (every
/// nn::Linear's forward, input-gradient and weight-gradient product): f32
/// (the products in fp32), bf16 or fp16. A model sets it from its strategy's
/// weft::Precision (product_precision_v) when it is built; it is never read
/// from a run-time flag.
enum class ProductPrecision { f32, bf16, fp16 };

/// The ProductPrecision of a weft::Precision<Param, ...>: its Param tag's.
template <class Prec>
inline constexpr ProductPrecision product_precision_v =
    std::is_same_v<typename Prec::param, BF16>   ? ProductPrecision::bf16
    : std::is_same_v<typename Prec::param, FP16> ? ProductPrecision::fp16
                                                 : ProductPrecision::f32;

/// "f32", "bf16" or "fp16".
inline const char* to_string(ProductPrecision p) {
  return p == ProductPrecision::bf16 ? "bf16" : p == ProductPrecision::fp16 ? "fp16" : "f32";
}

/// Value and gradient of one parameter, flat and contiguous (what optimizers
/// and gradient collectives want), with rank-2 views for the kernels.
template <class T, class Space>
class Parameter {
 public:
  /// A [rows, cols] parameter (vectors are [1, n]). `decay`: whether decoupled
  /// weight decay applies (matrices and embeddings yes; biases and norm scales no).
  Parameter(std::string name, std::size_t rows, std::size_t cols, bool decay)
      : name_(std::move(name)),
        rows_(rows),
        cols_(cols),
        decay_(decay),
        value(allocate_view<Kokkos::View<T*, Space>>(name_, rows * cols)),
        grad(allocate_view<Kokkos::View<T*, Space>>(name_ + ".grad", rows * cols)),
        global_rows_(rows),
        global_cols_(cols),
        bands_{GlobalBand{0, 0, rows, cols, 0}} {}

  /// A flat parameter over existing storage (a shard or a slice of a flat
  /// buffer, e.g. what a data-parallel strategy hands its optimizer).
  Parameter(std::string name, Kokkos::View<T*, Space> value_view, Kokkos::View<T*, Space> grad_view, bool decay)
      : name_(std::move(name)), rows_(1), cols_(value_view.extent(0)), decay_(decay), value(value_view), grad(grad_view),
        global_rows_(1), global_cols_(cols_), bands_{GlobalBand{0, 0, 1, cols_, 0}} {}

  /// The global parameter name, e.g. "blocks.3.attn.qkv.weight".
  const std::string& name() const { return name_; }
  /// Rows of the rank-2 shape.
  std::size_t rows() const { return rows_; }
  /// Columns of the rank-2 shape.
  std::size_t cols() const { return cols_; }
  /// Number of elements.
  std::size_t size() const { return rows_ * cols_; }
  /// Whether weight decay applies.
  bool decay() const { return decay_; }
  /// Whether each rank of the tensor-parallel axis holds a different shard of
  /// this parameter (column- or row-parallel weights, vocabulary shards);
  /// false for parameters every TP rank holds whole (norms, row-parallel
  /// biases). Gradient-norm clipping sums the squares of sharded parameters
  /// over the TP axis and counts replicated ones once.
  bool tp_sharded() const { return tp_sharded_; }
  /// Marks the parameter as sharded over the tensor-parallel axis (or not).
  void set_tp_sharded(bool on) { tp_sharded_ = on; }
  /// Whether each rank of the expert-parallel axis holds different tensors
  /// here (the routed experts of a MoE block split over EP): their gradients
  /// are summed over the ranks that hold the same experts (DP), not over the
  /// whole DP x EP group, and gradient-norm clipping sums their squares over EP.
  bool ep_sharded() const { return ep_sharded_; }
  /// Marks the parameter as one of this EP rank's own experts (or not).
  void set_ep_sharded(bool on) { ep_sharded_ = on; }
  /// The type every reader of the value rounds it to first: f32 (the
  /// default) when some reader takes the value as stored; bf16 or fp16 when
  /// the value is read only as the operand of 2-byte products (an
  /// nn::Linear weight under a 2-byte ProductPrecision), so that a copy
  /// rounded to that type gives every reader the same bits. Fully sharded
  /// data parallelism then gathers the parameter in 2 bytes
  /// (parallel::DataParallel). A layer that reads the value any other way
  /// must leave it at f32.
  ProductPrecision read_as() const { return read_as_; }
  /// Declares how the value is read (see read_as()).
  void set_read_as(ProductPrecision p) { read_as_ = p; }
  /// Rows of the whole (single-process) tensor this rank holds part of.
  std::size_t global_rows() const { return global_rows_; }
  /// Columns of the whole tensor.
  std::size_t global_cols() const { return global_cols_; }
  /// Where this rank's [rows, cols] lies in the whole [global_rows,
  /// global_cols] tensor (one band covering everything when it is whole).
  /// Checkpoints use it to write and read tensors by global indices.
  const std::vector<GlobalBand>& global_bands() const { return bands_; }
  /// Declares this rank's part of a [global_rows, global_cols] tensor; the
  /// bands must cover the local [rows, cols] exactly (layers that split a
  /// parameter call it).
  void set_global(std::size_t global_rows, std::size_t global_cols, std::vector<GlobalBand> bands) {
    std::size_t cover = 0;
    for (const auto& b : bands) {
      WEFT_REQUIRE(b.rows == rows_ && b.local_col0 + b.cols <= cols_ && b.row0 + b.rows <= global_rows &&
                       b.col0 + b.cols <= global_cols,
                   ConfigError, "nn::Parameter '", name_, "': band at global (", b.row0, ", ", b.col0, ") of ", b.rows,
                   " x ", b.cols, " does not fit the local ", rows_, " x ", cols_, " or the global ", global_rows, " x ",
                   global_cols, " shape");
      cover += b.cols;
    }
    WEFT_REQUIRE(cover == cols_, ConfigError, "nn::Parameter '", name_, "': bands cover ", cover, " of ", cols_,
                 " local columns");
    global_rows_ = global_rows;
    global_cols_ = global_cols;
    bands_ = std::move(bands);
  }
  /// The value as a [rows, cols] matrix.
  MatrixRef<T, Space> matrix() const { return MatrixRef<T, Space>(value.data(), rows_, cols_); }
  /// The gradient as a [rows, cols] matrix.
  MatrixRef<T, Space> grad_matrix() const { return MatrixRef<T, Space>(grad.data(), rows_, cols_); }

  /// A part of this parameter's value that this rank stores outside `value`:
  /// elements offset .. offset + values.extent(0) - 1 of the flat parameter.
  struct StoredPiece {
    std::size_t offset = 0;
    Kokkos::View<T*, Space> values;
  };
  /// Whether the parameter's value lives in pieces that a data-parallel
  /// strategy keeps (FullyShard: this rank's shard, the only copy between
  /// steps; `value` is empty then, or a gathered copy while the group runs).
  bool stored_in_pieces() const { return stored_in_pieces_; }
  /// The pieces this rank stores (none when it holds no part of this
  /// parameter's shard). Code that changes a parameter outside the optimizer
  /// (MoE::update_bias) writes every piece, and `value` too when it is whole.
  const std::vector<StoredPiece>& stored_pieces() const { return stored_pieces_; }
  /// Declares where this rank stores the parameter (a strategy that shards
  /// the values calls it once, with the pieces of this rank's shard).
  void set_stored_pieces(std::vector<StoredPiece> pieces) {
    stored_pieces_ = std::move(pieces);
    stored_in_pieces_ = true;
  }

 private:
  std::string name_;
  std::size_t rows_, cols_;
  bool decay_;
  bool tp_sharded_ = false;
  bool ep_sharded_ = false;
  ProductPrecision read_as_ = ProductPrecision::f32;
  bool stored_in_pieces_ = false;
  std::vector<StoredPiece> stored_pieces_;

 public:
  /// Flat value storage.
  Kokkos::View<T*, Space> value;
  /// Flat gradient storage; backward passes accumulate into it.
  Kokkos::View<T*, Space> grad;

 private:
  std::size_t global_rows_, global_cols_;
  std::vector<GlobalBand> bands_;
};

/// How a model is split over the tensor-parallel (TP) axis. A null
/// communicator (or one of size 1) is the single-process model.
struct TensorSplit {
  /// The TP axis' communicator (its rank is this rank's shard index).
  Comm* comm = nullptr;
  /// Sequence parallelism: between the TP matmuls (norms, residual adds)
  /// activations are split over the tokens; the all-reduces of plain TP become
  /// an all-gather before each column-parallel matmul and a reduce-scatter
  /// after each row-parallel one.
  bool sequence_parallel = false;
  /// Number of TP ranks (1 without a communicator).
  std::size_t size() const { return comm ? static_cast<std::size_t>(comm->size()) : 1; }
  /// This rank's TP index.
  std::size_t rank() const { return comm ? static_cast<std::size_t>(comm->rank()) : 0; }
  /// Whether the model is split at all (size > 1).
  bool active() const { return size() > 1; }
  /// Whether activations between the TP regions are split over tokens.
  bool sp() const { return active() && sequence_parallel; }
};

/// The context-parallel axis of a model: each sequence of T tokens is split
/// over its ranks in the causally balanced layout (weft::context::global_index:
/// rank r holds chunks r and 2·cp−1−r of 2·cp), so a rank's layers see T / cp
/// tokens per sequence. The weights are whole on every CP rank.
struct ContextSplit {
  /// The CP axis' communicator.
  Comm* comm = nullptr;
  /// Number of CP ranks (1 without a communicator).
  std::size_t size() const { return comm ? static_cast<std::size_t>(comm->size()) : 1; }
  /// This rank's CP index.
  std::size_t rank() const { return comm ? static_cast<std::size_t>(comm->rank()) : 0; }
  /// Whether the sequences are split at all (size > 1).
  bool active() const { return size() > 1; }
};

/// The expert-parallel split of a model's mixture-of-experts blocks. The
/// routed experts are split over `ep` (rank r holds experts r N/ep ..
/// (r+1) N/ep - 1); `data` is the group of ranks whose tokens form one
/// microbatch together: the DP and EP ranks, which hold different samples,
/// and the ranks that split each sample's tokens between them (the CP ranks,
/// and the TP ranks under sequence parallelism), whose tokens are more tokens
/// of the same microbatch to the experts. Capacity, drops, the balancing
/// losses and the statistics are computed over `data`, so that they are
/// those of the single process that holds the whole microbatch. Both null:
/// a single process (or a MoE model that is not split).
struct ExpertSplit {
  /// Value of sample_rank that means "data_rank() / token_shards".
  static constexpr std::size_t from_data_rank = std::size_t(-1);
  Comm* ep = nullptr;    ///< the EP axis
  Comm* data = nullptr;  ///< the ranks that share the microbatch (contains the EP axis)
  /// How many data ranks split each sample's tokens between them: cp, times
  /// tp under sequence parallelism (each routes its own tokens);
  /// data_size() / token_shards ranks hold different samples.
  std::size_t token_shards = 1;
  /// This rank's index among the data_size() / token_shards groups of ranks
  /// that hold different samples (its samples are sample_index() x batch ..
  /// of the whole microbatch); the capacity rule breaks score ties by the
  /// single-process token index it gives. nn::expert_split_of sets it from
  /// the mesh coordinates (DP coordinate x ep + EP coordinate);
  /// from_data_rank takes data_rank() / token_shards.
  std::size_t sample_rank = from_data_rank;
  /// See sample_rank.
  std::size_t sample_index() const { return sample_rank == from_data_rank ? data_rank() / token_shards : sample_rank; }
  /// Number of EP ranks (1 without a communicator).
  std::size_t ep_size() const { return ep ? static_cast<std::size_t>(ep->size()) : 1; }
  /// This rank's EP index.
  std::size_t ep_rank() const { return ep ? static_cast<std::size_t>(ep->rank()) : 0; }
  /// Number of ranks sharing the microbatch.
  std::size_t data_size() const { return data ? static_cast<std::size_t>(data->size()) : 1; }
  /// This rank's index among them (its tokens' offset in the microbatch, in microbatches).
  std::size_t data_rank() const { return data ? static_cast<std::size_t>(data->rank()) : 0; }
  /// Whether the experts are split (ep > 1).
  bool active() const { return ep_size() > 1; }
  /// Whether routing decisions are made over more than this rank's tokens.
  bool global() const { return data_size() > 1; }
};

/// Weight-gradient work that a backward pass postponed. Zero-bubble pipeline
/// schedules split a backward into its input-gradient half (on the critical
/// path) and its weight-gradient half (run later to fill idle time): while a
/// model's LayerContext points at a DeferredWork, its Linear layers compute only
/// their input gradient and queue their weight-gradient gemm here, with a copy
/// of the output gradient; run() does the queued work in order. The inputs the
/// queued work reads must stay unchanged until then, unless the queue is told
/// to keep copies of them (set_copy_inputs): a stage that recomputes its
/// blocks' forward in backward overwrites those inputs before the queue runs.
class DeferredWork {
 public:
  /// With true, each Linear that queues its weight gradient here also copies
  /// its input x into a buffer of this queue (take), and the queued gemm
  /// reads the copy. Off by default.
  void set_copy_inputs(bool on) { copy_inputs_ = on; }
  /// Whether queued work keeps copies of its inputs (set_copy_inputs).
  bool copies_inputs() const { return copy_inputs_; }
  /// Queues one piece of work.
  void push(std::function<void()> f) { work_.push_back(std::move(f)); }
  /// Runs every queued piece, oldest first, and forgets them; the buffers
  /// taken for them return to this queue's pool.
  void run() {
    for (auto& f : work_) f();
    clear();
  }
  /// Drops the queued work without running it (its buffers return to the pool).
  void clear() {
    work_.clear();
    for (auto& b : in_use_) spare_.push_back(std::move(b));
    in_use_.clear();
  }
  /// Number of queued pieces.
  std::size_t size() const { return work_.size(); }
  /// A rank-2 view of type V with the given extents for queued work to read:
  /// a pooled one of the same type and shape when there is one (contents
  /// undefined), else a new one. It stays in use until run() or clear().
  template <class V>
  V take(const std::string& label, std::size_t rows, std::size_t cols) {
    for (auto it = spare_.begin(); it != spare_.end(); ++it) {
      const V* v = std::any_cast<V>(&*it);
      if (!v || v->extent(0) != rows || v->extent(1) != cols) continue;
      V out = *v;
      spare_.erase(it);
      in_use_.emplace_back(out);
      return out;
    }
    V out(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), rows, cols);
    in_use_.emplace_back(out);
    bytes_ += rows * cols * sizeof(typename V::value_type);
    return out;
  }
  /// Bytes of every buffer this queue has taken so far (in use and pooled:
  /// it keeps them all).
  std::size_t bytes() const { return bytes_; }

 private:
  std::vector<std::function<void()>> work_;
  std::vector<std::any> in_use_, spare_;
  std::size_t bytes_ = 0;
  bool copy_inputs_ = false;
};


/// One layer's (or block's) copies of the activations its backward reads,
/// kept between its forward and its backward while the float tensors they
/// come from are a working set that every layer of the model shares.
///
/// keep(v, narrow) registers a contiguous view of T (float or double): a
/// narrow one is kept in the stash's 2-byte type (bf16 or fp16, rounded to
/// nearest even), the others (statistics that must stay fp32: norm means and
/// reciprocal deviations, log-sum-exps) in T. store() copies every registered
/// view into its copy; load() writes the copies back (widening exactly), so
/// after load() a narrow view holds its forward value rounded to 2 bytes and
/// every other one its forward value. Both run on Space without a fence, in
/// registration order, like weft::convert. bytes() is what the copies hold:
/// the only per-layer activation memory, since the views they come from are
/// shared.
template <class T, class Space>
class ActivationStash {
 public:
  /// A stash whose narrow copies are `prec`'s 2-byte type (bf16 or fp16; f32 is refused).
  explicit ActivationStash(ProductPrecision prec) : prec_(prec) {
    WEFT_REQUIRE(prec != ProductPrecision::f32, ConfigError,
                 "nn::ActivationStash: a stash keeps 2-byte copies; under fp32 products keep the float tensors");
  }
  /// Registers v (empty views are skipped); `label` names the copy.
  template <class V>
  void keep(const V& v, bool narrow, const std::string& label) {
    if (v.size() == 0) return;
    WEFT_REQUIRE(v.span_is_contiguous() && v.span() == v.size(), Error, "nn::ActivationStash: '", v.label(),
                 "' is not contiguous; a stash copies whole contiguous tensors");
    Entry e;
    e.source = Flat(v.data(), v.size());
    if (narrow)
      e.narrow = allocate_view<Kokkos::View<std::uint16_t*, Space>>(label + ".stash", v.size());
    else
      e.exact = allocate_view<Kokkos::View<T*, Space>>(label + ".stash", v.size());
    entries_.push_back(std::move(e));
  }
  /// Copies every registered view into its copy.
  void store() const {
    for (const auto& e : entries_) {
      if (e.exact.extent(0)) Kokkos::deep_copy(Exec(), e.exact, e.source);
      else if (prec_ == ProductPrecision::bf16) weft::convert(as<bf16>(e.narrow), e.source);
      else weft::convert(as<fp16>(e.narrow), e.source);
    }
  }
  /// Writes every copy back into its view.
  void load() const {
    for (const auto& e : entries_) {
      if (e.exact.extent(0)) Kokkos::deep_copy(Exec(), e.source, e.exact);
      else if (prec_ == ProductPrecision::bf16) weft::convert(e.source, as<bf16>(e.narrow));
      else weft::convert(e.source, as<fp16>(e.narrow));
    }
  }
  /// Bytes the copies hold.
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& e : entries_) b += e.narrow.extent(0) * sizeof(std::uint16_t) + e.exact.extent(0) * sizeof(T);
    return b;
  }

 private:
  using Flat = Kokkos::View<T*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using Exec = typename Flat::execution_space;
  struct Entry {
    Flat source;
    Kokkos::View<std::uint16_t*, Space> narrow;
    Kokkos::View<T*, Space> exact;
  };
  template <class H>
  static Kokkos::View<H*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> as(const Kokkos::View<std::uint16_t*, Space>& v) {
    return Kokkos::View<H*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(reinterpret_cast<H*>(v.data()), v.extent(0));
  }
  ProductPrecision prec_;
  std::vector<Entry> entries_;
};

/// Scratch memory the 2-byte products of one model share (ProductStaging<Space>):
/// the compute copy of a weight and the two operands, rounded to 2 bytes just
/// before a product. One per model, grown to the largest product; its bytes
/// are the "product staging" workspace of the memory ledger.
struct ProductStagingBase {
  virtual ~ProductStagingBase() = default;
  /// Bytes held.
  virtual std::size_t bytes() const = 0;
};

/// ProductStagingBase in the memory of Space: ten slots of 2-byte elements
/// (0: a weight's compute copy, 1 and 2: the Linear products' activation
/// operands; 3, 4 and 5: the attention's products' operands -- Q, K and V of
/// every head, the heads' output gradient, one head's probabilities or
/// their gradient; 6 and 7: the rows an nn::MoE sends and receives in its
/// expert-parallel all_to_allv; 8 and 9: the compute copies of the
/// parameters layers read outside their products, ComputeCopies).
template <class Space>
struct ProductStaging : ProductStagingBase {
  /// Slot s as a [rows, cols] matrix of H (weft::bf16 or weft::fp16), grown
  /// (without initialisation) when it holds fewer than rows x cols elements.
  /// Valid until the next call for the same slot.
  template <class H>
  MatrixRef<H, Space> matrix(int s, std::size_t rows, std::size_t cols) {
    static_assert(sizeof(H) == sizeof(std::uint16_t), "weft::nn::ProductStaging holds 2-byte elements");
    auto& v = slots_[s];
    if (v.extent(0) < rows * cols)
      v = allocate_view<Kokkos::View<std::uint16_t*, Space>>("product_staging." + std::to_string(s), rows * cols);
    return MatrixRef<H, Space>(reinterpret_cast<H*>(v.data()), rows, cols);
  }
  /// src (a rank-2 view) rounded once to H into slot s, grown as matrix() grows it.
  template <class H, class V>
  MatrixRef<H, Space> rounded(int s, const V& src) {
    auto m = matrix<H>(s, src.extent(0), src.extent(1));
    weft::convert(m, src);
    return m;
  }
  std::size_t bytes() const override {
    std::size_t b = 0;
    for (const auto& v : slots_) b += v.extent(0) * sizeof(std::uint16_t);
    return b;
  }

 private:
  Kokkos::View<std::uint16_t*, Space> slots_[10];
};

/// What every layer of one model shares: the profiler that kernel scopes
/// charge (null: no timing, no fences), the tensor-parallel split, where
/// weight-gradient gemms go when they are deferred (null: computed during
/// backward, the default), and the precision of the weight products.
struct LayerContext {
  metrics::Profiler* profiler = nullptr;
  TensorSplit tp;  ///< the TP axis (inactive: the single-process model)
  ContextSplit cp;    ///< the CP axis (inactive: every rank holds whole sequences)
  DeferredWork* deferred_weight_grads = nullptr;
  ExpertSplit ep;     ///< the EP axis and the microbatch's ranks (inactive: one process)
  /// The operand type of every nn::Linear product (f32: fp32 products, the
  /// default). With bf16 or fp16 the float weights and activations are
  /// rounded to 2 bytes just before each product, which accumulates in fp32
  /// and writes fp32; the layers read their other parameters as 2-byte
  /// compute copies (ComputeCopies); the masters, activations and gradients
  /// stay fp32.
  ProductPrecision products = ProductPrecision::f32;
  /// The 2-byte products' scratch (made by the first product that needs it).
  std::shared_ptr<ProductStagingBase> staging;
};

/// The model's product staging, made by the first product that needs it.
template <class Space>
ProductStaging<Space>& product_staging(LayerContext& ctx) {
  if (!ctx.staging) ctx.staging = std::make_shared<ProductStaging<Space>>();
  return static_cast<ProductStaging<Space>&>(*ctx.staging);
}

/// How a layer reads the parameters it uses outside its products (norm
/// scales and shifts, biases, position tables) under its context's
/// ProductPrecision: under f32 the parameter's value itself; under bf16 or
/// fp16 its compute copy, the value rounded to that type (to nearest even)
/// into the model's product staging (slot 8, and 9 for the second parameter
/// of a pair), made again at every read, so it cannot be stale whatever
/// changed the value (an optimizer step, an FSDP gather, a checkpoint load).
/// The layer declares such a parameter read_as() its product precision, so
/// every parameter of a 2-byte model is read as its 2-byte compute copy, as
/// serving does. A copy lives only for the call of f: the layers of a model
/// read their parameters one call at a time, so they share two slots of
/// the largest such parameter's size, which the memory ledger counts as
/// "product staging" (before, every layer kept copies of its own).
template <class Space>
class ComputeCopies {
 public:
  /// Calls f(v) with p's value as the layers of `ctx` compute with it:
  /// p.value (f32) or a 2-byte copy (a View<H*> of bf16 or fp16, valid
  /// during the call).
  template <class T, class F>
  void read(const Parameter<T, Space>& p, LayerContext& ctx, F&& f) const {
    if (ctx.products == ProductPrecision::bf16) f(rounded<bf16>(p, ctx, 8));
    else if (ctx.products == ProductPrecision::fp16) f(rounded<fp16>(p, ctx, 8));
    else f(p.value);
  }
  /// The same for two parameters at once (slots 8 and 9), f(a, b) with views of one type.
  template <class T, class F>
  void read(const Parameter<T, Space>& p, const Parameter<T, Space>& q, LayerContext& ctx, F&& f) const {
    if (ctx.products == ProductPrecision::bf16) f(rounded<bf16>(p, ctx, 8), rounded<bf16>(q, ctx, 9));
    else if (ctx.products == ProductPrecision::fp16) f(rounded<fp16>(p, ctx, 8), rounded<fp16>(q, ctx, 9));
    else f(p.value, q.value);
  }
  /// The same as a [rows, cols] matrix (p.matrix(), or a MatrixRef of the copy).
  template <class T, class F>
  void read_matrix(const Parameter<T, Space>& p, LayerContext& ctx, F&& f) const {
    if (ctx.products == ProductPrecision::bf16)
      f(MatrixRef<bf16, Space>(rounded<bf16>(p, ctx, 8).data(), p.rows(), p.cols()));
    else if (ctx.products == ProductPrecision::fp16)
      f(MatrixRef<fp16, Space>(rounded<fp16>(p, ctx, 8).data(), p.rows(), p.cols()));
    else f(p.matrix());
  }

 private:
  template <class H, class T>
  static Kokkos::View<H*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> rounded(const Parameter<T, Space>& p,
                                                                                  LayerContext& ctx, int slot) {
    auto m = product_staging<Space>(ctx).template matrix<H>(slot, 1, p.size());
    Kokkos::View<H*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(m.data(), p.size());
    weft::convert(h, p.value);
    return h;
  }
};

/// Called by a model around the forward and backward of each parameter group
/// (for the GPT: group l < L is block l, group L the root -- embeddings, final
/// norm, head). Strategies such as fully sharded data parallelism gather a
/// group's parameters before it runs and reduce its gradients after.
struct GroupHooks {
  virtual ~GroupHooks() = default;
  /// Before the group's parameters are read in forward.
  virtual void before_forward(std::size_t group) { (void)group; }
  /// After the group's forward.
  virtual void after_forward(std::size_t group) { (void)group; }
  /// Before the group's backward reads its parameters or writes its gradients.
  virtual void before_backward(std::size_t group) { (void)group; }
  /// After the group's gradients of this microbatch are complete.
  virtual void after_backward(std::size_t group) { (void)group; }
  /// After the group's deferred weight-gradient work has run for every
  /// microbatch of the step (a model whose backward is split calls it after
  /// the last weight half that touches the group; its weight gradients are
  /// complete only then, not at after_backward).
  virtual void after_weight_gradients(std::size_t group) { (void)group; }
};

/// A shared context handle: the model owns it, its layers keep a copy.
using ContextPtr = std::shared_ptr<LayerContext>;

namespace detail {
template <class V>
std::size_t bytes_of(const V& v) {
  return v.span() * sizeof(typename V::value_type);
}
/// Records a parameter's value and gradient in a ledger.
template <class T, class Space>
void account(metrics::MemoryLedger& m, const Parameter<T, Space>& p) {
  m.add(metrics::MemoryCategory::parameters, p.name(), bytes_of(p.value));
  m.add(metrics::MemoryCategory::gradients, p.name(), bytes_of(p.grad));
}
}  // namespace detail

}  // namespace weft::nn
