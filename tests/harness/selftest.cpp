// Test cases that fail on purpose, to prove the harness' own promises: a check
// failing on one rank fails the run and is named on rank 0; an exception on one
// rank while the others block ends the run within a bounded time; a hang on
// every rank is ended by the per-test watchdog. CTest runs each case by name
// (see tests/CMakeLists.txt) and expects the failure and its message.
#include <chrono>
#include <thread>

#include "weft_test.hpp"

TEST_CASE("selftest: passes everywhere") {
  CHECK(weft::test::world().size() >= 1);
}

TEST_CASE("selftest: check fails on rank 1 only") {
  const int me = weft::test::world().rank();
  CHECK(me != 1);
}

TEST_CASE("selftest: exception on rank 1 while the others block") {
  auto& w = weft::test::world();
  if (w.rank() == 1) throw std::runtime_error("deliberate failure on rank 1");
  MPI_Barrier(w.native());  // never completes: rank 1 does not come
}

TEST_CASE("selftest: every rank hangs") {
  std::this_thread::sleep_for(std::chrono::hours(1));
}
