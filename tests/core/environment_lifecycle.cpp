// Environment's lifecycle in a whole program: with mode "owns" it starts and
// stops MPI and Kokkos itself; with mode "app-mpi" the application starts MPI
// first, so Environment starts only Kokkos and MPI outlives it. Exit 0 only
// when every expectation holds.
#include <cstdio>
#include <cstring>

#include <weft/weft.hpp>

static int failures = 0;
#define EXPECT(c)                                                   \
  do {                                                              \
    if (!(c)) {                                                     \
      std::fprintf(stderr, "expectation failed: %s (line %d)\n", #c, __LINE__); \
      ++failures;                                                   \
    }                                                               \
  } while (0)

int main(int argc, char** argv) {
  const bool app_mpi = argc > 1 && std::strcmp(argv[1], "app-mpi") == 0;
  int init = 0, fin = 0;
  if (app_mpi) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  }
  {
    weft::Environment env(argc, argv);
    // The test passes "--threads 3 --kokkos-threads=1" after the mode: Kokkos
    // takes (and removes) its prefixed flag and leaves --threads 3, in a form
    // Kokkos 3 itself would abort on, to the program.
    EXPECT(argc == 4);
    if (argc == 4) {
      EXPECT(std::strcmp(argv[2], "--threads") == 0);
      EXPECT(std::strcmp(argv[3], "3") == 0);
    }
    EXPECT(env.owns_mpi() == !app_mpi);
    EXPECT(env.owns_kokkos());
    MPI_Initialized(&init);
    EXPECT(init == 1);
    EXPECT(Kokkos::is_initialized());
    Kokkos::View<double*> x("x", 3);
    Kokkos::deep_copy(x, 1.0);
    env.world().all_reduce(x);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
    EXPECT(h(2) == env.world().size());
  }
  MPI_Finalized(&fin);
  EXPECT(fin == (app_mpi ? 0 : 1));
  if (app_mpi) {
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);  // MPI still usable
    EXPECT(size >= 1);
    MPI_Finalize();
  }
  if (failures == 0) std::printf("environment lifecycle (%s): all expectations hold\n", app_mpi ? "app-mpi" : "owns");
  return failures == 0 ? 0 : 1;
}
