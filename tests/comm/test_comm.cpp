// Every Comm collective and point-to-point call, on several element types and
// view shapes, blocking and non-blocking, unchecked and checked, against values
// computed by hand on every rank; plus the errors raised before MPI is called.
#include <complex>
#include <cstdint>
#include <string>
#include <vector>

#include "weft_test.hpp"

namespace {

using weft::Comm;
using weft::CommError;
using weft::CommKind;
using weft::ReduceOp;

// Value of element i on rank r: small, so sums over 8 ranks fit every type.
template <class T>
T val(int r, std::size_t i) {
  return T(static_cast<double>((r + 1) + static_cast<int>(i % 3)));
}

template <class T, class Mem>
using V1 = Kokkos::View<T*, Mem>;

template <class T, class Mem>
V1<T, Mem> make(const std::string& label, std::size_t n, int r, std::size_t offset = 0) {
  V1<T, Mem> v(label, n);
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < n; ++i) h(i) = val<T>(r, offset + i);
  Kokkos::deep_copy(v, h);
  return v;
}

template <class V>
auto host(const V& v) {
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
}

// A private duplicate of the world, so statistics and modes start clean.
Comm fresh(bool checked) {
  Comm c = Comm::duplicate(weft::test::world().native(), "t");
  c.set_checked(checked, 30.0);
  return c;
}

template <class T, class Mem>
void check_all_reduce(Comm& c, bool nonblocking) {
  const int p = c.size(), me = c.rank();
  const std::size_t n = 7;
  std::vector<ReduceOp> ops{ReduceOp::sum, ReduceOp::max, ReduceOp::min};
  if constexpr (std::is_floating_point_v<T>) ops.push_back(ReduceOp::avg);
  for (ReduceOp op : ops) {
    auto s = make<T, Mem>("s", n, me);
    V1<T, Mem> r("r", n);
    if (nonblocking) {
      auto q = c.iall_reduce(s, r, op);
      q.wait();
      CHECK_FALSE(q.active());
    } else {
      c.all_reduce(s, r, op);
    }
    auto in_place = make<T, Mem>("ip", n, me);
    c.all_reduce(in_place, op);
    auto hr = host(r);
    auto hi = host(in_place);
    for (std::size_t i = 0; i < n; ++i) {
      double sum = 0, mx = -1e300, mn = 1e300;
      for (int q = 0; q < p; ++q) {
        const double x = static_cast<double>(val<T>(q, i));
        sum += x;
        mx = std::max(mx, x);
        mn = std::min(mn, x);
      }
      const double want = op == ReduceOp::sum ? sum : op == ReduceOp::max ? mx : op == ReduceOp::min ? mn : sum / p;
      INFO("op ", weft::to_string(op), " element ", i);
      CHECK(static_cast<double>(hr(i)) == doctest::Approx(want));
      CHECK(static_cast<double>(hi(i)) == doctest::Approx(want));
    }
  }
}

template <class T, class Mem>
void check_all_gather(Comm& c, bool nonblocking) {
  const int p = c.size(), me = c.rank();
  const std::size_t n = 5;
  auto s = make<T, Mem>("s", n, me);
  V1<T, Mem> r("r", n * static_cast<std::size_t>(p));
  if (nonblocking) c.iall_gather(s, r).wait();
  else c.all_gather(s, r);
  auto h = host(r);
  for (int q = 0; q < p; ++q)
    for (std::size_t i = 0; i < n; ++i) CHECK(h(static_cast<std::size_t>(q) * n + i) == val<T>(q, i));
}

template <class T, class Mem>
void check_reduce_scatter(Comm& c, bool nonblocking) {
  const int p = c.size(), me = c.rank();
  const std::size_t n = 4;
  auto s = make<T, Mem>("s", n * static_cast<std::size_t>(p), me);
  V1<T, Mem> r("r", n);
  if (nonblocking) c.ireduce_scatter(s, r).wait();
  else c.reduce_scatter(s, r);
  auto h = host(r);
  for (std::size_t i = 0; i < n; ++i) {
    double want = 0;
    for (int q = 0; q < p; ++q) want += static_cast<double>(val<T>(q, static_cast<std::size_t>(me) * n + i));
    CHECK(static_cast<double>(h(i)) == doctest::Approx(want));
  }
}

// Element i of the block rank `from` sends to rank `to`.
template <class T>
T code(int from, int to, int p, std::size_t i) {
  return T(static_cast<double>((from * p + to) * 3 + static_cast<int>(i)));
}

template <class T, class Mem>
void check_all_to_all(Comm& c, bool nonblocking) {
  const int p = c.size(), me = c.rank();
  const std::size_t n = 3;
  V1<T, Mem> s("s", n * static_cast<std::size_t>(p)), r("r", n * static_cast<std::size_t>(p));
  auto hs = Kokkos::create_mirror_view(s);
  for (int j = 0; j < p; ++j)
    for (std::size_t i = 0; i < n; ++i) hs(static_cast<std::size_t>(j) * n + i) = code<T>(me, j, p, i);
  Kokkos::deep_copy(s, hs);
  if (nonblocking) c.iall_to_all(s, r).wait();
  else c.all_to_all(s, r);
  auto h = host(r);
  for (int j = 0; j < p; ++j)
    for (std::size_t i = 0; i < n; ++i) CHECK(h(static_cast<std::size_t>(j) * n + i) == code<T>(j, me, p, i));
}

template <class T, class Mem>
void check_all_to_allv(Comm& c, bool nonblocking) {
  const int p = c.size(), me = c.rank();
  // Rank r sends j+1 elements to rank j, so it receives me+1 from everyone.
  std::vector<int> sc(static_cast<std::size_t>(p)), rc(static_cast<std::size_t>(p), me + 1);
  std::size_t stot = 0;
  for (int j = 0; j < p; ++j) stot += static_cast<std::size_t>(sc[static_cast<std::size_t>(j)] = j + 1);
  V1<T, Mem> s("s", stot), r("r", static_cast<std::size_t>(p * (me + 1)));
  auto hs = Kokkos::create_mirror_view(s);
  std::size_t k = 0;
  for (int j = 0; j < p; ++j)
    for (int i = 0; i < j + 1; ++i) hs(k++) = code<T>(me, j, p, static_cast<std::size_t>(i));
  Kokkos::deep_copy(s, hs);
  if (nonblocking) c.iall_to_allv(s, sc, r, rc).wait();
  else c.all_to_allv(s, std::span<const int>(sc), r, std::span<const int>(rc));
  auto h = host(r);
  k = 0;
  for (int j = 0; j < p; ++j)
    for (int i = 0; i < me + 1; ++i) CHECK(h(k++) == code<T>(j, me, p, static_cast<std::size_t>(i)));
}

template <class T, class Mem>
void check_broadcast(Comm& c, bool nonblocking) {
  const int p = c.size(), me = c.rank();
  const int root = p - 1;
  auto b = make<T, Mem>("b", 6, me);
  if (nonblocking) c.ibroadcast(b, root).wait();
  else c.broadcast(b, root);
  auto h = host(b);
  for (std::size_t i = 0; i < 6; ++i) CHECK(h(i) == val<T>(root, i));
}

template <class T, class Mem>
void check_point_to_point(Comm& c) {
  const int p = c.size(), me = c.rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  // Ring with sendrecv.
  auto s = make<T, Mem>("s", 4, me);
  V1<T, Mem> r("r", 4);
  c.sendrecv(s, next, r, prev, 7);
  auto h = host(r);
  for (std::size_t i = 0; i < 4; ++i) CHECK(h(i) == val<T>(prev, i));
  // The same ring with isend/irecv, completed in the opposite order.
  V1<T, Mem> r2("r2", 4);
  auto rq = c.irecv(r2, prev, 9);
  auto sq = c.isend(s, next, 9);
  rq.wait();
  sq.wait();
  auto h2 = host(r2);
  for (std::size_t i = 0; i < 4; ++i) CHECK(h2(i) == val<T>(prev, i));
  // Blocking pairs between even and odd ranks.
  if (p >= 2 && (me ^ 1) < p) {
    V1<T, Mem> r3("r3", 4);
    if (me % 2 == 0) {
      c.send(s, me ^ 1, 3);
      c.recv(r3, me ^ 1, 3);
    } else {
      c.recv(r3, me ^ 1, 3);
      c.send(s, me ^ 1, 3);
    }
    auto h3 = host(r3);
    for (std::size_t i = 0; i < 4; ++i) CHECK(h3(i) == val<T>(me ^ 1, i));
  }
}

template <class T, class Mem>
void check_all_kinds(bool checked) {
  for (bool nb : {false, true}) {
    Comm c = fresh(checked);
    INFO("checked ", checked, " non-blocking ", nb);
    check_all_reduce<T, Mem>(c, nb);
    check_all_gather<T, Mem>(c, nb);
    check_reduce_scatter<T, Mem>(c, nb);
    check_all_to_all<T, Mem>(c, nb);
    check_all_to_allv<T, Mem>(c, nb);
    check_broadcast<T, Mem>(c, nb);
  }
  Comm c = fresh(checked);
  check_point_to_point<T, Mem>(c);
  c.barrier();
}

}  // namespace

TEST_CASE_TEMPLATE("every collective on every element type matches hand-computed values", Exec, WEFT_TEST_EXEC_SPACES) {
  using Mem = typename Exec::memory_space;
  for (bool checked : {false, true}) {
    check_all_kinds<float, Mem>(checked);
    check_all_kinds<double, Mem>(checked);
    check_all_kinds<std::int32_t, Mem>(checked);
    check_all_kinds<std::int64_t, Mem>(checked);
    check_all_kinds<std::uint8_t, Mem>(checked);
  }
}

TEST_CASE("complex elements reduce and broadcast") {
  Comm c = fresh(false);
  using C = std::complex<double>;
  Kokkos::View<C*, Kokkos::HostSpace> v("v", 3);
  for (std::size_t i = 0; i < 3; ++i) v(i) = C(c.rank() + 1.0, double(i));
  c.all_reduce(v, ReduceOp::avg);
  const double p = c.size();
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(v(i).real() == doctest::Approx((p + 1) / 2));
    CHECK(v(i).imag() == doctest::Approx(double(i)));
  }
  CHECK_THROWS_AS(c.all_reduce(v, ReduceOp::max), CommError);
}

TEST_CASE("views of rank 2 and 3 and LayoutLeft are flattened in memory order") {
  Comm c = fresh(false);
  const int p = c.size(), me = c.rank();
  Kokkos::View<double**, Kokkos::LayoutLeft> a("a", 3, 4);
  Kokkos::View<double***> g("g", static_cast<std::size_t>(p), 3, 4);
  auto ha = Kokkos::create_mirror_view(a);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) ha(i, j) = me * 100 + i * 10 + j;
  Kokkos::deep_copy(a, ha);
  // all_gather into a rank-3 LayoutRight view: block q is rank q's buffer in
  // its memory order (LayoutLeft: i fastest).
  c.all_gather(a, g);
  auto hg = host(g);
  for (int q = 0; q < p; ++q) {
    const double* block = hg.data() + static_cast<std::size_t>(q) * 12;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 3; ++i) CHECK(block[j * 3 + i] == q * 100 + i * 10 + j);
  }
}

TEST_CASE("statistics count calls and bytes per kind") {
  Comm c = fresh(false);
  const auto p = static_cast<std::size_t>(c.size());
  Kokkos::View<float*> x("x", 256), g("g", 256 * p), rs("rs", 256 / 1);
  Kokkos::View<float*> big("big", 256 * p);
  c.all_reduce(x);
  c.all_reduce(x);
  c.all_gather(x, g);
  c.reduce_scatter(big, rs);
  auto q = c.iall_reduce(x);
  q.wait();
  c.broadcast(x, 0);
  const auto& s = c.stats();
  CHECK(s[CommKind::all_reduce].calls == 3);
  CHECK(s[CommKind::all_reduce].bytes == 3 * 256 * sizeof(float));
  CHECK(s[CommKind::all_gather].calls == 1);
  CHECK(s[CommKind::all_gather].bytes == 256 * p * sizeof(float));
  CHECK(s[CommKind::reduce_scatter].bytes == 256 * p * sizeof(float));
  CHECK(s[CommKind::broadcast].bytes == 256 * sizeof(float));
  CHECK(s[CommKind::all_to_all].calls == 0);
  CHECK(s.total().calls == 6);
  CHECK(s[CommKind::all_reduce].seconds >= s[CommKind::all_reduce].exposed_seconds * 0.999);
  CHECK(s[CommKind::all_reduce].exposed_seconds >= 0.0);
  const std::string js = s.to_json();
  CHECK(js.find("\"all_reduce\": {\"calls\": 3") != std::string::npos);
  CHECK(js.find("all_to_all") == std::string::npos);
  c.reset_stats();
  CHECK(c.stats().total().calls == 0);
}

TEST_CASE("a request tests until done and completes when destroyed") {
  Comm c = fresh(false);
  Kokkos::View<double*> x("x", 16);
  Kokkos::deep_copy(x, 1.0);
  {
    auto q = c.iall_reduce(x);
    while (!q.test()) {
    }
    CHECK_FALSE(q.active());
    CHECK(q.test());
  }
  {
    auto q = c.iall_reduce(x);  // destroyed pending: waits
  }
  auto h = host(x);
  CHECK(h(0) == doctest::Approx(double(c.size()) * c.size()));
  CHECK(c.stats()[CommKind::all_reduce].calls == 2);
}

TEST_CASE("every wait has a deadline by default; set_deadline changes it, 0 turns it off") {
  Comm c = fresh(false);
  CHECK(c.deadline() > 0);  // WEFT_DEADLINE, or the harness' default
  c.set_deadline(7.5);
  CHECK(c.deadline() == 7.5);
  Kokkos::View<double*> x("x", 4);
  Kokkos::deep_copy(x, 1.0);
  c.all_reduce(x);  // a wait well within the bound completes as before
  CHECK(host(x)(0) == doctest::Approx(double(c.size())));
  c.set_deadline(0);
  CHECK(c.deadline() == 0);
  c.all_reduce(x);
  CHECK(host(x)(0) == doctest::Approx(double(c.size()) * c.size()));
  CHECK_THROWS_WITH_AS(c.set_deadline(-1), doctest::Contains("the deadline must be >= 0 seconds"), weft::ConfigError);
  // The watchdog that keeps the bound runs in every process of the harness.
  CHECK(weft::detail::wait_mark().enabled.load());
}

TEST_CASE("bad arguments raise CommError before MPI is called") {
  Comm c = fresh(false);
  const auto p = static_cast<std::size_t>(c.size());
  Kokkos::View<float*> a("a", 4), b("b", 5), g("g", 4 * p + 1);
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (const CommError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string m = msg([&] { c.all_reduce(a, b); });
  CHECK(m.find("all_reduce needs equal sizes") != std::string::npos);
  CHECK(m.find("axis 't'") != std::string::npos);
  m = msg([&] { c.all_gather(a, g); });
  CHECK(m.find("expected " + std::to_string(p) + " ranks x 4") != std::string::npos);
  m = msg([&] { c.reduce_scatter(g, a); });
  CHECK(m.find("the send view has " + std::to_string(4 * p + 1)) != std::string::npos);
  m = msg([&] { c.send(a, static_cast<int>(p)); });
  CHECK(m.find("outside the communicator") != std::string::npos);
  m = msg([&] { c.broadcast(a, -1); });
  CHECK(m.find("root -1") != std::string::npos);
  Kokkos::View<int*> ints("ints", 4);
  m = msg([&] { c.all_reduce(ints, ReduceOp::avg); });
  CHECK(m.find("ReduceOp::avg needs a floating-point") != std::string::npos);
  Kokkos::View<float**, Kokkos::LayoutRight> m2("m2", 4, 3);  // LayoutRight: CUDA's default layout is LayoutLeft
  auto column = Kokkos::subview(m2, Kokkos::ALL, 1);
  m = msg([&] { c.all_reduce(column); });
  CHECK(m.find("is not contiguous") != std::string::npos);
  std::vector<int> counts(p + 1, 0);
  m = msg([&] { c.all_to_allv(a, std::span<const int>(counts), a, std::span<const int>(counts)); });
  CHECK(m.find("expected one per rank") != std::string::npos);
  try {
    c.all_reduce(a, b);
  } catch (const CommError& e) {
    CHECK(e.operation() == "all_reduce");
    CHECK(e.axis() == "t");
  }
  // The communicator is still usable after errors caught before MPI.
  Kokkos::deep_copy(a, 1.0f);
  c.all_reduce(a);
  CHECK(host(a)(0) == doctest::Approx(float(p)));
}

TEST_CASE("checked mode: ranks calling different collectives get a CommError on every rank naming each call") {
  Comm c = fresh(true);
  const int p = c.size(), me = c.rank();
  if (p == 1) return;  // a single rank cannot disagree with itself
  Kokkos::View<float*> a("a", 4), b("b", 5);
  std::string m;
  try {
    if (me == 0) c.all_reduce(a);
    else c.all_reduce(b);
  } catch (const CommError& e) {
    m = e.what();
  }
  CHECK(m.find("called different collectives") != std::string::npos);
  CHECK(m.find("rank 0 called all_reduce(float x 4, sum)") != std::string::npos);
  CHECK(m.find("rank 1 called all_reduce(float x 5, sum)") != std::string::npos);
  // A different kind of collective on one rank.
  Kokkos::View<float*> g("g", 4 * static_cast<std::size_t>(p));
  m.clear();
  try {
    if (me == p - 1) c.all_gather(a, g);
    else c.broadcast(a, 0);
  } catch (const CommError& e) {
    m = e.what();
  }
  CHECK(m.find("rank " + std::to_string(p - 1) + " called all_gather(float x 4)") != std::string::npos);
  CHECK(m.find("rank 0 called broadcast(float x 4, root 0)") != std::string::npos);
  // Still usable afterwards: the agreement happened before any data moved.
  Kokkos::deep_copy(a, 2.0f);
  c.all_reduce(a);
  CHECK(host(a)(0) == doctest::Approx(2.0f * p));
}

TEST_CASE("checked mode: all_to_allv counts that do not match the peers' are an error on every rank") {
  Comm c = fresh(true);
  const int p = c.size(), me = c.rank();
  if (p == 1) return;
  std::vector<int> sc(static_cast<std::size_t>(p), 1), rc(static_cast<std::size_t>(p), 1);
  if (me == 0) rc[1] = 2;  // rank 0 expects 2 elements from rank 1, which sends 1
  Kokkos::View<double*> s("s", static_cast<std::size_t>(p)), r("r", static_cast<std::size_t>(p) + 1);
  std::string m;
  try {
    c.all_to_allv(s, std::span<const int>(sc), r, std::span<const int>(rc));
  } catch (const CommError& e) {
    m = e.what();
  }
  if (me == 0) CHECK(m.find("rank 1 sends 1 elements to this rank, which expects 2") != std::string::npos);
  else CHECK(m.find("counts do not match") != std::string::npos);
}

TEST_CASE("a strided but contiguous view is accepted") {
  Comm c = fresh(false);
  Kokkos::View<double**, Kokkos::LayoutRight> m("m", 4, 3);
  auto row = Kokkos::subview(m, 2, Kokkos::ALL);  // contiguous in LayoutRight (CUDA's default is LayoutLeft)
  Kokkos::deep_copy(row, 1.0);
  c.all_reduce(row);
  auto h = host(m);
  CHECK(h(2, 1) == doctest::Approx(double(c.size())));
  CHECK(h(1, 1) == 0.0);
}

// Blocked layouts (derived datatypes): rank r's block of count runs of run
// elements sits at r * run + o * stride; every element lands where the layout
// says, the gaps between runs stay untouched, blocking and non-blocking.
TEST_CASE("all_gather and all_to_all with blocked layouts place every element") {
  Comm& c = weft::test::world();
  const int p = c.size(), me = c.rank();
  const std::size_t P = static_cast<std::size_t>(p), count = 3, run = 2, stride = P * run + 1;  // one-element gap
  const std::size_t block = count * run, size = (count - 1) * stride + P * run + 1;
  auto code = [](std::size_t from, std::size_t to, std::size_t i) { return double(1000 * from + 100 * to + i); };
  const weft::BlockLayout layout{count, run, stride};
  for (bool nonblocking : {false, true}) {
    CAPTURE(nonblocking);
    // all_gather: contiguous send of `block` elements, blocked receive.
    Kokkos::View<double*, Kokkos::HostSpace> send("send", block), recv("recv", size);
    for (std::size_t i = 0; i < block; ++i) send(i) = code(std::size_t(me), 0, i);
    Kokkos::deep_copy(recv, -1.0);
    if (nonblocking) {
      auto rq = c.iall_gather(send, recv, layout);
      rq.wait();
    } else {
      c.all_gather(send, recv, layout);
    }
    std::vector<bool> covered(size, false);
    for (std::size_t r = 0; r < P; ++r)
      for (std::size_t o = 0; o < count; ++o)
        for (std::size_t j = 0; j < run; ++j) {
          const std::size_t at = r * run + o * stride + j;
          covered[at] = true;
          CHECK(recv(at) == code(r, 0, o * run + j));
        }
    for (std::size_t i = 0; i < size; ++i)
      if (!covered[i]) CHECK(recv(i) == -1.0);

    // all_to_all: blocked on both sides (all_to_all blocks fill the buffer:
    // no gaps); block j of send goes to rank j.
    const weft::BlockLayout tight{count, run, P * run};
    Kokkos::View<double*, Kokkos::HostSpace> s2("s2", P * block), r2("r2", P * block), r3("r3", P * block);
    for (std::size_t to = 0; to < P; ++to)
      for (std::size_t o = 0; o < count; ++o)
        for (std::size_t j = 0; j < run; ++j) s2(to * run + o * P * run + j) = code(std::size_t(me), to, o * run + j);
    Kokkos::deep_copy(r2, -1.0);
    if (nonblocking) {
      auto rq = c.iall_to_all(s2, tight, r2, tight);
      rq.wait();
    } else {
      c.all_to_all(s2, tight, r2, tight);
    }
    for (std::size_t from = 0; from < P; ++from)
      for (std::size_t o = 0; o < count; ++o)
        for (std::size_t j = 0; j < run; ++j)
          CHECK(r2(from * run + o * P * run + j) == code(from, std::size_t(me), o * run + j));
    // Mixed: blocked send, contiguous receive (each rank's block arrives whole).
    c.all_to_all(s2, tight, r3, weft::BlockLayout{});
    for (std::size_t from = 0; from < P; ++from)
      for (std::size_t i = 0; i < block; ++i) CHECK(r3(from * block + i) == code(from, std::size_t(me), i));
  }
}

TEST_CASE("a blocked layout that does not fit its buffer is a CommError naming it") {
  Comm& c = weft::test::world();
  const std::size_t P = static_cast<std::size_t>(c.size());
  Kokkos::View<float*, Kokkos::HostSpace> send("send", 6), recv("recv", 6 * P);
  auto message = [&](const weft::BlockLayout& l) {
    try {
      c.all_gather(send, recv, l);
    } catch (const CommError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message({3, 3, 3 * P}).find("does not describe blocks of 6 elements") != std::string::npos);
  CHECK(message({3, 2, 2 * P - 1}).find("overlaps itself") != std::string::npos);
  CHECK(message({3, 2, 2 * P + 5}).find("reaches element") != std::string::npos);
}
