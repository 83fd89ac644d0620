// Compile-time properties of the precision policy and of strategies that
// carry one: a translation unit of static_asserts. Building it is the test.
#include <string>
#include <type_traits>

#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
#include <weft/precision/policy.hpp>

using namespace weft;

// The default is full precision.
static_assert(std::is_same_v<Precision<>, Precision<F32, F32, NoLossScale>> && std::is_same_v<FullPrecision, Precision<>>);
static_assert(std::is_same_v<Precision<>::param_type, float> && std::is_same_v<Precision<>::reduce_type, float>);
static_assert(!Precision<>::mixed && !Precision<>::loss_scaled);

// The valid forms and what they store.
using BF16Mixed = Precision<BF16, F32>;
static_assert(std::is_same_v<BF16Mixed::param_type, bf16> && std::is_same_v<BF16Mixed::reduce_type, float>);
static_assert(BF16Mixed::mixed && !BF16Mixed::loss_scaled);
using BF16Reduce = Precision<BF16, BF16>;  // bf16 reduction as an option
static_assert(std::is_same_v<BF16Reduce::reduce_type, bf16>);
using FP16Scaled = Precision<FP16, F32, DynamicLossScale>;
static_assert(std::is_same_v<FP16Scaled::param_type, fp16> && std::is_same_v<FP16Scaled::reduce_type, float>);
static_assert(FP16Scaled::mixed && FP16Scaled::loss_scaled);
static_assert(std::is_same_v<Precision<FP16, FP16, DynamicLossScale>::reduce_type, fp16>);
// Masters, moments and accumulation stay float whatever the policy.
static_assert(std::is_same_v<BF16Mixed::master_type, float> && std::is_same_v<FP16Scaled::master_type, float> &&
              std::is_same_v<BF16Reduce::accumulation_type, float>);
static_assert(F32::bytes == 4 && BF16::bytes == 2 && FP16::bytes == 2);
static_assert(is_precision_v<BF16Mixed> && !is_precision_v<BF16> && !is_precision_v<Replicated>);

// A strategy without a Precision entry is all fp32.
static_assert(std::is_same_v<precision_of_t<SingleProcess>, Precision<>>);
static_assert(std::is_same_v<precision_of_t<Strategy<On<DP, FullyShard>, On<TP, TensorParallel<>>>>, Precision<>>);

// With one, wherever it stands among the entries.
using Mixed = Strategy<On<DP, FullyShard>, Precision<BF16, F32>, On<TP, TensorParallel<SequenceParallel>>>;
static_assert(std::is_same_v<precision_of_t<Mixed>, BF16Mixed>);
static_assert(std::is_same_v<precision_of_t<Strategy<Precision<FP16, F32, DynamicLossScale>>>, FP16Scaled>);
static_assert(std::is_same_v<precision_of_t<Mixed>::param_type, bf16>);
// It changes nothing the axis policies say.
using Same = Strategy<On<DP, FullyShard>, On<TP, TensorParallel<SequenceParallel>>>;
static_assert(std::is_same_v<Mixed::policy<DP>, Same::policy<DP>> && std::is_same_v<Mixed::policy<TP>, Same::policy<TP>>);
static_assert(std::is_same_v<Mixed::data_parallel, FullyShard> && Mixed::sequence_parallel && !Mixed::pipelined &&
              !Mixed::has<PP> && Mixed::has<TP>);
static_assert(std::is_same_v<layer_policy_t<Mixed>, layer_policy_t<Same>>);
static_assert(std::is_same_v<Strategy<Precision<BF16, F32>>::data_parallel, Replicated>);
// It names no mesh axis, so it fits every mesh the axis policies fit.
static_assert(check_strategy_mesh<Mixed, Mesh<DP, TP>>());
static_assert(check_strategy_mesh<Strategy<Precision<BF16, F32>>, Mesh<DP>>());
static_assert(check_strategy_sizes<Mixed, Mesh<Axis<DP, 2>, Axis<TP, 2>>, ModelSizes<4, 2>>());

int main() {
  // The spelling run records will carry.
  if (BF16Mixed::policy_name() != "Precision<BF16, F32>") return 1;
  if (FP16Scaled::policy_name() != "Precision<FP16, F32, DynamicLossScale>") return 1;
  if (Mixed::name() != "Strategy<On<dp, FullyShard>, Precision<BF16, F32>, On<tp, TensorParallel<SequenceParallel>>>")
    return 1;
  return 0;
}
