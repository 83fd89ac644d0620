// Checked mode turns a hang into an error: rank 1 never joins the all_reduce,
// so the others' wait passes its deadline and raises weft::CommError, which
// names the operation and the axis and ends the job.
#include <chrono>
#include <cstdio>
#include <thread>

#include <weft/weft.hpp>

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& w = env.world();
  w.set_checked(true, 2.0);
  Kokkos::View<float*> x("x", 8);
  if (w.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // never joins
    return 0;
  }
  try {
    w.all_reduce(x);
  } catch (const weft::CommError& e) {
    std::printf("rank %d caught weft::CommError (operation %s, axis %s): %s\n", w.rank(), e.operation().c_str(),
                e.axis().c_str(), e.what());
    std::fflush(stdout);
    throw;
  }
  return 0;
}
