// An error raised after a program's checks, caught at its top level and
// handed to weft::report_error_once, is printed once in the job and ends it.
//   error_once --alone R   rank R raises; the others wait in an all_reduce for
//                          it: rank R prints its error and ends the job
//   error_once --ranks A,B ranks A and B raise the same error, the others
//                          wait: one of them prints (one report per node)
//   error_once             every rank raises the same error: rank 0 prints
//                          it, and every rank exits 2 without MPI_Abort
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include <weft/weft.hpp>

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  std::set<int> failing;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--alone") == 0) failing.insert(std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--ranks") == 0)
      for (const char* p = argv[i + 1]; *p != '\0'; ++p)
        if (p == argv[i + 1] || p[-1] == ',') failing.insert(std::atoi(p));
  }
  auto& w = env.world();
  const bool fails = failing.empty() || failing.count(w.rank()) > 0;
  try {
    if (fails) throw weft::ConfigError("the model cannot be built: an invalid combination found after the checks");
    Kokkos::View<float*> x("x", 8);
    w.all_reduce(x);  // waits for the failing ranks, which never arrive
  } catch (const weft::Error& e) {
    return weft::report_error_once(env, e, "error_once", 2);
  }
  return 0;
}
