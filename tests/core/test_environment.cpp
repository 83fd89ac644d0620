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

TEST_CASE("a failed allocation is an AllocationError naming the tensor, its size and the space") {
  // 2^61 bytes no machine has; AddressSanitizer's allocator aborts on such a
  // request instead of failing it, so there only the message is checked.
  if (!weft::detail::sanitized_allocator()) {
    const std::size_t n = std::size_t(1) << 58;
    try {
      auto v = weft::allocate_view<Kokkos::View<double*, Kokkos::HostSpace>>("test.huge", n);
      FAIL("allocated " << v.size() << " doubles");
    } catch (const weft::AllocationError& e) {
      CHECK(e.label() == "test.huge");
      CHECK(e.bytes() == n * sizeof(double));
      CHECK(e.space() == Kokkos::HostSpace::name());
      CHECK(std::string(e.what()).find("cannot allocate tensor \"test.huge\" of 2305843009213693952 bytes (2147483648.00 GiB) in " +
                                       std::string(Kokkos::HostSpace::name()) + ": ") == 0);
    }
  }
  // Kokkos' own report of an allocation made anywhere (its text, traceback note included).
  const std::runtime_error kokkos(
      "Kokkos failed to allocate memory for label \"blocks.0.mlp.up\".  Allocation using MemorySpace named \"Host\" "
      "failed with the following error:  Allocation of size 128 M failed, likely due to insufficient memory.  (The "
      "allocation mechanism was standard malloc().)\n\nTraceback functionality not available\n");
  const auto a = weft::as_allocation_error(kokkos);
  REQUIRE(a.has_value());
  CHECK(a->label() == "blocks.0.mlp.up");
  CHECK(a->bytes() == std::size_t(128) << 20);
  CHECK(a->space() == "Host");
  CHECK(std::string(a->what()).find("cannot allocate tensor \"blocks.0.mlp.up\" of about 134217728 bytes (128.0 MiB) in Host: out of memory") == 0);
  CHECK(std::string(a->what()).find("Traceback") == std::string::npos);
  // Kokkos 4's report (Kokkos::Impl::throw_bad_alloc), as a Kokkos 4.6
  // OpenMP build of train_gpt printed it.
  const std::runtime_error kokkos4("Kokkos ERROR: Host memory space failed to allocate 8 GiB (label=\"attn.dprobs\").");
  const auto b = weft::as_allocation_error(kokkos4);
  REQUIRE(b.has_value());
  CHECK(b->label() == "attn.dprobs");
  CHECK(b->bytes() == std::size_t(8) << 30);
  CHECK(b->space() == "Host");
  CHECK(std::string(b->what()).find("cannot allocate tensor \"attn.dprobs\" of about 8589934592 bytes (8.00 GiB) in Host: out of memory") == 0);
  const auto c = weft::as_allocation_error(std::runtime_error("Kokkos ERROR: Cuda memory space failed to allocate 1.5 MiB (label=\"x\")."));
  REQUIRE(c.has_value());
  CHECK(c->bytes() == std::size_t(1.5 * 1048576));
  CHECK(c->space() == "Cuda");
  CHECK_FALSE(weft::as_allocation_error(std::runtime_error("something else")).has_value());
}

#if defined(__GLIBC__)
#include <malloc.h>

#include <cstdlib>
#include <cstring>

// The harness' Environment applied keep_large_host_allocations(): a large
// block must come from the heap (no mmap'ed bytes added) and its memory must
// stay with the process after free, so the next large block reuses it. With
// WEFT_HOST_MALLOC=system (the second CTest entry of this file) glibc's own
// behaviour must remain: the same block is mmap'ed.
TEST_CASE("large host buffers stay in the heap unless WEFT_HOST_MALLOC=system") {
  const char* env = std::getenv("WEFT_HOST_MALLOC");
  const bool system = env != nullptr && std::string(env) == "system";
  const auto& policy = weft::host_allocator_policy();
  INFO("policy: " << policy.mode << " (" << policy.reason << ")");
  if (weft::detail::sanitized_allocator()) {
    CHECK(policy.mode == "system");
    return;
  }
  CHECK(policy.keeps_large() == !system);
  CHECK(weft::keep_large_host_allocations().mode == policy.mode);  // idempotent
  const std::size_t bytes = std::size_t(48) << 20;
  const auto mapped_before = mallinfo2().hblkhd;
  auto* block = static_cast<char*>(std::malloc(bytes));
  REQUIRE(block != nullptr);
  std::memset(block, 1, bytes);
  const auto mapped_during = mallinfo2().hblkhd;
  std::free(block);
  if (system) {
    CHECK(mapped_during >= mapped_before + bytes);
  } else {
    CHECK(mapped_during == mapped_before);
    const auto heap_after_free = mallinfo2().arena;
    CHECK(heap_after_free >= bytes);  // not returned to the system
    auto* again = static_cast<char*>(std::malloc(bytes));
    REQUIRE(again != nullptr);
    CHECK(mallinfo2().arena == heap_after_free);  // reused, the heap did not grow
    std::free(again);
  }
}
#endif
