// The state of a training run as checkpoint pieces: the parameters a
// data-parallel engine hands its optimizer (whole on replicated ranks, this
// rank's shard pieces in the sharded modes; each rank's tensor-parallel part
// in every case) and the optimizer state aligned with them, all addressed by
// global tensor names and indices so that any other mesh can load them.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <weft/checkpoint/checkpoint.hpp>

namespace weft::checkpoint {

/// Optimizer state aligned with a DataParallel engine's optimizer_parameters():
/// for each kind (a suffix such as ".adam_m"), one view per optimizer parameter.
template <class T, class Space>
using OptimizerTensors = std::vector<std::pair<std::string, std::vector<Kokkos::View<T*, Space>>>>;

/// Adds to `state` every parameter piece `dp` gives its optimizer, as part
/// of the global tensor of its parameter's name (its layout taken from
/// `model_params`, the model's own parameters on this rank), and for each
/// kind of `optimizer` the tensor "<name><suffix>" with the same layout.
/// After load(), call dp.sync_parameters() so that the sharded modes rebuild
/// the full parameters from the loaded shards.
template <class T, class Space, class DP>
void add_data_parallel(State<T, Space>& state, DP& dp, const std::vector<nn::Parameter<T, Space>*>& model_params,
                       const OptimizerTensors<T, Space>& optimizer = {}) {
  std::map<std::string, const nn::Parameter<T, Space>*> by_name;
  for (const auto* p : model_params) by_name[p->name()] = p;
  const auto pieces = dp.optimizer_parameters();
  const auto& origins = dp.piece_origins();
  WEFT_REQUIRE(origins.size() == pieces.size(), ConfigError, "checkpoint::add_data_parallel: ", pieces.size(),
               " optimizer parameters but ", origins.size(), " origins");
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    auto it = by_name.find(origins[k].parameter);
    WEFT_REQUIRE(it != by_name.end(), ConfigError, "checkpoint::add_data_parallel: optimizer piece of '", origins[k].parameter,
                 "', which is not among the model's parameters");
    const plan::LocalLayout layout = layout_of(*it->second);
    state.add(origins[k].parameter, layout, origins[k].offset, pieces[k]->value);
    for (const auto& [suffix, views] : optimizer) {
      WEFT_REQUIRE(views.size() == pieces.size(), ConfigError, "checkpoint::add_data_parallel: optimizer state '", suffix,
                   "' has ", views.size(), " views for ", pieces.size(), " parameters");
      state.add(origins[k].parameter + suffix, layout, origins[k].offset, views[k]);
    }
  }
}

}  // namespace weft::checkpoint
