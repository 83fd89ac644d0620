// Choosing the next token from a row of logits: greedy (the highest logit,
// the lowest id on a tie), or temperature and top-k sampling with a seed.
// The random draw is counter-based -- Philox of (seed, stream, token index)
// -- so a request's tokens depend only on its own logits and seed, never on
// which requests share its batch or on how often it was preempted.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/ops/random.hpp>

namespace weft::serve {

/// How a request's tokens are chosen.
struct SamplingParams {
  double temperature = 0;   ///< 0: greedy; > 0: sample from softmax(logits / temperature)
  std::size_t top_k = 0;    ///< sample among the k highest logits only (0: all)
  std::uint64_t seed = 0;   ///< the random stream of this request
};

/// The id of the highest of n logits (the lowest id among equal ones).
template <class T>
int greedy_token(const T* logits, std::size_t n) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return int(best);
}

/// The next token after `index` generated tokens, from n logits under p,
/// drawn from random stream `stream` of p.seed. Greedy when p.temperature is 0.
template <class T>
int sample_token(const T* logits, std::size_t n, const SamplingParams& p, std::uint64_t stream, std::size_t index) {
  if (p.temperature <= 0) return greedy_token(logits, n);
  std::vector<int> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  const std::size_t k = p.top_k == 0 ? n : std::min(p.top_k, n);
  // Highest first, ties by id: a total order, so the candidates never depend on the sort's whims.
  auto higher = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(ids.begin(), ids.begin() + long(k), ids.end(), higher);
  std::vector<double> w(k);
  const double top = double(logits[ids[0]]);
  double sum = 0;
  for (std::size_t i = 0; i < k; ++i) sum += (w[i] = std::exp((double(logits[ids[i]]) - top) / p.temperature));
  const ops::Philox r(p.seed, stream, index);
  const double u = r.uniform();  // (0, 1]
  double acc = 0;
  for (std::size_t i = 0; i < k; ++i) {
    acc += w[i] / sum;
    if (u <= acc) return ids[i];
  }
  return ids[k - 1];
}

}  // namespace weft::serve
