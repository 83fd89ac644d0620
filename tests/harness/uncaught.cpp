// A weft program whose rank 1 lets an exception escape main while the other
// ranks wait in a collective: weft::Environment must end the whole job.
#include <stdexcept>

#include <weft/weft.hpp>

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& w = env.world();
  if (w.rank() == 1) throw std::runtime_error("deliberate uncaught error on rank 1");
  w.barrier();
  return 0;
}
