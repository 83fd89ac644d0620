// Compiled by nvcc (CTest cuda.nvcc_extended_lambdas) against the Serial
// Kokkos of this build: KOKKOS_LAMBDA is redefined as nvcc's extended
// __host__ __device__ lambda, so that nvcc applies its rules for those lambdas
// to weft's kernels (no KOKKOS_LAMBDA in a private or protected member
// function) and evaluates weft's concepts itself (a lambda inside a
// requires-expression makes nvcc's answer false). Device code is not built:
// with a Serial Kokkos the views' operator() is a host function, so nvcc's
// "calling a __host__ function from a __host__ __device__ function" warnings
// are expected here and suppressed.
#include <Kokkos_Core.hpp>
#undef KOKKOS_LAMBDA
#define KOKKOS_LAMBDA [=] __host__ __device__
#include <weft/weft.hpp>
#include <weft/nn/chain.hpp>
#if __has_include(<nccl.h>)
#include <weft/comm/nccl.hpp>  // the NCCL transport's header, read by nvcc too
#endif

#include <complex>

static_assert(weft::PipelineSchedule<weft::GPipe>, "nvcc sees GPipe as a pipeline schedule");
static_assert(weft::PipelineSchedule<weft::OneFOneB>, "nvcc sees OneFOneB as a pipeline schedule");
static_assert(weft::PipelineSchedule<weft::ZeroBubble>, "nvcc sees ZeroBubble as a pipeline schedule");

// Class templates whose member functions launch kernels, instantiated whole.
template class weft::parallel::DataParallel<float, weft::Replicated>;
template class weft::parallel::DataParallel<float, weft::FullyShard>;
template class weft::serve::ModelRunner<float>;

// ReduceOp::avg's kernel, on real and complex elements.
void average(weft::Comm& c) {
  Kokkos::View<double*> a("a", 4);
  Kokkos::View<std::complex<float>*> z("z", 4);
  c.all_reduce(a, weft::ReduceOp::avg);
  c.all_reduce(z, weft::ReduceOp::avg);
}

// A chain of placed steps (nn/chain.hpp): its forward and generated backward, every activation.
template <class Act>
void chain(weft::Mesh<weft::TP>& mesh) {
  using Rep = weft::DistView<float, 2, weft::On<weft::TP, weft::Replicate>>;
  using Up = weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<0>>>;
  using Down = weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<1>>>;
  using Body = weft::nn::Chain<Rep, Up, Act, Down, weft::nn::Reduce<weft::TP>>;
  weft::nn::Residual<Body> f(Body(Up(mesh, 4, 8, {"up", true, 1, 0.1}), Act{}, Down(mesh, 8, 4, {"down", true, 1, 0.1}),
                                  weft::nn::Reduce<weft::TP>{}));
  typename Body::Saved s;
  Rep x(mesh, 2, 4), y(mesh, 2, 4);
  f.forward(x, y, s);
  f.backward(y, x, s);
}
template void chain<weft::nn::Gelu>(weft::Mesh<weft::TP>&);
template void chain<weft::nn::Relu>(weft::Mesh<weft::TP>&);
template void chain<weft::nn::Silu>(weft::Mesh<weft::TP>&);

int main() { return 0; }
