// Misuse: one block type over block kinds of different value types (a float
// block and a double block cannot share a residual stream).
#include <cstddef>
#include <vector>

#include <weft/nn/one_of.hpp>

using Space = Kokkos::DefaultExecutionSpace;
template <class T>
struct Blk {
  using value_type = T;
  using execution_space = Space;
  using M = weft::ops::Matrix<T, Space>;
  struct Saved {};
  Saved make_saved(std::size_t) const { return {}; }
  std::size_t saved_bytes(const Saved&) const { return 0; }
  void forward(const M&, const M&, Saved&) {}
  void backward(const M&, const M&, const M&, Saved&) {}
  void collect(std::vector<weft::nn::Parameter<T, Space>*>&) {}
};

int main() {
  using B = weft::nn::OneOf<Blk<float>, Blk<double>>;
  return int(sizeof(B));
}
