// DistView construction (local shapes, global indices, divisibility errors),
// round trips, multi-axis and nested sharding, non-blocking redistribution,
// reused destinations and the communicator-named form.
#include <string>

#include "placement_test_util.hpp"

using namespace weft;
using weft::test::contains;
using weft::test::contribution;
using weft::test::error_text;
using weft::test::fill;
using weft::test::global_value;
using weft::test::mismatches;
using weft::test::reduced;
using weft::test::wrong;

namespace {

auto identity = [](std::size_t g) { return global_value<double>(g); };

}  // namespace

TEST_CASE("a DistView's local block and global indices follow its placements") {
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<TP> mesh(world, w);
  const int c = mesh.coord<TP>();
  DistView<float, 2, On<TP, Shard<1>>> x(mesh, 6, 4 * w);
  CHECK(x.local().extent(0) == 6);
  CHECK(x.local().extent(1) == 4);
  CHECK(x.offset(0) == 0);
  CHECK(x.offset(1) == std::size_t(4 * c));
  CHECK(x.global_index({5, 3}) == std::array<std::size_t, 2>{5, std::size_t(4 * c + 3)});
  const auto m = x.index_map();
  CHECK(m.global_linear(0) == std::size_t(4 * c));
  CHECK(m.global_linear(5) == std::size_t(4 * w + 4 * c + 1));  // local (1, 1)

  // Unnamed axes are replicated; Replicate and Partial keep the global shape.
  DistView<int, 1, On<TP, Partial<Sum>>> y(mesh, std::array<std::size_t, 1>{10});
  CHECK(y.local().extent(0) == 10);
  CHECK(y.offset(0) == 0);

  // Wrapping an existing block checks its extents.
  DistView<double, 1, On<TP, Shard<0>>>::view_type block("block", 3);
  DistView<double, 1, On<TP, Shard<0>>> z(mesh, {std::size_t(3 * w)}, block);
  CHECK(z.local().data() == block.data());
  DistView<double, 1, On<TP, Shard<0>>>::view_type wrong_block("wrong", 4);
  if (w > 1) {
    const auto e = error_text([&] { DistView<double, 1, On<TP, Shard<0>>> bad(mesh, {std::size_t(3 * w)}, wrong_block); });
    CHECK(contains(e, "the local view 'wrong' has extent 4 in dimension 0, but the placements give this rank 3"));
  }
}

TEST_CASE("a local block too large to allocate is an AllocationError naming the tensor and its size") {
  // Not under AddressSanitizer, whose allocator aborts on such a request instead of failing it.
  if (weft::detail::sanitized_allocator()) return;
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<TP> mesh(world, w);
  const std::size_t per_rank = std::size_t(1) << 58;  // 2^61 bytes of doubles on every rank
  try {
    DistView<double, 1, On<TP, Shard<0>>> x(mesh, {per_rank * std::size_t(w)}, std::string("test.too_big"));
    FAIL("allocated " << x.local().size() << " doubles");
  } catch (const weft::AllocationError& e) {
    CHECK(e.label() == "test.too_big");
    CHECK(e.bytes() == per_rank * sizeof(double));
    CHECK(contains(e.what(), "cannot allocate tensor \"test.too_big\" of 2305843009213693952 bytes"));
  }
}

TEST_CASE("indivisible sharded extents are errors that name dimension, size and axis") {
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<TP> mesh(world, w);
  using V = DistView<float, 2, On<TP, Shard<1>>>;
  if (w > 1) {
    CHECK_THROWS_AS(V(mesh, 4, 2 * w + 1), ShapeError);
    const auto e = error_text([&] { V(mesh, 4, 2 * w + 1); });
    CHECK(contains(e, "dimension 1 has global size " + std::to_string(2 * w + 1)));
    CHECK(contains(e, "not divisible by " + std::to_string(w) + ", the size of mesh axis 'tp'"));
    CHECK(contains(e, "weft does not pad"));
  }
  CHECK_NOTHROW(V(mesh, 4, 2 * w));

  // Two axes splitting one dimension need their product to divide it.
  for (int dp = 2; dp < w; ++dp) {
    if (w % dp != 0) continue;
    Mesh<DP, TP> m2(world, dp, w / dp);
    using N = DistView<float, 1, On<DP, Shard<0>>, On<TP, Shard<0>>>;
    const auto e2 = error_text([&] { N(m2, std::array<std::size_t, 1>{std::size_t(dp)}); });
    CHECK(contains(e2, "not divisible by " + std::to_string(w) + ", the size of mesh axis 'dp' x 'tp'"));
    CHECK_NOTHROW(N(m2, std::array<std::size_t, 1>{std::size_t(2 * w)}));
  }

  // A static extent must match the global extent given.
  using S = BasicDistView<float, Extents<8, dynamic_extent>, Kokkos::HostSpace, On<TP, Shard<1>>>;
  const auto e3 = error_text([&] { S(mesh, 9, w); });
  CHECK(contains(e3, "dimension 0 has the static extent 8, but the global extent given is 9"));
  CHECK_NOTHROW(S(mesh, 8, w));

  // Redistributing over an axis the tensor is not placed over (here one the
  // mesh does not have) no longer compiles:
  // compile_fail.strategy_redistribute_missing_axis_{replicate,shard}.
}

TEST_CASE_TEMPLATE("round trips reproduce the original exactly", T, float, double, int) {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  const int p = mesh.extent<TP>(), c = mesh.coord<TP>();
  const std::array<std::size_t, 3> global{8, 8, 16};

  // Shard -> Replicate -> Shard, over a non-leading dimension.
  DistView<T, 3, On<TP, Shard<1>>> x(mesh, global);
  fill(x, [](std::size_t g) { return global_value<T>(g); });
  auto back = redistribute<Shard<1>>(redistribute<Replicate>(x, TP{}), TP{});
  static_assert(std::is_same_v<decltype(back), decltype(x)>);
  auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x.local());
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back.local());
  std::size_t diff = 0;
  for (std::size_t n = 0; n < hx.size(); ++n) diff += hx.data()[n] != hb.data()[n];
  CHECK(wrong("Shard<1> -> Replicate -> Shard<1>", diff) == wrong("Shard<1> -> Replicate -> Shard<1>", 0));

  // Shard<0> -> Shard<2> -> Shard<0>.
  auto back2 = redistribute<Shard<0>>(redistribute<Shard<2>>(back, TP{}), TP{});
  auto h2 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back2.local());
  CHECK(wrong("Shard<0> -> Shard<2> -> Shard<0>", mismatches(back2, [](std::size_t g) { return global_value<T>(g); })) ==
        wrong("Shard<0> -> Shard<2> -> Shard<0>", 0));

  // Partial -> Shard -> Replicate equals the reduced tensor, as Partial -> Replicate does.
  DistView<T, 3, On<TP, Partial<Sum>>> s(mesh, global);
  fill(s, [&](std::size_t g) { return contribution<Sum>(global_value<T>(g), c); });
  auto full = redistribute<Replicate>(redistribute<Shard<2>>(s, TP{}), TP{});
  auto direct = redistribute<Replicate>(s, TP{});
  auto expect = [&](std::size_t g) { return reduced<Sum>(global_value<T>(g), p); };
  CHECK(wrong("Partial -> Shard<2> -> Replicate", mismatches(full, expect)) == wrong("Partial -> Shard<2> -> Replicate", 0));
  CHECK(wrong("Partial -> Replicate", mismatches(direct, expect)) == wrong("Partial -> Replicate", 0));
}

TEST_CASE("multi-axis redistribution, nested sharding and partial values over two axes") {
  auto& world = weft::test::world();
  const int w = world.size();
  for (int dp = 1; dp <= w; ++dp) {
    if (w % dp != 0) continue;
    Mesh<DP, TP> mesh(world, dp, w / dp);
    const int tp = w / dp;
    const std::string what = mesh.describe();
    const std::array<std::size_t, 2> global{16, 8};

    // Both axes split dimension 0 (DP outer): gather the inner axis first.
    DistView<double, 2, On<DP, Shard<0>>, On<TP, Shard<0>>> x(mesh, global);
    CHECK(x.local().extent(0) == std::size_t(16 / w));
    CHECK(x.offset(0) == std::size_t((mesh.coord<DP>() * tp + mesh.coord<TP>()) * (16 / w)));
    fill(x, identity);
    auto r = redistribute<On<TP, Replicate>, On<DP, Replicate>>(x);
    CHECK(r.local().extent(0) == 16);
    CHECK(wrong(what + " nested gather", mismatches(r, identity)) == wrong(what + " nested gather", 0));
    // And back, outer axis first, from a fully replicated tensor.
    auto back = redistribute<On<DP, Shard<0>>, On<TP, Shard<0>>>(redistribute<On<TP, Replicate>>(r));
    static_assert(std::is_same_v<decltype(back), DistView<double, 2, On<DP, Shard<0>>, On<TP, Shard<0>>>>);
    CHECK(back.offset(0) == x.offset(0));
    CHECK(wrong(what + " nested slice", mismatches(back, identity)) == wrong(what + " nested slice", 0));

    // Partial over both axes: all-reduce over TP, then reduce-scatter over DP.
    DistView<double, 2, On<DP, Partial<Sum>>, On<TP, Partial<Sum>>> s(mesh, global);
    fill(s, [&](std::size_t g) {
      return contribution<Sum>(contribution<Sum>(identity(g), mesh.coord<DP>()), mesh.coord<TP>());
    });
    auto y = redistribute<On<TP, Replicate>, On<DP, Shard<1>>>(s);
    static_assert(std::is_same_v<decltype(y), DistView<double, 2, On<DP, Shard<1>>, On<TP, Replicate>>>);
    CHECK(wrong(what + " two partial axes", mismatches(y, [&](std::size_t g) {
            return reduced<Sum>(reduced<Sum>(identity(g), dp), tp);
          })) == wrong(what + " two partial axes", 0));
  }
}

TEST_CASE("non-blocking redistribution overlaps and completes") {
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<TP> mesh(world, w);
  DistView<float, 2, On<TP, Shard<1>>> x(mesh, 4, 2 * w);
  fill(x, [](std::size_t g) { return global_value<float>(g); });
  auto pending = iredistribute<Replicate>(x, TP{});
  while (!pending.test()) {
  }
  CHECK(pending.done());
  auto y = pending.wait();
  CHECK(mismatches(y, [](std::size_t g) { return global_value<float>(g); }) == 0);

  // Into a reused destination, twice; the second sees new values.
  decltype(y) dest(mesh, 4, 2 * w);
  for (int round = 1; round <= 2; ++round) {
    fill(x, [&](std::size_t g) { return global_value<float>(g) * float(round); });
    auto h = iredistribute<Replicate>(x, TP{}, dest);
    auto got = h.wait();
    CHECK(got.local().data() == dest.local().data());
    CHECK(mismatches(dest, [&](std::size_t g) { return global_value<float>(g) * float(round); }) == 0);
  }
  redistribute<Shard<1>>(dest, TP{}, x);
  CHECK(mismatches(x, [&](std::size_t g) { return global_value<float>(g) * 2.0f; }) == 0);

  // Multi-axis, non-blocking: the second collective starts when the first completes.
  for (int dp = 1; dp <= w; ++dp) {
    if (w % dp != 0) continue;
    Mesh<DP, TP> m2(world, dp, w / dp);
    DistView<double, 2, On<DP, Shard<1>>, On<TP, Partial<Sum>>> s(m2, 8, 8);
    fill(s, [&](std::size_t g) { return contribution<Sum>(identity(g), m2.coord<TP>()); });
    auto h = iredistribute<On<TP, Shard<0>>, On<DP, Replicate>>(s);
    auto z = h.wait();
    CHECK(h.done());
    CHECK(mismatches(z, [&](std::size_t g) { return reduced<Sum>(identity(g), w / dp); }) == 0);
  }
}

TEST_CASE("the communicator-named form checks that it is the view's axis") {
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<DP, TP> mesh(world, 1, w);
  DistView<double, 1, On<TP, Partial<Sum>>> x(mesh, std::array<std::size_t, 1>{8});
  fill(x, identity);
  auto y = redistribute<Replicate>(x, mesh.axis<TP>());
  CHECK(mismatches(y, [&](std::size_t g) { return identity(g) * w; }) == 0);
  if (w > 1) {
    const auto e = error_text([&] { (void)redistribute<Replicate>(x, mesh.axis<DP>()); });
    CHECK(contains(e, "the communicator 'dp' is not the mesh axis 'tp'"));
  }
}
