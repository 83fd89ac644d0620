// Compile-time properties of the strategy types: a translation unit of
// static_asserts. Building it is the test.
#include <type_traits>

#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>

using namespace weft;

// The four data-parallel modes are the placements of the three states.
static_assert(std::is_same_v<ZeRO<1>, DPStates<Replicate, Replicate, Shard<0>>>);
static_assert(std::is_same_v<ZeRO<2>, DPStates<Replicate, Shard<0>, Shard<0>>>);
static_assert(std::is_same_v<ZeRO<3>, FullyShard>);
static_assert(Replicated::mode == parallel::DPMode::replicate && ZeRO<1>::mode == parallel::DPMode::zero1 &&
              ZeRO<2>::mode == parallel::DPMode::zero2 && FullyShard::mode == parallel::DPMode::fsdp);
static_assert(std::is_same_v<dp_policy_of<parallel::DPMode::zero2>, ZeRO<2>>);

// A placement over DP names the same policy as its DPStates.
static_assert(std::is_same_v<Strategy<On<DP, Replicate>>::data_parallel, Replicated>);
static_assert(std::is_same_v<Strategy<On<DP, Shard<0>>>::data_parallel, FullyShard>);
// No DP policy: one DP rank, replicate.
static_assert(std::is_same_v<SingleProcess::data_parallel, Replicated>);

using Full = Strategy<On<DP, FullyShard>, On<PP, Pipeline<OneFOneB>>, On<TP, TensorParallel<SequenceParallel>>>;
static_assert(Full::has<DP> && Full::has<PP> && Full::has<TP> && !Full::has<CP>);
static_assert(Full::tensor_parallel_v && Full::sequence_parallel && Full::pipelined);
static_assert(std::is_same_v<strategy_schedule_t<Full>, OneFOneB>);
// The order of the entries does not change what each axis does.
using Shuffled = Strategy<On<TP, TensorParallel<SequenceParallel>>, On<DP, FullyShard>, On<PP, Pipeline<OneFOneB>>>;
static_assert(std::is_same_v<Shuffled::policy<DP>, Full::policy<DP>> && std::is_same_v<Shuffled::policy<TP>, Full::policy<TP>>);

// Strategies that differ only in what wraps the model share the layers' policy (a sum, not a product).
using Zero1Gpipe = Strategy<On<DP, ZeRO<1>>, On<PP, Pipeline<GPipe>>, On<TP, TensorParallel<SequenceParallel>>>;
static_assert(std::is_same_v<layer_policy_t<Full>, layer_policy_t<Zero1Gpipe>>);
static_assert(std::is_same_v<layer_policy_t<SingleProcess>, NoPolicy>);
static_assert(std::is_same_v<layer_policy_t<Strategy<On<DP, ZeRO<2>>>>, NoPolicy>);

// Meshes and static sizes that fit.
static_assert(check_strategy_mesh<Full, Mesh<DP, PP, TP>>());
static_assert(check_strategy_mesh<Full, Mesh<DP, Axis<PP, 2>, Axis<TP, 2>>>());
static_assert(check_strategy_sizes<Full, Mesh<DP, Axis<PP, 2>, Axis<TP, 4>>, ModelSizes<8, 6>>());
static_assert(check_strategy_sizes<Strategy<On<PP, Pipeline<Interleaved1F1B<2>>>>, Mesh<Axis<PP, 2>>, ModelSizes<dynamic_extent, 8>>());
// Dynamic sizes leave the checks to run time.
static_assert(check_strategy_sizes<Full, Mesh<DP, PP, TP>, ModelSizes<7, 5>>());

// On<Axis, P> of a strategy policy is not a tensor placement.
static_assert(!OnPlacement<On<DP, FullyShard>> && OnPlacement<On<TP, Shard<1>>>);
static_assert(is_strategy_v<Full> && !is_strategy_v<FullyShard>);

int main() { return 0; }
