// A GPT whose strategy reduces gradients in bf16 (Precision<BF16, BF16>)
// trained through a data-parallel engine that reduces in fp32: the step
// refuses the pair instead of ignoring the model's Reduce.
#include <weft/nn/gpt.hpp>
#include <weft/optim/optim.hpp>
#include <weft/parallel/train_step.hpp>

using S = weft::Strategy<weft::Precision<weft::BF16, weft::BF16>>;
using Model = weft::nn::GPT<float, S>;
using DP = weft::parallel::DataParallel<float, weft::Replicated>;

void step(Model& m, DP& dp, weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace>& opt,
          const weft::data::TokenStream& data, Kokkos::View<int*> ids) {
  (void)weft::parallel::train_step(m, dp, opt, data, 0, 8, 1, ids, ids, 1e-3, 1.0);
}
