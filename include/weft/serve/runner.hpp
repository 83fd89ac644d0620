// The inference forward pass of the reference GPT over a block KV cache:
// one pass takes a flat batch of tokens from any number of requests, each
// token with its request's block table and its position, so prefill chunks
// and single-token decodes of different requests run in the same matmuls
// (the ragged batch continuous batching needs). It reads the weights of an
// nn::GPTModel -- the training model, from its seed or from a checkpoint
// loaded into it -- and, when the model's layer policy is tensor-parallel,
// runs split as training does: heads, their KV cache, the MLP and the
// vocabulary sharded over TP, one all-reduce after each row-parallel
// product, and the vocabulary-split logits gathered for sampling. A block
// with a mixture of experts (GPTConfig::experts) routes each token to its
// top-k experts by the training router's rule, dropless (docs/serving.md);
// its experts are whole on every TP rank, as in training.
//
// Precision: under weft::Precision<BF16> (or FP16) the runner serves a float
// model from a 2-byte copy of its weights, made once at construction, and
// keeps its KV cache in 2 bytes; activations, norm statistics, attention
// statistics, rotary angles and the logits stay float (docs/serving.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/nn/gpt.hpp>
#include <weft/ops/elementwise.hpp>
#include <weft/ops/embedding.hpp>
#include <weft/ops/gemm.hpp>
#include <weft/ops/norm.hpp>
#include <weft/precision/convert.hpp>
#include <weft/precision/policy.hpp>
#include <weft/serve/decode.hpp>
#include <weft/serve/kv_cache.hpp>

namespace weft::serve {

/// One forward pass's tokens, on the host: token n of the batch is
/// tokens[n] at position positions[n] of sequence seqs[n], whose KV blocks
/// are block_tables[seqs[n]]. A sequence's tokens in a batch are consecutive
/// and in position order; their keys and values are written to the cache
/// before attention, so a token attends to its own sequence's positions
/// 0..positions[n] (causal), cached or in the batch.
struct StepBatch {
  std::vector<int> tokens;                     ///< token ids
  std::vector<int> positions;                  ///< position of each token in its sequence
  std::vector<int> seqs;                       ///< index into block_tables of each token
  std::vector<std::vector<int>> block_tables;  ///< per sequence: its blocks, in position order
  std::vector<int> logit_rows;                 ///< tokens whose next-token logits are wanted

  /// Appends tokens [first, first + count) of `ids` of a sequence with `table` (its blocks);
  /// with `want_last` the logits after its last token are wanted.
  void add(const std::vector<int>& ids, std::size_t first, std::size_t count, const std::vector<int>& table,
           bool want_last) {
    const int s = int(block_tables.size());
    block_tables.push_back(table);
    for (std::size_t i = first; i < first + count; ++i) {
      tokens.push_back(ids[i]);
      positions.push_back(int(i));
      seqs.push_back(s);
    }
    if (want_last) logit_rows.push_back(int(tokens.size()) - 1);
  }
};

/// Bytes of a serving rank by category (those of plan::InferenceBudget).
struct ServeMemory {
  std::size_t weights = 0;    ///< parameter values
  std::size_t kv_cache = 0;   ///< keys and values of every layer, the whole pool
  std::size_t workspace = 0;  ///< activations of one pass and its logits
  std::size_t buffers = 0;    ///< tensor-parallel gather buffer, batch descriptors
  /// Sum of the categories.
  std::size_t total() const { return weights + kv_cache + workspace + buffers; }
};

/// The element type in which a serving runner for a model of type T under
/// precision policy Prec (a weft::Precision) stores its weights and its KV
/// cache: T itself when the policy's parameters are F32 (the default
/// Precision<>: the model's own values, read in place, so a double model
/// serves in double), otherwise the policy's 2-byte param_type (weft::bf16
/// or weft::fp16).
template <class T, class Prec>
using serve_param_t = std::conditional_t<std::is_same_v<typename Prec::param, F32>, T, typename Prec::param_type>;

/// The reference GPT's inference pass over a KV cache of `blocks` blocks of
/// `block_size` tokens. T, Space and LayerPolicy are the model's: with
/// weft::TensorParallel<...> the runner is split over the model's TP axis
/// (every TP rank must run the same batches, in the same order). Prec, a
/// weft::Precision, says what the weights and the KV cache are stored in
/// (serve_param_t): Precision<> reads the model's weights in place; with
/// Precision<BF16> (a float model) the runner keeps a bf16 copy of every
/// parameter, rounded to nearest even once at construction, and a bf16 KV
/// cache, and computes in float: the products widen the 2-byte weights in
/// registers (ops::gemm_few_rows), norms, softmax and rotary keep float
/// statistics, and the logits are float.
template <class T, class Space = Kokkos::DefaultExecutionSpace, class LayerPolicy = NoPolicy,
          class Prec = Precision<>>
class ModelRunner {
 public:
  /// The model whose weights this runner reads.
  using Model = nn::GPTModel<T, Space, LayerPolicy>;
  /// The element type of the weights and the KV cache as served.
  using Param = serve_param_t<T, Prec>;
  static_assert(std::is_same_v<Param, T> || std::is_same_v<T, float>,
                "weft::serve::ModelRunner<T, Space, LayerPolicy, Precision<BF16 or FP16>>: 2-byte serving takes a "
                "float model (T = float) and rounds its weights once; serve a double model with weft::Precision<>");
  /// A row-major matrix on the model's space (activations, in T).
  using Mat = ops::Matrix<T, Space>;
  /// Logits on the host, [rows, vocab].
  using HostLogits = Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace>;

  /// A runner over `model`'s weights (kept by reference: they must outlive
  /// the runner) with a cache of `blocks` x `block_size` tokens, for passes
  /// of at most `max_tokens` tokens of at most `max_seqs` sequences, with
  /// the logits of at most `max_logit_rows` tokens (0: max_seqs, one per
  /// sequence, what generation needs). Throws ConfigError for a model with
  /// context parallelism, or zero sizes.
  ModelRunner(Model& model, std::size_t blocks, std::size_t block_size, std::size_t max_tokens, std::size_t max_seqs,
              std::size_t max_logit_rows = 0)
      : cfg_(model.config()),
        tp_(model.tensor_parallel()),
        l_(cfg_.local(tp_.size())),
        max_tokens_(max_tokens),
        max_seqs_(max_seqs),
        max_logit_rows_(max_logit_rows ? max_logit_rows : max_seqs),
        max_blocks_per_seq_(blocks_for(cfg_.seq, block_size)),
        cache_(cfg_.layers, blocks, block_size, l_.kv() * cfg_.head_dim()) {
    WEFT_REQUIRE(!model.context_parallel().active(), ConfigError,
                 "serve::ModelRunner: serving over a context-parallel axis is not supported; build the model without CP");
    WEFT_REQUIRE(max_tokens > 0 && max_seqs > 0, ConfigError, "serve::ModelRunner: max_tokens (", max_tokens,
                 ") and max_seqs (", max_seqs, ") must be positive");
    // Every parameter as served: the model's own values, or their 2-byte copy (one rounding each).
    for (auto* p : model.parameters()) {
      Weight w;
      w.rows = p->rows();
      w.cols = p->cols();
      if constexpr (std::is_same_v<Param, T>)
        w.value = p->value;
      else
        w.value = converted<Param>(p->value, "serve.weights." + p->name());
      weight_bytes_ += p->size() * sizeof(Param);
      weights_.emplace(p->name(), std::move(w));
    }
    if constexpr (!std::is_same_v<Param, T>) Kokkos::fence();  // the copies are complete before the first pass
    auto get = [&](const std::string& n) -> const Weight* {
      auto it = weights_.find(n);
      return it == weights_.end() ? nullptr : &it->second;
    };
    // A weight the runner cannot serve without: its absence is an error naming it.
    auto need = [&](const std::string& n) {
      auto* w = get(n);
      WEFT_REQUIRE(w != nullptr, ConfigError, "serve::ModelRunner: the model has no parameter '", n,
                   "' on this rank", cfg_.experts > 0 && n.find(".experts.") != std::string::npos
                                          ? " (serving needs every expert on every rank: build the model without expert parallelism)"
                                          : "");
      return w;
    };
    auto expert = [&](const std::string& p) {
      return ExpertWeights{need(p + ".up.weight"), need(p + ".up.bias"), need(p + ".down.weight"), need(p + ".down.bias")};
    };
    tok_ = get("tok_emb.weight");
    pos_ = get("pos_emb.weight");
    for (std::size_t b = 0; b < cfg_.layers; ++b) {
      const std::string p = "blocks." + std::to_string(b) + ".";
      const bool moe = cfg_.moe_block(b);
      const bool ln = cfg_.norm == nn::NormKind::layernorm;
      blocks_.push_back({need(p + "ln1.weight"), ln ? need(p + "ln1.bias") : nullptr, need(p + "attn.qkv.weight"),
                         need(p + "attn.qkv.bias"), need(p + "attn.proj.weight"), get(p + "attn.proj.bias"),
                         need(p + "ln2.weight"), ln ? need(p + "ln2.bias") : nullptr,
                         moe ? ExpertWeights{} : expert(p + "mlp"), -1});
      if (moe) {
        MoEWeights m;
        m.router = need(p + "mlp.router.weight");
        m.bias = need(p + "mlp.router.expert_bias");
        for (std::size_t e = 0; e < cfg_.experts; ++e) m.experts.push_back(expert(p + "mlp.experts." + std::to_string(e)));
        for (std::size_t i = 0; i < cfg_.shared_experts; ++i) m.shared.push_back(expert(p + "mlp.shared." + std::to_string(i)));
        blocks_.back().moe = int(moe_.size());
        moe_.push_back(std::move(m));
      }
    }
    lnf_w_ = get("ln_f.weight");
    lnf_b_ = get("ln_f.bias");
    if (!moe_.empty()) {
      const std::size_t slots = max_tokens * cfg_.top_k, ecols = cfg_.expert_width() * (cfg_.mlp == nn::MlpKind::swiglu ? 2 : 1);
      moe_logits_ = Mat("serve.moe_logits", max_tokens, cfg_.experts);
      moe_in_ = Mat("serve.moe_in", slots, cfg_.d_model);
      moe_out_ = Mat("serve.moe_out", slots, cfg_.d_model);
      moe_up_ = Mat("serve.moe_up", slots, ecols);
      moe_act_ = Mat("serve.moe_act", slots, cfg_.expert_width());
      moe_row_token_ = ops::Tokens<Space>("serve.moe_row_token", slots);
      moe_slot_row_ = ops::Tokens<Space>("serve.moe_slot_row", slots);
      moe_row_gate_ = ops::Vector<T, Space>("serve.moe_row_gate", slots);
      // Host sides of the routing, allocated once (a mirror is the view itself on a host space).
      moe_logits_h_ = Kokkos::create_mirror_view(moe_logits_);
      moe_row_token_h_ = Kokkos::create_mirror_view(moe_row_token_);
      moe_slot_row_h_ = Kokkos::create_mirror_view(moe_slot_row_);
      moe_row_gate_h_ = Kokkos::create_mirror_view(moe_row_gate_);
    }
    head_ = get("lm_head.weight");
    WEFT_REQUIRE(tok_ && head_ && lnf_w_, Error, "serve::ModelRunner: the model lacks its embedding, final norm or head");
    const std::size_t N = max_tokens, D = cfg_.d_model, up_cols = l_.hidden() * (cfg_.mlp == nn::MlpKind::swiglu ? 2 : 1);
    x_ = Mat("serve.residual", N, D);
    h_ = Mat("serve.norm_out", N, D);
    out_ = Mat("serve.block_out", N, D);
    qkv_ = Mat("serve.qkv", N, l_.qkv_cols());
    if (cfg_.moe_blocks() < cfg_.layers) {  // some block has a dense MLP
      up_ = Mat("serve.mlp_up", N, up_cols);
      act_ = Mat("serve.mlp_act", N, l_.hidden());
    }
    mean_ = ops::Vector<T, Space>("serve.norm_mean", N);
    rstd_ = ops::Vector<T, Space>("serve.norm_rstd", N);
    ids_ = ops::Tokens<Space>("serve.ids", N);
    posv_ = ops::Tokens<Space>("serve.positions", N);
    seqv_ = ops::Tokens<Space>("serve.seqs", N);
    rows_ = ops::Tokens<Space>("serve.logit_rows", N);
    tables_ = Kokkos::View<int**, Kokkos::LayoutRight, Space>("serve.block_tables", max_seqs, max_blocks_per_seq_);
    const std::size_t R = max_logit_rows_;
    hl_ = Mat("serve.logit_hidden", R, D);
    hn_ = Mat("serve.logit_norm_out", R, D);
    logits_local_ = Mat("serve.logits_local", R, cfg_.vocab / tp_.size());
    if (tp_.active()) logits_full_ = Mat("serve.logits_gathered", R, cfg_.vocab);
    // Kept across passes: a host view allocated per pass would be an allocation (and a fill) in every decode step.
    host_logits_ = HostLogits(Kokkos::view_alloc(Kokkos::WithoutInitializing, "serve.logits"), R, cfg_.vocab);
  }

  /// The model's configuration (whole model, as built).
  const nn::GPTConfig& config() const { return cfg_; }
  /// The KV cache (this rank's key/value heads).
  const KVCache<Param, Space>& cache() const { return cache_; }
  /// Tokens per KV block.
  std::size_t block_size() const { return cache_.block_size; }
  /// Blocks in the KV cache.
  std::size_t blocks() const { return cache_.blocks(); }
  /// Most tokens of one pass.
  std::size_t max_tokens() const { return max_tokens_; }
  /// Most sequences of one pass.
  std::size_t max_seqs() const { return max_seqs_; }

  /// Bytes this runner uses on this rank, by the categories of
  /// plan::InferenceBudget: the parameter values as served (weights: the
  /// model's own under Precision<>, the 2-byte copy otherwise; the training
  /// model's gradients and activations, and under a 2-byte precision its
  /// float values, are not counted: serving never reads them), the KV cache, one pass's activations and logits
  /// (workspace), and the tensor-parallel logits gather and batch
  /// descriptors (buffers).
  ServeMemory memory() const {
    ServeMemory m;
    m.weights = weight_bytes_;
    m.kv_cache = cache_.bytes();
    for (const Mat* v : {&x_, &h_, &out_, &qkv_, &up_, &act_, &hl_, &hn_, &logits_local_, &moe_logits_, &moe_in_,
                         &moe_out_, &moe_up_, &moe_act_})
      m.workspace += nn::detail::bytes_of(*v);
    m.workspace += nn::detail::bytes_of(moe_row_token_) + nn::detail::bytes_of(moe_slot_row_) +
                   nn::detail::bytes_of(moe_row_gate_);
    m.workspace += nn::detail::bytes_of(mean_) + nn::detail::bytes_of(rstd_);
    m.buffers = nn::detail::bytes_of(logits_full_) + nn::detail::bytes_of(tables_) + 4 * nn::detail::bytes_of(ids_) +
                nn::detail::bytes_of(host_logits_);
    return m;
  }
  /// Bytes of the parameter values as served on this rank (Param elements).
  std::size_t weight_bytes() const { return weight_bytes_; }
  /// Bytes of the KV cache on this rank.
  std::size_t kv_bytes() const { return cache_.bytes(); }

  /// Runs batch b: writes its tokens' keys and values into their blocks and
  /// returns the logits [b.logit_rows.size(), vocab] of the wanted tokens,
  /// whole on every TP rank: the first rows of a host buffer the runner keeps,
  /// so they are valid until the next forward (copy them to keep them). Throws ShapeError for a batch over the limits
  /// or a position beyond the context, and for token ids outside the vocabulary.
  HostLogits forward(const StepBatch& b) {
    const std::size_t N = b.tokens.size(), S = b.block_tables.size(), R = b.logit_rows.size();
    WEFT_REQUIRE(N > 0 && N <= max_tokens_ && S <= max_seqs_ && R <= N && R <= max_logit_rows_, ShapeError, "serve::ModelRunner: a pass of ", N,
                 " tokens of ", S, " sequences (", R, " logit rows); the runner takes 1..", max_tokens_, " tokens of at most ",
                 max_seqs_, " sequences and ", max_logit_rows_, " logit rows");
    upload(b);
    const std::size_t D = cfg_.d_model;
    auto rows = [&](const Mat& m, std::size_t n) { return Kokkos::subview(m, std::make_pair(std::size_t(0), n), Kokkos::ALL); };
    auto x = rows(x_, N), h = rows(h_, N), out = rows(out_, N), qkv = rows(qkv_, N), up = rows(up_, up_.extent(0) ? N : 0),
         act = rows(act_, act_.extent(0) ? N : 0);
    // The heads' outputs [N, D / tp] live in the norm output's storage, free once QKV has read it.
    Kokkos::View<T**, Kokkos::LayoutRight, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> heads(h_.data(), N, l_.d_model);
    auto mean = Kokkos::subview(mean_, std::make_pair(std::size_t(0), N));
    auto rstd = Kokkos::subview(rstd_, std::make_pair(std::size_t(0), N));
    auto ids = Kokkos::subview(ids_, std::make_pair(std::size_t(0), N));
    // Embedding, as nn::Embedding: token rows (vocabulary-split and summed over TP), then positions.
    if (!tp_.active()) {
      ops::embedding_forward(tok_->matrix(), ids, x);
    } else {
      ops::vocab_embedding_forward(tok_->matrix(), ids, tp_.rank() * (cfg_.vocab / tp_.size()), cfg_.vocab, x);
      tp_.comm->all_reduce(x);
    }
    if (pos_) add_positions(x, N);
    for (std::size_t l = 0; l < cfg_.layers; ++l) {
      const auto& w = blocks_[l];
      norm(x, w.ln1_w, w.ln1_b, h, mean, rstd);
      ops::gemm_few_rows(h, w.qkv_w->matrix(), qkv);
      ops::bias_add(qkv, w.qkv_b->value);
      if (cfg_.position == nn::PositionKind::rotary) rotate(qkv, N);
      store_kv(qkv, l, N);
      attend(qkv, l, heads, N);
      row_parallel(heads, *w.proj_w, w.proj_b, out);
      ops::add(out, out, x);  // the residual stream between attention and MLP (Block's `mid`)
      norm(out, w.ln2_w, w.ln2_b, h, mean, rstd);
      if (w.moe >= 0) {
        moe_forward(moe_[std::size_t(w.moe)], h, x, N);
      } else {
        mlp_up(h, w.mlp, up, act);
        row_parallel(act, *w.mlp.down_w, w.mlp.down_b, x);
      }
      ops::add(x, x, out);
    }
    HostLogits result = Kokkos::subview(host_logits_, std::make_pair(std::size_t(0), R), Kokkos::ALL);
    if (R == 0) return result;
    auto hl = rows(hl_, R), hn = rows(hn_, R);
    {
      const auto src = x_;
      const auto rv = rows_;
      Kokkos::parallel_for(
          "weft::serve::gather_rows", Kokkos::RangePolicy<typename Space::execution_space>(0, R * D),
          KOKKOS_LAMBDA(std::size_t i) { hl(i / D, i % D) = src(std::size_t(rv(i / D)), i % D); });
    }
    norm(hl, lnf_w_, lnf_b_, hn, Kokkos::subview(mean_, std::make_pair(std::size_t(0), R)),
         Kokkos::subview(rstd_, std::make_pair(std::size_t(0), R)));
    auto local = rows(logits_local_, R);
    ops::gemm_few_rows(hn, head_->matrix(), local);
    if (!tp_.active()) {
      Kokkos::deep_copy(result, local);
    } else {
      auto full = rows(logits_full_, R);
      const std::size_t Vl = cfg_.vocab / tp_.size();
      tp_.comm->all_gather(local, full, BlockLayout{R, Vl, cfg_.vocab});
      Kokkos::deep_copy(result, full);
    }
    return result;
  }

 private:
  // One parameter as served: its values in Param, and its [rows, cols] shape.
  struct Weight {
    Kokkos::View<Param*, Space> value;
    std::size_t rows = 0, cols = 0;
    nn::MatrixRef<Param, Space> matrix() const { return nn::MatrixRef<Param, Space>(value.data(), rows, cols); }
  };
  struct ExpertWeights {  // a dense MLP's (or one expert's) weights
    const Weight *up_w = nullptr, *up_b = nullptr, *down_w = nullptr, *down_b = nullptr;
  };
  struct MoEWeights {  // a mixture-of-experts block's router, selection bias and experts
    const Weight *router = nullptr, *bias = nullptr;
    std::vector<ExpertWeights> experts, shared;
  };
  struct BlockWeights {
    const Weight *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *ln2_w, *ln2_b;
    ExpertWeights mlp;  // a dense block's MLP
    int moe;            // index into moe_ of a MoE block; -1: dense
  };
  // act = activation(h up + b): GELU, or SwiGLU of the gate | value halves (as nn::MLP).
  template <class HV, class UV, class AV>
  void mlp_up(const HV& h, const ExpertWeights& w, const UV& up, const AV& act) const {
    ops::gemm_few_rows(h, w.up_w->matrix(), up);
    if (cfg_.mlp == nn::MlpKind::gelu) {
      ops::bias_gelu_forward(up, w.up_b->value, act);
    } else {
      ops::bias_add(up, w.up_b->value);
      ops::swiglu_forward(up, act);
    }
  }

  // One expert (whole on this rank: no TP reduction) on `in`, rows [a, b) of
  // the grouped buffers: their up-projection, activation and output.
  template <class IV>
  void expert_rows(const ExpertWeights& w, const IV& in, std::size_t a, std::size_t b) const {
    if (a == b) return;  // an expert no token chose
    const auto r = std::make_pair(a, b);
    auto up = Kokkos::subview(moe_up_, r, Kokkos::ALL);
    auto act = Kokkos::subview(moe_act_, r, Kokkos::ALL);
    auto o = Kokkos::subview(moe_out_, r, Kokkos::ALL);
    mlp_up(in, w, up, act);
    ops::gemm_few_rows(act, w.down_w->matrix(), o);
    ops::bias_add(o, w.down_b->value);
  }

  // Routing on the host, as nn::MoE's route() for one token: scores
  // (softmax over the experts or a sigmoid each, in double), the top k of
  // score + selection bias with ties to the lower expert, gates the chosen
  // scores (over their sum unless normalize_gates is off). Dropless: each
  // token's choices depend on its own logits alone, never on its batch.
  // Fills the grouped-row maps (rows by expert, tokens ascending within an
  // expert) and returns each expert's first row, [experts + 1].
  std::vector<std::size_t> route(const MoEWeights& m, std::size_t n) {
    const std::size_t E = cfg_.experts, K = cfg_.top_k;
    const auto first = [](std::size_t k) { return std::make_pair(std::size_t(0), k); };
    const auto lh = moe_logits_h_;
    Kokkos::deep_copy(Kokkos::subview(lh, first(n), Kokkos::ALL), Kokkos::subview(moe_logits_, first(n), Kokkos::ALL));
    auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m.bias->value);  // [experts], small
    const bool softmax = cfg_.router == nn::RouterKind::softmax;
    std::vector<int> choice(n * K), order(E);
    std::vector<double> gate(n * K), p(E), key(E);
    std::vector<std::size_t> offsets(E + 1, 0);
    for (std::size_t t = 0; t < n; ++t) {
      double mx = -std::numeric_limits<double>::infinity();
      for (std::size_t e = 0; e < E; ++e) mx = std::max(mx, double(lh(t, e)));
      double se = 0;
      for (std::size_t e = 0; e < E; ++e) se += std::exp(double(lh(t, e)) - mx);
      const double lse = mx + std::log(se);
      for (std::size_t e = 0; e < E; ++e) {
        const double u = double(lh(t, e));
        p[e] = softmax ? std::exp(u - lse) : 1.0 / (1.0 + std::exp(-u));
        key[e] = p[e] + double(ops::detail::load<accumulation_t<Param>>(bh(e)));
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + long(K), order.end(),
                        [&](int a, int b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
      double gsum = 0;
      for (std::size_t q = 0; q < K; ++q) gsum += p[std::size_t(order[q])];
      for (std::size_t q = 0; q < K; ++q) {
        const std::size_t e = std::size_t(order[q]);
        choice[t * K + q] = int(e);
        gate[t * K + q] = cfg_.normalize_gates ? p[e] / gsum : p[e];
        ++offsets[e + 1];
      }
    }
    for (std::size_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    const auto row_token = moe_row_token_h_;
    const auto slot_row = moe_slot_row_h_;
    const auto row_gate = moe_row_gate_h_;
    std::vector<std::size_t> next(offsets.begin(), offsets.end() - 1);
    for (std::size_t t = 0; t < n; ++t)  // tokens ascending: each expert's rows in token order
      for (std::size_t q = 0; q < K; ++q) {
        const std::size_t r = next[std::size_t(choice[t * K + q])]++;
        row_token(r) = int(t);
        row_gate(r) = T(gate[t * K + q]);
        slot_row(t * K + q) = int(r);
      }
    const auto slots = first(n * K);  // only this pass's rows travel
    Kokkos::deep_copy(Kokkos::subview(moe_row_token_, slots), Kokkos::subview(row_token, slots));
    Kokkos::deep_copy(Kokkos::subview(moe_slot_row_, slots), Kokkos::subview(slot_row, slots));
    Kokkos::deep_copy(Kokkos::subview(moe_row_gate_, slots), Kokkos::subview(row_gate, slots));
    return offsets;
  }

  // y = the block's mixture of experts of h ([n, D]): router, dropless top-k
  // routing, one gemm chain per expert on its rows, the gate-weighted sum in
  // choice order, then the shared experts (nn::MoE::forward's order of sums).
  template <class HV, class YV>
  void moe_forward(const MoEWeights& m, const HV& h, const YV& y, std::size_t n) {
    auto logits = Kokkos::subview(moe_logits_, std::make_pair(std::size_t(0), n), Kokkos::ALL);
    ops::gemm_few_rows(h, m.router->matrix(), logits);
    const auto offsets = route(m, n);
    moe_gather(h, offsets[cfg_.experts]);
    for (std::size_t e = 0; e < cfg_.experts; ++e) {
      const auto r = std::make_pair(offsets[e], offsets[e + 1]);
      expert_rows(m.experts[e], Kokkos::subview(moe_in_, r, Kokkos::ALL), r.first, r.second);
    }
    moe_combine(y, n);
    const auto first = std::make_pair(std::size_t(0), n);
    for (const auto& w : m.shared) {  // every token through each shared expert, added after the routed sum
      expert_rows(w, h, 0, n);        // (the grouped buffers' first n rows are free once combined)
      ops::add(y, y, Kokkos::subview(moe_out_, first, Kokkos::ALL));
    }
  }

  void upload(const StepBatch& b) {
    const std::size_t N = b.tokens.size();
    auto put = [&](const ops::Tokens<Space>& dst, const std::vector<int>& src) {
      auto hm = Kokkos::create_mirror_view(dst);
      for (std::size_t i = 0; i < src.size(); ++i) hm(i) = src[i];
      Kokkos::deep_copy(dst, hm);
    };
    for (std::size_t i = 0; i < N; ++i)
      WEFT_REQUIRE(b.positions[i] >= 0 && std::size_t(b.positions[i]) < cfg_.seq && b.seqs[i] >= 0 &&
                       std::size_t(b.seqs[i]) < b.block_tables.size() &&
                       std::size_t(b.positions[i]) < b.block_tables[std::size_t(b.seqs[i])].size() * cache_.block_size,
                   ShapeError, "serve::ModelRunner: token ", i, " at position ", b.positions[i],
                   " lies outside the context of ", cfg_.seq, " tokens or outside its sequence's blocks");
    put(ids_, b.tokens);
    put(posv_, b.positions);
    put(seqv_, b.seqs);
    put(rows_, b.logit_rows);
    auto ht = Kokkos::create_mirror_view(tables_);
    for (std::size_t s = 0; s < b.block_tables.size(); ++s) {
      WEFT_REQUIRE(b.block_tables[s].size() <= max_blocks_per_seq_, ShapeError, "serve::ModelRunner: sequence ", s,
                   " holds ", b.block_tables[s].size(), " blocks; a context of ", cfg_.seq, " tokens needs at most ",
                   max_blocks_per_seq_);
      for (std::size_t j = 0; j < b.block_tables[s].size(); ++j) ht(s, j) = b.block_tables[s][j];
    }
    Kokkos::deep_copy(tables_, ht);
  }

  template <class XV, class YV, class MV>
  void norm(const XV& x, const Weight* w, const Weight* b, const YV& y, const MV& mean,
            const MV& rstd) const {
    if (cfg_.norm == nn::NormKind::layernorm)
      ops::layernorm_forward(x, w->value, b->value, T(cfg_.norm_eps), y, mean, rstd);
    else
      ops::rmsnorm_forward(x, w->value, T(cfg_.norm_eps), y, rstd);
  }

  // out = in W (+ b), the partial sums of a row-parallel product joined over TP first (as detail::row_parallel_forward).
  template <class XV, class OV>
  void row_parallel(const XV& in, const Weight& w, const Weight* b, const OV& out) const {
    ops::gemm_few_rows(in, w.matrix(), out);
    if (tp_.active()) tp_.comm->all_reduce(out);
    if (b) ops::bias_add(out, b->value);
  }

 public:
  // Internal, not part of the API: the kernels of a step. They are public
  // only because nvcc refuses extended (KOKKOS_LAMBDA) lambdas inside private
  // or protected member functions; call forward() instead.

  /// Internal: row r of the grouped expert input is h(token of row r, :), for the first `rows` rows.
  template <class HV>
  void moe_gather(const HV& h, std::size_t rows) const {
    const auto in = moe_in_;
    const auto rt = moe_row_token_;
    const std::size_t D = cfg_.d_model;
    Kokkos::parallel_for(
        "weft::serve::moe_gather", Kokkos::RangePolicy<typename Space::execution_space>(0, rows * D),
        KOKKOS_LAMBDA(std::size_t i) { in(i / D, i % D) = h(std::size_t(rt(i / D)), i % D); });
  }

  /// Internal: y(t, :) = sum over token t's k choices, in choice order, of gate x expert output.
  template <class YV>
  void moe_combine(const YV& y, std::size_t n) const {
    const auto o = moe_out_;
    const auto sr = moe_slot_row_;
    const auto g = moe_row_gate_;
    const std::size_t D = cfg_.d_model, K = cfg_.top_k;
    Kokkos::parallel_for(
        "weft::serve::moe_combine", Kokkos::RangePolicy<typename Space::execution_space>(0, n * D),
        KOKKOS_LAMBDA(std::size_t i) {
          const std::size_t t = i / D, j = i % D;
          T acc = 0;
          for (std::size_t q = 0; q < K; ++q) {
            const std::size_t r = std::size_t(sr(t * K + q));
            acc += g(r) * o(r, j);
          }
          y(t, j) = acc;
        });
  }

  /// Internal: x(i, :) += P(position of token i, :) for the N tokens of the step.
  template <class XV>
  void add_positions(const XV& x, std::size_t N) const {
    const auto P = pos_->matrix();
    const auto pv = posv_;
    const std::size_t D = cfg_.d_model;
    Kokkos::parallel_for(
        "weft::serve::positions", Kokkos::RangePolicy<typename Space::execution_space>(0, N * D),
        KOKKOS_LAMBDA(std::size_t i) { x(i / D, i % D) += ops::detail::load<T>(P(std::size_t(pv(i / D)), i % D)); });
  }

  /// Internal: where this pass's tokens sit in the cache, and the heads of a qkv row on this rank.
  DecodeTokens<Space> decode_tokens(std::size_t N) const { return {posv_, seqv_, tables_, N}; }
  DecodeHeads decode_heads() const { return {cfg_.head_dim(), l_.heads, l_.kv(), l_.d_model}; }

  /// Internal: rotary positions of this rank's query and key heads at each
  /// token's own position (serve::decode_rotary).
  template <class QV>
  void rotate(const QV& qkv, std::size_t N) const {
    decode_rotary(qkv, decode_tokens(N), decode_heads(), cfg_.rope_base);
  }

  /// Internal: writes each token's keys and values (this rank's key/value heads) into its block slot.
  template <class QV>
  void store_kv(const QV& qkv, std::size_t layer, std::size_t N) const {
    decode_store_kv(qkv, decode_tokens(N), decode_heads(), cache_.k, cache_.v, layer);
  }

  /// Internal: causal attention of each token's query heads over its
  /// sequence's cached keys and values (serve::decode_attention).
  template <class QV, class HV>
  void attend(const QV& qkv, std::size_t layer, const HV& heads, std::size_t N) const {
    decode_attention(qkv, decode_tokens(N), decode_heads(), cache_.k, cache_.v, layer, heads);
  }

 private:
  nn::GPTConfig cfg_;
  nn::TensorSplit tp_;
  nn::GPTConfig l_;  // this rank's heads and MLP width
  std::size_t max_tokens_, max_seqs_, max_logit_rows_, max_blocks_per_seq_;
  KVCache<Param, Space> cache_;
  std::map<std::string, Weight> weights_;  // every parameter by name (node-based: the pointers below stay valid)
  const Weight *tok_ = nullptr, *pos_ = nullptr, *lnf_w_ = nullptr, *lnf_b_ = nullptr, *head_ = nullptr;
  std::vector<BlockWeights> blocks_;
  std::vector<MoEWeights> moe_;  // the MoE blocks' weights
  Mat moe_logits_, moe_in_, moe_out_, moe_up_, moe_act_;  // a MoE block's router logits and grouped rows
  ops::Tokens<Space> moe_row_token_, moe_slot_row_;
  ops::Vector<T, Space> moe_row_gate_;
  typename Mat::HostMirror moe_logits_h_;
  typename ops::Tokens<Space>::HostMirror moe_row_token_h_, moe_slot_row_h_;
  typename ops::Vector<T, Space>::HostMirror moe_row_gate_h_;
  std::size_t weight_bytes_ = 0;
  Mat x_, h_, out_, qkv_, up_, act_, hl_, hn_, logits_local_, logits_full_;
  HostLogits host_logits_;  // forward's result rows (the logits' host copy)
  ops::Vector<T, Space> mean_, rstd_;
  ops::Tokens<Space> ids_, posv_, seqv_, rows_;
  Kokkos::View<int**, Kokkos::LayoutRight, Space> tables_;
};

}  // namespace weft::serve
