// A wait past its deadline ends the job instead of hanging it. Rank 1 never
// joins the all_reduce (it sleeps, or with --stop it stops itself with
// SIGSTOP). Checked mode (the default of this program): the others' wait
// raises weft::CommError, which names the operation and the axis and ends the
// job. With --default the communicator stays in the default mode, where the
// blocking MPI call is bounded by the watchdog of weft::Environment, which
// ends the job with a message naming rank 1 and why it did not arrive.
// --barrier waits in the node-shared paths' barrier (what redistribute's
// node-local transports synchronise with) instead of the all_reduce.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include <weft/weft.hpp>

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  bool default_mode = false, stop = false, barrier = false;
  for (int i = 1; i < argc; ++i) {
    default_mode = default_mode || std::strcmp(argv[i], "--default") == 0;
    stop = stop || std::strcmp(argv[i], "--stop") == 0;
    barrier = barrier || std::strcmp(argv[i], "--barrier") == 0;
  }
  auto& w = env.world();
  if (default_mode) w.set_deadline(2.0);
  else w.set_checked(true, 2.0);
  Kokkos::View<float*> x("x", 8);
  if (w.rank() == 1) {
    if (stop) raise(SIGSTOP);
    std::this_thread::sleep_for(std::chrono::seconds(60));  // never joins
    return 0;
  }
  try {
    if (barrier) weft::detail::shared_barrier(weft::detail::sync_site(w), "the test's barrier");
    else w.all_reduce(x);
  } catch (const weft::CommError& e) {
    std::printf("rank %d caught weft::CommError (operation %s, axis %s): %s\n", w.rank(), e.operation().c_str(),
                e.axis().c_str(), e.what());
    std::fflush(stdout);
    throw;
  }
  return 0;
}
