// The planner's inference budget for a serving engine: the plan::ModelSpec
// of a GPTConfig and the plan::ServeSpec of an engine's sizes, so the memory
// a ModelRunner measures can be checked against plan::inference_memory, in
// the element widths of its precision (ServeBytes, serve_bytes).
#pragma once

#include <weft/nn/config.hpp>
#include <weft/plan/memory.hpp>
#include <weft/serve/engine.hpp>

namespace weft::serve {

/// Bytes of one element of each thing a serving runner stores, as the
/// planner counts them (plan::ModelSpec::param_bytes and act_bytes,
/// plan::ServeSpec::kv_bytes).
struct ServeBytes {
  std::size_t weights = 4;      ///< a parameter value as served
  std::size_t kv_cache = 4;     ///< a cached key or value element
  std::size_t activations = 4;  ///< an element of one pass's activations
};

/// The element widths of ModelRunner<T, Space, LayerPolicy, Prec>: weights
/// and KV cache in serve_param_t<T, Prec> (2 bytes under Precision<BF16>),
/// activations in T (the logits are float in the planner whatever T is).
template <class T, class Prec = Precision<>>
constexpr ServeBytes serve_bytes() {
  return {sizeof(serve_param_t<T, Prec>), sizeof(serve_param_t<T, Prec>), sizeof(T)};
}

/// The planner's description of model c, its weights b.weights and its
/// activations b.activations bytes wide.
inline plan::ModelSpec model_spec(const nn::GPTConfig& c, const ServeBytes& b) {
  plan::ModelSpec m;
  m.layers = c.layers;
  m.d_model = c.d_model;
  m.heads = c.heads;
  m.kv_heads = c.kv_heads;
  m.ffn_hidden = c.ffn_hidden;
  m.experts = c.experts;  // the planner's MoE: every block, experts of the MLP's width
  m.top_k = c.top_k;
  m.shared_experts = c.shared_experts;
  m.seq = c.seq;
  m.micro_batch = 1;
  m.global_batch = 1;
  m.vocab = c.vocab;
  m.mlp = c.mlp == nn::MlpKind::swiglu ? plan::Mlp::swiglu : plan::Mlp::gelu;
  m.layernorm = c.norm == nn::NormKind::layernorm;
  m.learned_positions = c.position == nn::PositionKind::learned;
  m.param_bytes = b.weights;
  m.act_bytes = b.activations;
  return m;
}

/// The planner's description of model c, every element `bytes` wide.
inline plan::ModelSpec model_spec(const nn::GPTConfig& c, std::size_t bytes = 4) {
  return model_spec(c, ServeBytes{bytes, bytes, bytes});
}

/// What an engine of sizes e serves, as the planner reads it: max_seqs
/// sequences sharing a pool of blocks x block_size tokens (the planner's
/// batch x context is the pool's tokens), prefill chunks of the token budget.
inline plan::ServeSpec serve_spec(const EngineConfig& e, std::size_t kv_bytes = 4) {
  plan::ServeSpec q;
  q.batch = e.max_seqs;
  q.context = (e.blocks * e.block_size + e.max_seqs - 1) / e.max_seqs;
  q.kv_bytes = kv_bytes;
  q.prefill_chunk = e.token_budget;
  return q;
}

/// plan::inference_memory of model c split over tp, for engine sizes e and
/// element widths b, without headroom: what ModelRunner::memory() measures
/// (for a runner under Precision<BF16>, b = serve_bytes<float, Precision<BF16>>():
/// 2-byte weights and KV cache, float activations).
inline plan::InferenceBudget planned_memory(const nn::GPTConfig& c, std::size_t tp, const EngineConfig& e,
                                            const ServeBytes& b) {
  return plan::inference_memory(model_spec(c, b), tp, 1, serve_spec(e, b.kv_cache), 0.0);
}

/// planned_memory with every element `bytes` wide (4: a float runner under Precision<>).
inline plan::InferenceBudget planned_memory(const nn::GPTConfig& c, std::size_t tp, const EngineConfig& e,
                                            std::size_t bytes = 4) {
  return planned_memory(c, tp, e, ServeBytes{bytes, bytes, bytes});
}

}  // namespace weft::serve
