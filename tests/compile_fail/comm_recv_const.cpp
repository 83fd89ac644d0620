// Misuse: receiving into a view of const elements.
#include <weft/comm/comm.hpp>
void f(weft::Comm& c) {
  Kokkos::View<const float*> v = Kokkos::View<float*>("v", 4);
  c.recv(v, 0);
}
