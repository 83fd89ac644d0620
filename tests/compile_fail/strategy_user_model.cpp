// Misuse: a strategy given to DataParallelOf with a policy that the mesh or
// the user's model cannot honour (one case per WEFT_CASE_* define). Without
// the check each of these compiled and ran, and the policy was ignored: at
// cp = 2 the run left the one-rank curve without a word.
#include <memory>
#include <vector>

#include <weft/mesh/mesh.hpp>
#include <weft/parallel/data_parallel.hpp>
#include <weft/parallel/pipeline/layer_stage.hpp>

using T = float;
using Space = Kokkos::DefaultExecutionSpace;
using M = weft::ops::Matrix<T, Space>;
using P = weft::nn::Parameter<T, Space>;
struct Batch {
  M x;
};
struct In {
  using value_type = T;
  using execution_space = Space;
  void forward(const Batch&, const M&) {}
  void backward(const Batch&, const M&) {}
  void collect(std::vector<P*>&) {}
};
struct Blk {
  using value_type = T;
  using execution_space = Space;
  struct Saved {};
  Saved make_saved(std::size_t) const { return {}; }
  std::size_t saved_bytes(const Saved&) const { return 0; }
  void forward(const M&, const M&, Saved&) {}
  void backward(const M&, const M&, const M&, Saved&) {}
  void collect(std::vector<P*>&) {}
};
struct Out {
  using value_type = T;
  using execution_space = Space;
  struct Saved {};
  Saved make_saved(std::size_t) const { return {}; }
  std::size_t saved_bytes(const Saved&) const { return 0; }
  double forward(const M&, const Batch&, Saved&, double) { return 0; }
  void backward(const M&, Saved&, const M&) {}
  void collect(std::vector<P*>&) {}
};
struct Model {
  using value_type = T;
  using execution_space = Space;
  using Input = In;
  using Block = Blk;
  using Head = Out;
  using Batch = ::Batch;
  std::size_t blocks() const { return 2; }
  std::size_t rows() const { return 1; }
  std::size_t width() const { return 1; }
  std::size_t microbatch_samples() const { return 1; }
  std::size_t loss_terms_per_sample() const { return 1; }
  std::unique_ptr<In> make_input() { return std::make_unique<In>(); }
  std::unique_ptr<Blk> make_block(std::size_t) { return std::make_unique<Blk>(); }
  std::unique_ptr<Out> make_head() { return std::make_unique<Out>(); }
  Batch make_batch() { return {}; }
  weft::Comm* tp_comm() const { return nullptr; }
};


using Sched = weft::Pipeline<weft::OneFOneB>;
#if defined(WEFT_CASE_CONTEXT)  // Context<Ring> on a model of the user's layers
using MeshT = weft::Mesh<weft::DP, weft::PP, weft::CP>;
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::PP, Sched>,
                         weft::On<weft::CP, weft::Context<weft::Ring>>>;
#elif defined(WEFT_CASE_SEQUENCE_PARALLEL)  // SequenceParallel on layers that do not shard tokens
using MeshT = weft::Mesh<weft::DP, weft::PP, weft::TP>;
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::PP, Sched>,
                         weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>;
#elif defined(WEFT_CASE_EXPERTS)  // Experts<4> on a model without MoE layers
using MeshT = weft::Mesh<weft::DP, weft::PP, weft::EP>;
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::PP, Sched>,
                         weft::On<weft::EP, weft::Experts<4>>>;
#elif defined(WEFT_CASE_CONTEXT_NO_CP_AXIS)  // Context<Ring> on a mesh without a CP axis
using MeshT = weft::Mesh<weft::DP, weft::PP>;
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::PP, Sched>,
                         weft::On<weft::CP, weft::Context<weft::Ring>>>;
#elif defined(WEFT_CASE_COMM_FORM)  // Context<Ring> through the unchecked (comm, groups) form
using MeshT = weft::Mesh<weft::DP, weft::PP, weft::CP>;
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::PP, Sched>,
                         weft::On<weft::CP, weft::Context<weft::Ring>>>;
#else
#error "define one WEFT_CASE_*"
#endif

void f(MeshT& mesh) {
  Model m;
  weft::pipeline::LayerStage<Model> stage(m, weft::pipeline::equal_partition(2, 1), 1, 0);
#if defined(WEFT_CASE_COMM_FORM)
  weft::parallel::DataParallelOf<T, S> dp(mesh.axis<weft::DP>(), stage.parameter_groups());
#else
  weft::parallel::DataParallelOf<T, S> dp(mesh, stage);
#endif
}
