// The GPT with a bf16 gradient reduction: gradients are reduced in fp32, so
// the model refuses Precision<BF16, BF16> instead of ignoring its Reduce.
#include <weft/nn/gpt.hpp>

using S = weft::Strategy<weft::Precision<weft::BF16, weft::BF16>>;
std::size_t n = sizeof(weft::nn::GPT<float, S>);
