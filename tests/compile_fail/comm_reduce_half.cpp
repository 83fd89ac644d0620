// Misuse: summing bf16 elements with MPI, which would add their bit patterns.
#include <weft/comm/comm.hpp>
#include <weft/core/half.hpp>
void f(weft::Comm& c) {
  Kokkos::View<weft::bf16*> v("v", 4);
  c.all_reduce(v);
}
