// The shape of a GPT and its checks. Field names follow train_gpt's flags
// (--layers, --d-model, --heads, ...) and every check names the flag, the value
// seen and what would be valid, so a bad command line reads as a sentence.
#pragma once

#include <cstdint>
#include <string>

#include <weft/core/error.hpp>
#include <weft/nn/norm.hpp>

namespace weft::nn {

/// The MLP of a block: GPT-2's GELU (tanh form) or SwiGLU.
enum class MlpKind { gelu, swiglu };
/// Positions: GPT-2's learned absolute table, or rotary (RoPE) in attention.
enum class PositionKind { learned, rotary };
/// The kernel nn::Attention runs over whole sequences (context parallelism
/// always runs the blockwise one): per-head BLAS products around stored
/// [T, T] probabilities, the blockwise kernel (ops/flash_attention.hpp, no
/// [T, T] buffers), or automatic: BLAS -- on CPUs the faster one at every
/// length measured (docs/model.md) -- unless one block's probabilities would
/// take more than GPTConfig::attention_budget bytes.
enum class AttentionKernel { automatic, blas, blockwise };
/// How a mixture-of-experts router turns its logits into scores: softmax
/// over the experts, or an independent sigmoid per expert (DeepSeek-V3).
enum class RouterKind { softmax, sigmoid };

/// A GPT's hyper-parameters. The defaults are GPT-2 shaped: learned positions,
/// LayerNorm with affine parameters, Linear with bias, a 4*D GELU MLP, no
/// dropout, an untied LM head without bias.
struct GPTConfig {
  std::size_t layers = 4;      ///< --layers: transformer blocks
  std::size_t d_model = 256;   ///< --d-model: residual width D
  std::size_t heads = 8;       ///< --heads: query heads H (divides D)
  std::size_t kv_heads = 0;    ///< --kv-heads: key/value heads (0: = heads; fewer: grouped-query attention)
  std::size_t seq = 128;       ///< --seq: tokens per sequence T (and the position table's length)
  std::size_t batch = 8;       ///< sequences per forward pass (a microbatch)
  std::size_t vocab = 256;     ///< --vocab: V
  std::size_t ffn_hidden = 0;  ///< MLP hidden width (0: 4*D for GELU, 8*D/3 rounded up to a multiple of 8 for SwiGLU)
  NormKind norm = NormKind::layernorm;
  MlpKind mlp = MlpKind::gelu;
  PositionKind position = PositionKind::learned;
  double norm_eps = 1e-5;
  double init_std = 0.02;      ///< std of weights; residual projections get init_std / sqrt(2 * layers)
  double rope_base = 10000.0;
  bool recompute = false;      ///< activation checkpointing: keep only each block's input, recompute the rest
  AttentionKernel attention = AttentionKernel::automatic;  ///< --attention: the kernel over whole sequences
  /// AttentionKernel::automatic's limit: the blockwise kernel once one
  /// block's [batch x heads, T, T] probabilities (per TP rank) exceed it.
  double attention_budget = 1073741824.0;
  std::uint64_t seed = 1234;   ///< --seed: initialisation (with parameter names and global indices)
  /// Context parallelism: seq is this rank's share, 1 / seq_shards, of every
  /// sequence (the balanced layout of vocabulary/context_policy.hpp). Set by
  /// the model through local_sequence, never by a user: 1 is whole sequences.
  std::size_t seq_shards = 1;

  // Mixture of experts (nn/moe.hpp, docs/moe.md). experts == 0: every block is dense.
  std::size_t experts = 0;         ///< --experts: routed experts N of a MoE block (0: no MoE)
  std::size_t top_k = 2;           ///< --top-k: experts each token is sent to
  double capacity_factor = 0;      ///< --capacity-factor: C = ceil(factor * tokens * k / N) slots per expert; 0: dropless
  RouterKind router = RouterKind::softmax;  ///< --router: softmax or sigmoid scores
  bool normalize_gates = true;     ///< gates are the top-k scores divided by their sum (false: the raw scores)
  double aux_loss = 0;             ///< --aux-loss: alpha of the Switch load-balancing loss alpha N sum_e f_e P_e
  double z_loss = 0;               ///< --z-loss: beta of the router z-loss beta mean_t (logsumexp_e u_te)^2
  double bias_balance = 0;         ///< --bias-balance: gamma of the aux-loss-free selection-bias update (0: off)
  std::size_t moe_every = 1;       ///< --moe-every: block l is a MoE block when (l + 1) % moe_every == 0
  std::size_t shared_experts = 0;  ///< dense experts every token passes through besides the routed ones
  std::size_t expert_hidden = 0;   ///< hidden width of each expert (0: hidden())

  /// Whether block l replaces its MLP by a mixture of experts.
  bool moe_block(std::size_t l) const { return experts > 0 && (l + 1) % moe_every == 0; }
  /// Number of MoE blocks.
  std::size_t moe_blocks() const {
    std::size_t n = 0;
    for (std::size_t l = 0; l < layers; ++l) n += moe_block(l) ? 1 : 0;
    return n;
  }
  /// Whether no token is ever dropped (capacity_factor == 0).
  bool dropless() const { return capacity_factor == 0; }
  /// Hidden width of one expert.
  std::size_t expert_width() const { return expert_hidden ? expert_hidden : hidden(); }

  /// Features per head.
  std::size_t head_dim() const { return d_model / heads; }
  /// Key/value heads actually used.
  std::size_t kv() const { return kv_heads ? kv_heads : heads; }
  /// Columns of the fused QKV projection: D queries + 2 * kv * head_dim.
  std::size_t qkv_cols() const { return d_model + 2 * kv() * head_dim(); }
  /// MLP hidden width actually used.
  std::size_t hidden() const {
    if (ffn_hidden) return ffn_hidden;
    if (mlp == MlpKind::gelu) return 4 * d_model;
    return (8 * d_model / 3 + 7) / 8 * 8;
  }
  /// Tokens per forward pass.
  std::size_t tokens() const { return batch * seq; }

  /// Throws ConfigError naming the flag for anything that cannot build a model.
  void validate() const {
    auto positive = [](std::size_t v, const char* flag) {
      WEFT_REQUIRE(v > 0, ConfigError, flag, " is ", v, "; expected a positive integer");
    };
    positive(layers, "--layers");
    positive(d_model, "--d-model");
    positive(heads, "--heads");
    positive(seq, "--seq");
    positive(batch, "--batch");
    positive(vocab, "--vocab");
    WEFT_REQUIRE(d_model % heads == 0, ConfigError, "--heads ", heads, " does not divide --d-model ", d_model,
                 "; choose heads among the divisors of d-model (e.g. --heads ", d_model % 8 == 0 ? 8 : 1, ")");
    WEFT_REQUIRE(kv_heads == 0 || (kv_heads <= heads && heads % kv_heads == 0), ConfigError, "--kv-heads ", kv_heads,
                 " must divide --heads ", heads, " (each key/value head serves a whole group of query heads)");
    WEFT_REQUIRE(position != PositionKind::rotary || head_dim() % 2 == 0, ConfigError,
                 "rotary positions need an even head dimension, but --d-model ", d_model, " / --heads ", heads, " = ",
                 head_dim());
    WEFT_REQUIRE(attention_budget >= 0, ConfigError, "attention_budget is ", attention_budget,
                 "; expected the bytes of probabilities above which the blockwise kernel runs (>= 0)");
    if (experts > 0) {
      WEFT_REQUIRE(top_k >= 1 && top_k <= experts, ConfigError, "--top-k ", top_k, " must be between 1 and --experts ",
                   experts);
      WEFT_REQUIRE(capacity_factor >= 0, ConfigError, "--capacity-factor is ", capacity_factor,
                   "; expected a positive factor, or --dropless");
      WEFT_REQUIRE(moe_every >= 1, ConfigError, "--moe-every is 0; expected a positive integer (1: every block)");
      WEFT_REQUIRE(aux_loss >= 0 && z_loss >= 0 && bias_balance >= 0, ConfigError, "--aux-loss (", aux_loss,
                   "), --z-loss (", z_loss, ") and --bias-balance (", bias_balance, ") must be >= 0");
    }
    WEFT_REQUIRE(norm_eps > 0 && init_std > 0, ConfigError, "norm_eps (", norm_eps, ") and init_std (", init_std,
                 ") must be positive");
  }

  /// The sizes of one tensor-parallel rank's part of the heads and the MLP:
  /// heads, key/value heads, the heads' width (d_model / tp) and the MLP
  /// hidden width divided by tp. The layers size their activations from it;
  /// d_model here is the width of the local heads, not the residual width.
  GPTConfig local(std::size_t tp) const {
    GPTConfig c = *this;
    c.ffn_hidden = hidden() / tp;
    c.kv_heads = kv() / tp;
    c.heads = heads / tp;
    c.d_model = d_model / tp;
    return c;
  }

  /// The sequence length of the whole sequences this config's tokens belong to.
  std::size_t global_seq() const { return seq * seq_shards; }

  /// The config of one context-parallel rank's share of every sequence: seq
  /// / cp tokens per sequence, seq_shards = cp. The layers size their
  /// activations from it; the position table keeps global_seq() rows.
  GPTConfig local_sequence(std::size_t cp) const {
    GPTConfig c = *this;
    c.seq = seq / cp;
    c.seq_shards = seq_shards * cp;
    return c;
  }

  /// The tensor-parallel sizes this model can be split into: tp must divide
  /// the query heads, the key/value heads, d_model, the MLP hidden width and
  /// the vocabulary (and, with sequence parallelism, the tokens of a
  /// microbatch).
  std::string valid_tp_sizes(bool sequence_parallel) const {
    std::string s;
    for (std::size_t t = 1; t <= heads; ++t)
      if (heads % t == 0 && kv() % t == 0 && d_model % t == 0 && hidden() % t == 0 && vocab % t == 0 &&
          (!sequence_parallel || tokens() % t == 0)) {
        if (!s.empty()) s += ", ";
        s += std::to_string(t);
      }
    return s;
  }

  /// Throws ConfigError unless the model splits evenly over tp ranks. Each
  /// message names the quantity, its value, tp and the TP sizes that would
  /// be valid: weft never pads or truncates a split dimension.
  void validate_tensor_parallel(std::size_t tp, bool sequence_parallel) const {
    WEFT_REQUIRE(tp > 0, ConfigError, "tensor parallelism: tp is 0; expected a positive integer");
    if (tp == 1) return;
    auto check = [&](std::size_t v, const char* what) {
      WEFT_REQUIRE(v % tp == 0, ConfigError, "tensor parallelism: ", what, " ", v, " is not divisible by tp ", tp,
                   " (each TP rank takes an equal share; weft does not pad or truncate). TP sizes valid for this "
                   "model: ", valid_tp_sizes(sequence_parallel));
    };
    check(heads, "the query heads (--heads)");
    check(kv(), "the key/value heads (--kv-heads)");
    check(d_model, "d_model (--d-model)");
    check(hidden(), "the MLP hidden size");
    check(vocab, "the vocabulary (--vocab)");
    if (sequence_parallel) check(tokens(), "the tokens of a microbatch (sequences x --seq, sequence parallelism)");
  }

  /// N, the parameters that take part in matrix products (QKV, attention
  /// output, MLP and LM head; not embeddings, biases or norms). For the
  /// default GPT-2 shape N = 12 L D^2 + D V. A MoE block counts the weights
  /// one token meets (k routed experts, the shared experts, the router), so
  /// 6 N stays the FLOPs per token.
  double matmul_params() const {
    const double d = double(d_model), f = double(hidden());
    const double mlp_w = mlp == MlpKind::gelu ? 2 * d * f : 3 * d * f;
    // A MoE block's active weights per token: its k routed experts, the shared experts and the router.
    const double fe = double(expert_width());
    const double expert_w = mlp == MlpKind::gelu ? 2 * d * fe : 3 * d * fe;
    const double moe_w = double(top_k + shared_experts) * expert_w + d * double(experts);
    const double nm = double(moe_blocks());
    return double(layers) * (d * double(qkv_cols()) + d * d) + (double(layers) - nm) * mlp_w + nm * moe_w +
           d * double(vocab);
  }
  /// Model FLOPs per token of one training step (forward + backward):
  /// 6 N for the weight products plus 12 L T D for attention scores and
  /// values (causal masking not discounted, as is conventional).
  double flops_per_token() const {
    return 6 * matmul_params() + 12.0 * double(layers) * double(seq) * double(d_model);
  }
};

}  // namespace weft::nn
