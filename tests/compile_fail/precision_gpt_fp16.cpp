// The GPT with an fp16 policy: the training steps do not scale the loss yet,
// so the model refuses the policy instead of training fp16 without a scaler.
#include <weft/weft.hpp>

using S = weft::Strategy<weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale>>;
std::size_t n = sizeof(weft::nn::GPT<float, S>);
