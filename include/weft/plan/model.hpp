// The planner's description of a transformer (shape, precision, optimizer,
// recompute) and of a parallel layout (mesh sizes and data-parallel mode).
// Plain C++: the planner runs without Kokkos or MPI being initialised.
#pragma once

#include <cstddef>
#include <string>

#include <weft/core/error.hpp>
#include <weft/vocabulary/dp_mode.hpp>
#include <weft/plan/pipeline.hpp>

namespace weft::plan {

/// The optimizer whose state a budget counts.
enum class Optimizer { adamw, sgd };
/// The MLP form: GELU (two matrices) or a gated one (SwiGLU, three matrices).
enum class Mlp { gelu, swiglu };
/// How the data-parallel axis holds parameters, gradients and optimizer state.
using DPMode = parallel::DPMode;
using parallel::to_string;

/// How attention runs over a sequence split across cp > 1 ranks (the
/// variants of weft::Context<Ring | AllGather | AllToAll>): K/V blocks passed
/// round a ring, K/V all-gathered, or heads exchanged all-to-all.
enum class ContextKind { ring, allgather, alltoall };
/// The variant's command-line name: ring, allgather or alltoall.
inline const char* to_string(ContextKind k) {
  return k == ContextKind::ring ? "ring" : k == ContextKind::allgather ? "allgather" : "alltoall";
}
/// The variant of a command-line name; ConfigError naming the choices otherwise.
inline ContextKind parse_context_name(const std::string& s) {
  if (s == "ring") return ContextKind::ring;
  if (s == "allgather") return ContextKind::allgather;
  if (s == "alltoall") return ContextKind::alltoall;
  ::weft::detail::throw_error<ConfigError>("context variant \"", s, "\": expected ring, allgather or alltoall");
}

/// A model's shape and training precision. Defaults describe weft's own GPT
/// in fp32 (biases, LayerNorm, learned positions, untied head, AdamW).
struct ModelSpec {
  std::string name = "model";      ///< for tables and records
  std::size_t layers = 4;          ///< transformer blocks L
  std::size_t d_model = 256;       ///< residual width D
  std::size_t heads = 8;           ///< query heads H
  std::size_t kv_heads = 0;        ///< key/value heads (0: = heads)
  std::size_t ffn_hidden = 0;      ///< MLP hidden width F (0: 4 D for GELU, 8D/3 rounded up to 8 for SwiGLU)
  std::size_t vocab = 256;         ///< V
  std::size_t experts = 0;         ///< MoE experts per block (0: dense)
  std::size_t top_k = 2;           ///< experts a token visits (MoE only)
  std::size_t shared_experts = 0;  ///< dense experts every token passes through besides the routed ones (MoE only)
  std::size_t seq = 128;           ///< tokens per sequence T
  std::size_t micro_batch = 8;     ///< sequences per forward pass on one rank
  std::size_t global_batch = 8;    ///< sequences per optimizer step, all ranks
  Mlp mlp = Mlp::gelu;
  bool bias = true;                ///< linear layers have biases
  bool layernorm = true;           ///< LayerNorm (scale and shift) or RMSNorm (scale)
  bool learned_positions = true;   ///< a [T, D] position table (false: rotary)
  bool flash_attention = false;    ///< attention keeps no [T, T] probabilities (weft's GPT does keep them)
  std::size_t param_bytes = 4;     ///< bytes per parameter element as computed with
  std::size_t grad_bytes = 4;      ///< bytes per gradient element
  std::size_t optim_bytes = 4;     ///< bytes per optimizer-state element
  std::size_t master_bytes = 0;    ///< bytes of a master copy of the weights (mixed precision: 4; none: 0)
  std::size_t act_bytes = 4;       ///< bytes per activation element
  /// Bytes per element of the activations kept for backward (0: act_bytes):
  /// every block's input, and a dense block's saved tensors. weft's GPT under
  /// a 2-byte Precision without recompute computes in fp32 (act_bytes 4) and
  /// keeps 2-byte copies (saved_bytes 2) in one process's layout (pp = 1):
  /// its norms' statistics and log-sum-exps stay act_bytes, one block's
  /// tensors at act_bytes are a working set all blocks share (a temporary
  /// buffer), and mixture-of-experts blocks keep act_bytes (docs/plan.md).
  std::size_t saved_bytes = 0;
  /// Bytes of the operands weft's 2-byte products stage (0: none). weft's
  /// GPT under a 2-byte Precision keeps float weights and activations and
  /// rounds each product's operands into three grown slots of that width
  /// (nn::ProductStaging: the weight, the input, the output gradient), a
  /// temporary buffer (docs/plan.md).
  std::size_t product_bytes = 0;
  Optimizer optimizer = Optimizer::adamw;
  bool sgd_momentum = true;        ///< SGD keeps a momentum buffer
  bool recompute = false;          ///< keep only block inputs; recompute the rest in backward

  /// Key/value heads actually used.
  std::size_t kv() const { return kv_heads ? kv_heads : heads; }
  /// Features per head.
  std::size_t head_dim() const { return d_model / heads; }
  /// Columns of the fused QKV projection.
  std::size_t qkv_cols() const { return d_model + 2 * kv() * head_dim(); }
  /// MLP hidden width actually used (the same rule as nn::GPTConfig).
  std::size_t hidden() const {
    if (ffn_hidden) return ffn_hidden;
    return mlp == Mlp::gelu ? 4 * d_model : (8 * d_model / 3 + 7) / 8 * 8;
  }
  /// Columns of the MLP's up-projection (gate and value side by side for SwiGLU).
  std::size_t up_cols() const { return hidden() * (mlp == Mlp::swiglu ? 2 : 1); }
  /// Experts per block as a count of MLPs (a dense block has one).
  std::size_t mlps() const { return experts ? experts : 1; }
  /// MLPs one token passes through in a block: top_k routed experts and the
  /// shared ones in a MoE block, the one MLP in a dense block.
  std::size_t mlp_passes() const { return experts ? top_k + shared_experts : 1; }

  /// Attention parameters of one block (matrices and biases).
  std::size_t attention_params() const {
    return d_model * qkv_cols() + d_model * d_model + (bias ? qkv_cols() + d_model : 0);
  }
  /// Parameters of one MLP (one expert).
  std::size_t mlp_params() const {
    return d_model * up_cols() + hidden() * d_model + (bias ? up_cols() + d_model : 0);
  }
  /// Norm parameters of one block (two norms) or of the final norm (one).
  std::size_t norm_params(std::size_t norms) const { return norms * d_model * (layernorm ? 2 : 1); }
  /// Router weights of one block ([D, E], MoE only).
  std::size_t router_params() const { return experts ? d_model * experts : 0; }
  /// Parameters of one block.
  std::size_t block_params() const {
    return attention_params() + (mlps() + (experts ? shared_experts : 0)) * mlp_params() + norm_params(2) +
           router_params();
  }
  /// Parameters outside the blocks: embeddings, final norm, LM head.
  std::size_t root_params() const {
    return vocab * d_model + (learned_positions ? seq * d_model : 0) + norm_params(1) + d_model * vocab;
  }
  /// All parameters.
  std::size_t total_params() const { return layers * block_params() + root_params(); }
  /// Parameters one token's forward touches in matrix products (top-k experts only).
  std::size_t active_matmul_params() const {
    const std::size_t per_block = d_model * qkv_cols() + d_model * d_model +
                                  mlp_passes() * (d_model * up_cols() + hidden() * d_model) +
                                  router_params();
    return layers * per_block + d_model * vocab;
  }
  /// Of active_matmul_params(), the experts' (top-k routed and the shared
  /// ones in each block; 0 in a dense model).
  std::size_t active_expert_params() const {
    return experts ? layers * mlp_passes() * (d_model * up_cols() + hidden() * d_model) : 0;
  }
  /// Training FLOPs per token of the experts alone (the part of
  /// train_flops_per_token() that weft does not split over tp: routed and
  /// shared experts are TP-replicated).
  double expert_train_flops_per_token() const {
    const double x = double(active_expert_params());
    return 6.0 * x + (recompute ? 2.0 * x : 0.0);
  }
  /// Training FLOPs per token: 6 per active weight plus attention's 12 L T D
  /// (docs/model.md); recompute adds one more forward (2 per weight + 4 L T D).
  double train_flops_per_token() const {
    const double n = double(active_matmul_params()), attn = 12.0 * double(layers) * double(seq) * double(d_model);
    return 6.0 * n + attn + (recompute ? 2.0 * n + attn / 3.0 : 0.0);
  }
  /// Optimizer-state bytes per parameter element (moments and master copy).
  std::size_t optimizer_bytes_per_param() const {
    const std::size_t moments = optimizer == Optimizer::adamw ? 2 : (sgd_momentum ? 1 : 0);
    return moments * optim_bytes + master_bytes;
  }

  /// Throws ConfigError naming the field for a shape that cannot be a model.
  void validate() const {
    auto positive = [](std::size_t v, const char* field) {
      WEFT_REQUIRE(v > 0, ConfigError, "model field \"", field, "\" is ", v, "; expected a positive integer");
    };
    positive(layers, "layers");
    positive(d_model, "d_model");
    positive(heads, "heads");
    positive(vocab, "vocab");
    positive(seq, "seq");
    positive(micro_batch, "micro_batch");
    positive(global_batch, "global_batch");
    positive(param_bytes, "param_bytes");
    positive(grad_bytes, "grad_bytes");
    positive(act_bytes, "act_bytes");
    WEFT_REQUIRE(d_model % heads == 0, ConfigError, "model field \"heads\" is ", heads, ", which does not divide d_model ",
                 d_model, "; choose a divisor of d_model");
    WEFT_REQUIRE(heads % kv() == 0, ConfigError, "model field \"kv_heads\" is ", kv(), ", which does not divide heads ",
                 heads, "; choose a divisor of heads");
    WEFT_REQUIRE(!experts || (top_k >= 1 && top_k <= experts), ConfigError, "model field \"top_k\" is ", top_k,
                 "; expected 1..experts (", experts, ")");
  }
};

/// A parallel layout: world = dp * tp * pp * cp; ep experts-parallel ranks
/// are folded into dp (ep divides dp). microbatches = global_batch / (dp * micro_batch).
struct MeshSpec {
  std::size_t dp = 1;  ///< data-parallel ranks
  std::size_t tp = 1;  ///< tensor-parallel ranks (Megatron: heads and MLP hidden split, vocabulary split)
  std::size_t pp = 1;  ///< pipeline stages (layers split)
  std::size_t cp = 1;  ///< context-parallel ranks (sequence split)
  std::size_t ep = 1;  ///< expert-parallel ranks, a divisor of dp
  DPMode mode = DPMode::replicate;
  /// Sequence parallelism (with tp > 1): norms and residuals on token shards;
  /// each column-parallel matmul keeps its all-gathered input for backward.
  bool sequence_parallel = false;
  /// The pipeline schedule (with pp > 1): it sets how many microbatches'
  /// activations each stage holds, the point-to-point volume and the bubble.
  Schedule schedule = Schedule::one_f_one_b;
  std::size_t chunks = 1;  ///< virtual stages per rank (interleaved only)
  /// The context-parallel attention (with cp > 1): it sets the CP traffic,
  /// the K/V buffers and what attention keeps for backward.
  ContextKind context = ContextKind::ring;
  /// Number of ranks.
  std::size_t world() const { return dp * tp * pp * cp; }
  /// The factor sequence parallelism divides the residual stream's tokens
  /// by: tp with sequence parallelism over tp > 1, else 1.
  double sequence_split() const { return sequence_parallel && tp > 1 ? double(tp) : 1.0; }
};

}  // namespace weft::plan
