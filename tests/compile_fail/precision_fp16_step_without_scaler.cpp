// An fp16 GPT trained by the step without a loss scaler: its gradients would
// underflow in fp16, so the step refuses the model and names the overload
// that takes the scaler.
#include <weft/nn/gpt.hpp>
#include <weft/optim/train_step.hpp>

using S = weft::Strategy<weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale>>;

void step(weft::nn::GPT<float, S>& gpt, weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace>& opt, const weft::data::TokenStream& data,
          const weft::ops::Tokens<>& ids) {
  weft::optim::train_step(gpt, opt, data, 0, 1, ids, ids, 1e-3, 1.0);
}
