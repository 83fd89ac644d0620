// The planner's inference budget for a serving engine: the plan::ModelSpec
// of a GPTConfig and the plan::ServeSpec of an engine's sizes, so the memory
// a ModelRunner measures can be checked against plan::inference_memory.
#pragma once

#include <weft/nn/config.hpp>
#include <weft/plan/memory.hpp>
#include <weft/serve/engine.hpp>

namespace weft::serve {

/// The planner's description of model c, its elements `bytes` wide.
inline plan::ModelSpec model_spec(const nn::GPTConfig& c, std::size_t bytes = 4) {
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
  m.param_bytes = m.act_bytes = bytes;
  return m;
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

/// plan::inference_memory of model c split over tp, for engine sizes e, without headroom.
inline plan::InferenceBudget planned_memory(const nn::GPTConfig& c, std::size_t tp, const EngineConfig& e,
                                            std::size_t bytes = 4) {
  plan::ServeSpec q = serve_spec(e, bytes);
  return plan::inference_memory(model_spec(c, bytes), tp, 1, q, 0.0);
}

}  // namespace weft::serve
