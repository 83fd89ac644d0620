// Misuse: communicating an element type that has no MPI datatype.
#include <weft/comm/comm.hpp>
struct Particle {
  double x, y;
};
void f(weft::Comm& c) {
  Kokkos::View<Particle*> v("v", 4);
  c.all_reduce(v);
}
