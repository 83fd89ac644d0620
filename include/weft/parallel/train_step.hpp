// One data-parallel optimizer step: every DP rank takes its slice of each
// microbatch of the global batch (fixed by seed and step alone), accumulates
// the microbatches, and the DataParallel engine reduces gradients, clips,
// updates and re-syncs.
#pragma once

#include <cmath>
#include <cstdint>

#include <weft/data/stream.hpp>
#include <weft/metrics/profiler.hpp>
#include <weft/optim/train_step.hpp>
#include <weft/parallel/data_parallel.hpp>

namespace weft::parallel {

/// Checks that a global batch splits into dp ranks x microbatches equal
/// microbatches; the ConfigError names every number.
inline std::size_t local_microbatch(std::size_t global_batch, std::size_t dp, std::size_t microbatches) {
  WEFT_REQUIRE(microbatches > 0, ConfigError, "--microbatches is 0; expected a positive integer");
  WEFT_REQUIRE(global_batch % dp == 0, ConfigError, "--batch ", global_batch, " is not divisible by dp ", dp,
               ": every data-parallel rank takes batch / dp sequences; choose a batch that is a multiple of ", dp);
  WEFT_REQUIRE((global_batch / dp) % microbatches == 0, ConfigError, "--batch ", global_batch, " / dp ", dp, " = ",
               global_batch / dp, " sequences per rank do not split into --microbatches ", microbatches,
               "; choose a batch that is a multiple of dp x microbatches = ", dp * microbatches);
  return global_batch / dp / microbatches;
}

/// The first sample of rank `rank`'s share of microbatch `m` of a step
/// split over `p` data ranks, `mb` samples each per microbatch: microbatch m
/// is samples [m mb p, (m + 1) mb p) of the step's batch and the rank takes
/// its rank-th block of mb, so a microbatch holds the same samples on every
/// layout (a mixture of experts routes over the whole microbatch: its
/// capacity, drops and balancing losses then do not depend on p).
inline std::size_t microbatch_first_sample(std::size_t m, std::size_t rank, std::size_t mb, std::size_t p) {
  return (m * p + rank) * mb;
}

namespace detail {
// Which of a step's samples this rank takes: `groups` sets of ranks hold
// different samples (the DP engine's ranks over its CP ranks), this rank's
// set is `index`. Under context parallelism the engine runs over DP x CP
// and the CP ranks of a set take the same samples. A model whose
// mixture-of-experts routing split knows its samples' index from the mesh
// (nn::ExpertSplit::sample_rank: DP x EP, whatever the mesh order of CP and
// EP) takes it from there; otherwise CP is the engine communicator's inner
// axis (mesh.axes<DP, CP>()). `who` names the caller in the errors.
struct SampleGroups {
  std::size_t groups = 1, index = 0;
};
template <class Model>
SampleGroups sample_groups(const Model& model, const Comm* comm, const char* who) {
  const std::size_t size = comm ? std::size_t(comm->size()) : 1, rank = comm ? std::size_t(comm->rank()) : 0;
  std::size_t cp = 1, cp_rank = 0;
  if constexpr (requires { model.context_parallel().size(); }) {
    cp = model.context_parallel().size();
    cp_rank = model.context_parallel().rank();
  }
  if constexpr (requires { model.expert_split().sample_index(); }) {
    const nn::ExpertSplit& x = model.expert_split();
    if (x.global() && x.sample_rank != nn::ExpertSplit::from_data_rank) {
      const std::size_t groups = x.data_size() / x.token_shards;
      WEFT_REQUIRE(size == groups * cp, ConfigError, who, ": the model's routing split has ", groups,
                   " sets of ranks holding different samples", cp > 1 ? " and " + std::to_string(cp) + " CP ranks" : std::string(),
                   ", so its data-parallel engine must run over ", groups * cp,
                   " ranks (mesh.axes<DP, CP, EP>() of those the mesh has); it runs over ", size);
      return {groups, x.sample_index()};
    }
  }
  WEFT_REQUIRE(size % cp == 0 && rank % cp == cp_rank, ConfigError, who, ": the model is split over ", cp,
               " context-parallel ranks, so DataParallel must run over the DP x CP ranks (mesh.axes<DP, CP>(), CP "
               "inner); it runs over ", size, " ranks");
  return {size / cp, rank / cp};
}

// parallel::train_step's body; scaler is null without loss scaling.
template <class Model, DataParallelType DP, class Optimizer, class IV, class TV>
optim::StepResult train_step(Model& model, DP& dp, Optimizer& opt, const data::TokenStream& data,
                             std::uint64_t step, std::size_t global_batch, std::size_t microbatches, const IV& ids,
                             const TV& targets, double lr, double clip, DynamicLossScaler* scaler,
                             metrics::Profiler* profiler) {
  if constexpr (requires { typename Model::precision::reduce_type; }) {
    using Want = typename Model::precision::reduce_type;
    using Have = typename DP::reduce_type;
    static_assert(std::is_same_v<Want, Have> || (!is_reduced_precision_v<Want> && !is_reduced_precision_v<Have>),
                  "weft::parallel::train_step: the model's weft::Precision reduces gradients in one type and the "
                  "data-parallel engine in another; build the engine from the model's strategy "
                  "(DataParallelOf<T, S>(mesh, model), or DataParallel<T, Policy, Space, typename S::precision>). "
                  "A 2-byte reduction runs in DataParallel only, not in ExpertDataParallel");
  }
  // The CP ranks of a DP rank take the same sequences, and the model picks
  // each rank's tokens of them.
  const SampleGroups g = sample_groups(model, &dp.comm(), "parallel::train_step");
  const std::size_t p = g.groups, rank = g.index;
  const std::size_t mb = local_microbatch(global_batch, p, microbatches);
  WEFT_REQUIRE(mb == model.config().batch, ConfigError, "parallel::train_step: the model is built for microbatches of ",
               model.config().batch, " sequences, but batch ", global_batch, " / dp ", p, " / microbatches ",
               microbatches, " = ", mb);
  optim::StepResult r;
  if (scaler) r.loss_scale = scaler->scale();
  dp.zero_grad();
  double local = 0;
  for (std::size_t m = 0; m < microbatches; ++m) {
    dp.begin_microbatch(m + 1 == microbatches);
    {
      metrics::Profiler::Scope sc(profiler, "data");
      data.fill(step, global_batch, microbatch_first_sample(m, rank, mb, p), mb, ids, targets);
    }
    local += model.forward_backward(ids, targets, r.loss_scale / double(global_batch * model.config().seq));
  }
  {
    metrics::Profiler::Scope sc(profiler, "dp_gradients");
    dp.finish_gradients();
  }
  {
    metrics::Profiler::Scope sc(profiler, "optimizer");
    Comm* tp = nullptr;
    if constexpr (requires { model.tensor_parallel().comm; }) tp = model.tensor_parallel().comm;
    if (!scaler) {
      r.grad_norm = dp.clip_grad_norm(clip, tp);
      opt.step(lr);
    } else {
      // The norm is reduced over every rank that holds gradients, so an
      // overflow on one rank skips the step on all of them.
      r.skipped = optim::unscale_and_clip(*scaler, std::sqrt(dp.gradient_squares(tp)), clip, r.grad_norm,
                                          [&](double f) { dp.scale_gradients(f); });
      if (!r.skipped) opt.step(lr);
    }
  }
  {
    metrics::Profiler::Scope sc(profiler, "dp_parameters");
    dp.sync_parameters();
  }
  // Every rank's microbatches have equal size: the global mean is the mean of
  // the local means (the CP ranks of a DP rank hold the same mean).
  double mean = local / double(microbatches);
  Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(&mean, 1);
  dp.comm().all_reduce(v, ReduceOp::avg);
  r.loss = mean;
  return r;
}

}  // namespace detail

/// Trains `model` (hooks set to `dp`, any DataParallel<T, Policy, Space>;
/// config().batch sequences per microbatch) on step `step` of `data` with the
/// global batch split over the DP ranks. A model split over a TP axis (one
/// with tensor_parallel()) takes the same data on every rank of a TP group,
/// and its gradient norm counts TP-replicated parameters once. Returns the
/// global mean loss (identical on every rank) and the global gradient norm
/// before clipping.
/// A loss-scaled (fp16) model does not compile here: it takes the overload
/// with a scaler.
template <class Model, DataParallelType DP, class Optimizer, class IV, class TV>
optim::StepResult train_step(Model& model, DP& dp, Optimizer& opt, const data::TokenStream& data,
                             std::uint64_t step, std::size_t global_batch, std::size_t microbatches, const IV& ids,
                             const TV& targets, double lr, double clip, metrics::Profiler* profiler = nullptr) {
  static_assert(!optim::loss_scaled_model_v<Model>,
                "weft::parallel::train_step: the model's weft::Precision<FP16, F32, DynamicLossScale> scales its "
                "loss; pass the weft::DynamicLossScaler that holds the scale: train_step(..., lr, clip, scaler)");
  return detail::train_step(model, dp, opt, data, step, global_batch, microbatches, ids, targets, lr, clip, nullptr,
                            profiler);
}

/// The same step with dynamic loss scaling (optim::train_step's overload
/// with a scaler says how), for a loss-scaled (fp16) model. Every rank
/// decides alike whether the step is skipped: the decision reads the global
/// gradient norm.
template <class Model, DataParallelType DP, class Optimizer, class IV, class TV>
optim::StepResult train_step(Model& model, DP& dp, Optimizer& opt, const data::TokenStream& data,
                             std::uint64_t step, std::size_t global_batch, std::size_t microbatches, const IV& ids,
                             const TV& targets, double lr, double clip, DynamicLossScaler& scaler,
                             metrics::Profiler* profiler = nullptr) {
  static_assert(optim::loss_scaled_model_v<Model>,
                "weft::parallel::train_step: a weft::DynamicLossScaler was given, but the model's precision does not "
                "scale its loss (fp32 and bf16 need none); drop the scaler, or use weft::Precision<weft::FP16, "
                "weft::F32, weft::DynamicLossScale>");
  return detail::train_step(model, dp, opt, data, step, global_batch, microbatches, ids, targets, lr, clip, &scaler,
                            profiler);
}

}  // namespace weft::parallel
