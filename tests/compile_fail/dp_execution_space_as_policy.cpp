// Must not compile. DataParallel's second argument is its DP policy now; an
// execution space in that position (the old DataParallel<T, Space>) is named.
#include <weft/parallel/data_parallel.hpp>

using Param = weft::nn::Parameter<float, Kokkos::DefaultExecutionSpace>;

void old_spelling(weft::Comm& dp, std::vector<std::vector<Param*>> groups) {
  weft::parallel::DataParallel<float, Kokkos::DefaultExecutionSpace> d(dp, std::move(groups));
  (void)d;
}
