// The tiny model and token stream the parallel tests train: small enough for
// 8 ranks on 2 cores under a sanitizer, wide enough to split over tp = 2 and
// to cut into pipeline stages; the single-process loss curve the parallel
// runs are held to, the relative error they are compared by, and the loop
// over the data-parallel policies.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <weft/data/stream.hpp>
#include <weft/nn/config.hpp>
#include <weft/nn/gpt.hpp>
#include <weft/optim/optim.hpp>
#include <weft/optim/train_step.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::test {

/// `layers` blocks, D = 16, 2 heads, T = 8, V = 32, seed 7 (GPT-2 shaped:
/// GELU, learned positions, LayerNorm). `llama`: 4 query heads over 2
/// key/value heads, SwiGLU, rotary positions, RMSNorm.
inline nn::GPTConfig tiny_gpt(std::size_t layers, std::size_t microbatch, bool llama = false) {
  nn::GPTConfig c;
  c.layers = layers;
  c.d_model = 16;
  c.heads = 2;
  c.seq = 8;
  c.vocab = 32;
  c.batch = microbatch;
  c.seed = 7;
  if (llama) {
    c.heads = 4;
    c.kv_heads = 2;
    c.mlp = nn::MlpKind::swiglu;
    c.position = nn::PositionKind::rotary;
    c.norm = nn::NormKind::rmsnorm;
  }
  return c;
}

/// 3000 tokens of vocabulary 32 in sequences of 8 (stream seed 99): mostly a
/// fixed successor rule, sometimes a random token, so the loss falls.
inline data::TokenStream successor_stream() {
  std::vector<int> toks(3000);
  std::uint64_t x = 12345;
  int prev = 0;
  for (auto& t : toks) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = (x >> 60) < 3 ? int((x >> 33) % 32) : (prev * 5 + 3) % 32;
    prev = t;
  }
  return data::TokenStream(std::move(toks), 8, 99);
}

/// The single-process loss curve of `cfg` (cfg.batch is the whole global
/// batch, one microbatch per step) on successor_stream(), in float with
/// AdamW: the curve every parallel run of the same model must follow.
inline std::vector<double> single_process_losses(const nn::GPTConfig& cfg, std::size_t steps, double lr, double clip) {
  nn::GPT<float> gpt(cfg);
  optim::AdamW<float, Kokkos::DefaultExecutionSpace> opt(gpt.parameters());
  auto data = successor_stream();
  Kokkos::View<int*> ids("ids", cfg.tokens()), tg("tg", cfg.tokens());
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(optim::train_step(gpt, opt, data, s, 1, ids, tg, lr, clip).loss);
  return out;
}

/// |a - b| / |b| (b = the reference).
inline double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

/// Calls f.template operator()<P>() for every data-parallel policy P, in the
/// order Replicated, ZeRO<1>, ZeRO<2>, FullyShard: the loop over modes of a
/// test, with f a generic lambda []<class P>() { ... }.
template <class F>
void for_each_dp_policy(F&& f) {
  f.template operator()<Replicated>();
  f.template operator()<ZeRO<1>>();
  f.template operator()<ZeRO<2>>();
  f.template operator()<FullyShard>();
}

}  // namespace weft::test
