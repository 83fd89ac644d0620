// The data-parallel modes by name, without Kokkos or MPI: shared by the
// DataParallel strategy, the planner and command lines (--dp).
#pragma once

#include <string_view>

#include <weft/core/error.hpp>

namespace weft::parallel {

/// How the DP axis treats parameters, gradients and optimizer state.
enum class DPMode {
  replicate,  ///< everything replicated; gradients all-reduced (DDP)
  zero1,      ///< optimizer state sharded; gradients reduce-scattered once per step; parameters all-gathered
  zero2,      ///< gradients sharded too: reduce-scattered group by group every microbatch
  fsdp        ///< parameters sharded too: gathered per group for forward and backward, freed after
};

/// "replicate", "zero1", "zero2" or "fsdp".
constexpr const char* to_string(DPMode m) {
  switch (m) {
    case DPMode::replicate: return "replicate";
    case DPMode::zero1: return "zero1";
    case DPMode::zero2: return "zero2";
    case DPMode::fsdp: return "fsdp";
  }
  return "?";
}

/// Parses a --dp value; a ConfigError names the value and the valid ones.
inline DPMode parse_dp_mode(std::string_view s) {
  for (DPMode m : {DPMode::replicate, DPMode::zero1, DPMode::zero2, DPMode::fsdp})
    if (s == to_string(m)) return m;
  detail::throw_error<ConfigError>("--dp ", s, ": unknown data-parallel mode; expected replicate, zero1, zero2 or fsdp");
}

}  // namespace weft::parallel
