// pipeline::executor_of<S>: a pipelined strategy on a mesh with no PP axis.
// The executor checks the strategy against the mesh type (check_strategy_mesh)
// before it builds anything, instead of running one rank and ignoring the
// Pipeline entry.
#include <weft/mesh/mesh.hpp>
#include <weft/parallel/pipeline/executor.hpp>

using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>>;

void run(weft::pipeline::Stage<float>& stage, weft::Mesh<weft::DP>& mesh) {
  auto ex = weft::pipeline::executor_of<S>(stage, mesh, 4);
  (void)ex;
}
