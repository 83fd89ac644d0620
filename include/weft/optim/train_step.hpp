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
  double loss = 0;        ///< mean loss over the global batch (before the update)
  double grad_norm = 0;   ///< global gradient norm before clipping (unscaled; on a skipped step the scaled, non-finite one)
  bool skipped = false;   ///< a loss-scaled step whose gradients overflowed: no update was made
  double loss_scale = 1;  ///< the loss scale of this step (1 without loss scaling)
};

namespace detail {
// Whether a model's precision policy scales its loss (weft::Precision<FP16, F32, DynamicLossScale>).
template <class Model>
constexpr bool loss_scaled_model() {
  if constexpr (requires { Model::precision::loss_scaled; }) return Model::precision::loss_scaled;
  else return false;
}
}  // namespace detail

/// Whether Model's weft::Precision is loss-scaled (fp16): its training steps
/// then take a weft::DynamicLossScaler.
template <class Model>
inline constexpr bool loss_scaled_model_v = detail::loss_scaled_model<Model>();

namespace detail {
template <class Model, class Optimizer, class IV, class TV>
StepResult train_step(Model& model, Optimizer& opt, const data::TokenStream& data, std::uint64_t step,
                      std::size_t microbatches, const IV& ids, const TV& targets, double lr, double clip,
                      DynamicLossScaler* scaler, metrics::Profiler* profiler) {
  const std::size_t mb = model.config().batch, global = mb * microbatches;
  StepResult r;
  if (scaler) r.loss_scale = scaler->scale();
  {
    metrics::Profiler::Scope sc(profiler, "zero_grad");
    model.zero_grad();
  }
  for (std::size_t m = 0; m < microbatches; ++m) {
    {
      metrics::Profiler::Scope sc(profiler, "data");
      data.fill(step, global, m * mb, mb, ids, targets);
    }
    r.loss += model.forward_backward(ids, targets, r.loss_scale / double(global * model.config().seq)) /
              double(microbatches);
  }
  auto params = model.parameters();
  {
    metrics::Profiler::Scope sc(profiler, "optimizer");
    Comm* tp = nullptr;
    if constexpr (requires { model.tensor_parallel().comm; }) tp = model.tensor_parallel().comm;
    if (scaler) {
      r.skipped = unscale_and_clip(*scaler, grad_norm(params, tp), clip, r.grad_norm,
                                   [&](double f) { scale_grads(params, f); });
      if (r.skipped) return r;
    } else {
      r.grad_norm = clip_grad_norm(params, clip, tp);
    }
    opt.step(lr);
  }
  return r;
}
}  // namespace detail

/// Trains `model` (its config().batch sequences per microbatch) on
/// `microbatches` microbatches of step `step`'s global batch from `data`;
/// ids and targets are [batch * seq] scratch views. A loss-scaled (fp16)
/// model does not compile here: it takes the overload with a scaler.
template <class Model, class Optimizer, class IV, class TV>
StepResult train_step(Model& model, Optimizer& opt, const data::TokenStream& data, std::uint64_t step,
                      std::size_t microbatches, const IV& ids, const TV& targets, double lr, double clip,
                      metrics::Profiler* profiler = nullptr) {
  static_assert(!loss_scaled_model_v<Model>,
                "weft::optim::train_step: the model's weft::Precision<FP16, F32, DynamicLossScale> scales its loss; "
                "pass the weft::DynamicLossScaler that holds the scale: train_step(..., lr, clip, scaler)");
  return detail::train_step(model, opt, data, step, microbatches, ids, targets, lr, clip, nullptr, profiler);
}

/// The same step with dynamic loss scaling, for a loss-scaled (fp16) model:
/// the loss gradient is multiplied by scaler.scale(), and once the gradients
/// are complete an overflow (a non-finite global norm) skips the update and
/// backs the scale off, while a clean step unscales the gradients (and clips
/// the unscaled norm) before the optimizer's step (unscale_and_clip). The
/// result says whether the step was skipped and at which scale it ran.
template <class Model, class Optimizer, class IV, class TV>
StepResult train_step(Model& model, Optimizer& opt, const data::TokenStream& data, std::uint64_t step,
                      std::size_t microbatches, const IV& ids, const TV& targets, double lr, double clip,
                      DynamicLossScaler& scaler, metrics::Profiler* profiler = nullptr) {
  static_assert(loss_scaled_model_v<Model>,
                "weft::optim::train_step: a weft::DynamicLossScaler was given, but the model's precision does not "
                "scale its loss (fp32 and bf16 need none); drop the scaler, or use weft::Precision<weft::FP16, "
                "weft::F32, weft::DynamicLossScale>");
  return detail::train_step(model, opt, data, step, microbatches, ids, targets, lr, clip, &scaler, profiler);
}

}  // namespace weft::optim
