// Environment inside a running program: MPI and Kokkos are already started by
// the test harness' own Environment, so a second one must leave them alone.
#include "weft_test.hpp"

TEST_CASE("an Environment respects an MPI and a Kokkos that are already initialised") {
  {
    weft::Environment env;
    CHECK_FALSE(env.owns_mpi());
    CHECK_FALSE(env.owns_kokkos());
    CHECK(env.thread_level() >= MPI_THREAD_FUNNELED);
    CHECK(env.world().size() == weft::test::world().size());
    CHECK(env.world().rank() == weft::test::world().rank());
    CHECK(env.world().name() == "world");
    // weft's world is a duplicate: MPI_COMM_WORLD itself is untouched.
    int cmp = 0;
    MPI_Comm_compare(env.world().native(), MPI_COMM_WORLD, &cmp);
    CHECK(cmp == MPI_CONGRUENT);
  }
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  CHECK(init == 1);
  CHECK(fin == 0);
  CHECK(Kokkos::is_initialized());
  weft::test::world().barrier();
}

TEST_CASE("asking for a thread level MPI does not provide is a ConfigError") {
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided >= MPI_THREAD_MULTIPLE) return;  // nothing to refuse
  try {
    weft::Environment env(MPI_THREAD_MULTIPLE);
    FAIL("no error");
  } catch (const weft::ConfigError& e) {
    CHECK(std::string(e.what()).find("but MPI_THREAD_MULTIPLE was requested") != std::string::npos);
  }
}

TEST_CASE("weft's error types and WEFT_REQUIRE") {
  try {
    WEFT_REQUIRE(1 + 1 == 3, weft::ShapeError, "dimension ", 0, " has size ", 10, ", not divisible by ", 3);
    FAIL("no error");
  } catch (const weft::Error& e) {
    CHECK(std::string(e.what()) == "dimension 0 has size 10, not divisible by 3");
    CHECK(dynamic_cast<const weft::ShapeError*>(&e) != nullptr);
  }
  CHECK_NOTHROW(WEFT_REQUIRE(true, weft::ConfigError, "never"));
  weft::CommError ce("all_gather", "tp", "text");
  CHECK(ce.operation() == "all_gather");
  CHECK(ce.axis() == "tp");
  CHECK(std::string(weft::version_string) == WEFT_VERSION_STRING);
  CHECK(weft::kokkos_version >= 30400);
}
