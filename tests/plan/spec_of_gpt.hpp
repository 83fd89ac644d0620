// The planner's description of a weft GPT, for the tests that compare the
// planner's figures with what nn::GPT allocates and communicates. It lives on
// the test side because the planner (weft/plan) must not include
// nn/config.hpp, which pulls in Kokkos.
#pragma once

#include <cstddef>

#include <weft/nn/config.hpp>
#include <weft/plan/model.hpp>

namespace weft::test {

/// The plan::ModelSpec of GPT config c trained with `microbatches`
/// microbatches of c.batch sequences per step over all ranks (global_batch =
/// c.batch * microbatches); every other field the planner reads from the
/// shape (layers, widths, heads, MLP, norm, positions, recompute) is c's; the
/// rest keeps ModelSpec's defaults (biases, 4-byte elements, AdamW), as the
/// tests train nn::GPT<float> with AdamW.
inline plan::ModelSpec spec_of(const nn::GPTConfig& c, std::size_t microbatches = 1) {
  plan::ModelSpec m;
  m.layers = c.layers;
  m.d_model = c.d_model;
  m.heads = c.heads;
  m.kv_heads = c.kv_heads;
  m.ffn_hidden = c.ffn_hidden;
  m.seq = c.seq;
  m.micro_batch = c.batch;
  m.global_batch = c.batch * microbatches;
  m.vocab = c.vocab;
  m.recompute = c.recompute;
  m.mlp = c.mlp == nn::MlpKind::swiglu ? plan::Mlp::swiglu : plan::Mlp::gelu;
  m.layernorm = c.norm == nn::NormKind::layernorm;
  m.learned_positions = c.position == nn::PositionKind::learned;
  return m;
}

}  // namespace weft::test
