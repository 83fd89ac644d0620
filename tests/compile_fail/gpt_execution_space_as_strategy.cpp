// Must not compile. nn::GPT's second argument is a weft::Strategy now; an
// execution space in that position (the old nn::GPT<T, Space>) is named.
#include <weft/nn/gpt.hpp>

void old_spelling(const weft::nn::GPTConfig& c) {
  weft::nn::GPT<float, Kokkos::DefaultExecutionSpace> g(c);
  (void)g;
}
