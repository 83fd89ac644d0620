// A pipeline whose stage computes fp16 products, stepped without a loss
// scaler: the step refuses to compile instead of training fp16 unscaled.
#include <weft/parallel/pipeline/executor.hpp>

using S = weft::Strategy<weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>,
                         weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale>>;
using StageT = weft::pipeline::Stage<float, S>;

weft::optim::StepResult step(weft::pipeline::Executor<StageT, weft::OneFOneB>& ex,
                             weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace>& opt,
                             const weft::data::TokenStream& data) {
  return weft::pipeline::train_step(ex, static_cast<weft::parallel::DataParallel<float, weft::Replicated>*>(nullptr),
                                    opt, data, 0, 8, 1e-3, 1.0);
}
