// Misuse: a zero-bubble pipeline over a user's block that does not split its
// backward into input and weight halves (it has no backward_input).
#include <memory>
#include <vector>

#include <weft/parallel/pipeline/executor.hpp>
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

void f(weft::Comm& pp) {
  Model m;
  weft::pipeline::LayerStage<Model> stage(m, weft::pipeline::equal_partition(2, 1), 1, 0);
  weft::pipeline::Executor ex(stage, pp, weft::Pipeline<weft::ZeroBubble>(1, 1));
}
