// Misuse: asking a mesh for an axis it does not have.
#include <weft/mesh/mesh.hpp>
void f(weft::Comm& c) {
  weft::Mesh<weft::DP> m(c, 1);
  (void)m.axis<weft::TP>();
}
