// One optimizer step of a model over a global batch split into microbatches:
// zero the gradients, accumulate every microbatch's gradient of the mean loss
// over the whole global batch, clip by global norm, update. Shared by
// train_gpt, the tests and the training-step benchmark.
#pragma once

#include <cstdint>

#include <weft/data/stream.hpp>
#include <weft/metrics/profiler.hpp>
#include <weft/optim/optim.hpp>

namespace weft::optim {

/// What one step reports.
struct StepResult {
  double loss = 0;       ///< mean loss over the global batch (before the update)
  double grad_norm = 0;  ///< global gradient norm before clipping
};

/// Trains `model` (its config().batch sequences per microbatch) on
/// `microbatches` microbatches of step `step`'s global batch from `data`;
/// ids and targets are [batch * seq] scratch views.
template <class Model, class Optimizer, class IV, class TV>
StepResult train_step(Model& model, Optimizer& opt, const data::TokenStream& data, std::uint64_t step,
                      std::size_t microbatches, const IV& ids, const TV& targets, double lr, double clip,
                      metrics::Profiler* profiler = nullptr) {
  const std::size_t mb = model.config().batch, global = mb * microbatches;
  StepResult r;
  {
    metrics::Profiler::Scope sc(profiler, "zero_grad");
    model.zero_grad();
  }
  for (std::size_t m = 0; m < microbatches; ++m) {
    {
      metrics::Profiler::Scope sc(profiler, "data");
      data.fill(step, global, m * mb, mb, ids, targets);
    }
    r.loss += model.forward_backward(ids, targets, 1.0 / double(global * model.config().seq)) / double(microbatches);
  }
  auto params = model.parameters();
  {
    metrics::Profiler::Scope sc(profiler, "optimizer");
    Comm* tp = nullptr;
    if constexpr (requires { model.tensor_parallel().comm; }) tp = model.tensor_parallel().comm;
    r.grad_norm = clip_grad_norm(params, clip, tp);
    opt.step(lr);
  }
  return r;
}

}  // namespace weft::optim
