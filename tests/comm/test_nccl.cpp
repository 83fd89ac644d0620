// The NCCL transport's host side, which needs no device: the datatype and
// reduction tables, the translation of every ncclResult_t and cudaError_t
// into a CommError, the argument checks run before anything is enqueued, the
// checked mode's agreement over the control communicator, and what creating
// a NcclComm does on a machine without a device. Built when nccl.h and
// libnccl are found; the collectives themselves need a CUDA Kokkos and a GPU.
#include <weft/comm/nccl.hpp>

#include <complex>
#include <cstdint>
#include <string>
#include <vector>

#include "weft_test.hpp"

namespace {

using weft::Comm;
using weft::CommError;
using weft::ReduceOp;
using weft::test::contains;
namespace nccl = weft::nccl;

Comm fresh(bool checked) {
  Comm c = Comm::duplicate(weft::test::world().native(), "tp");
  c.set_checked(checked, 30.0);
  return c;
}

template <class F>
std::string comm_error(F&& f) {
  return weft::test::error_text<CommError>(std::forward<F>(f));
}

}  // namespace

TEST_CASE("element types map to NCCL datatypes; complex values travel as pairs of reals") {
  static_assert(nccl::datatype<float>::value == ncclFloat32 && nccl::datatype<float>::lanes == 1);
  static_assert(nccl::datatype<double>::value == ncclFloat64);
  static_assert(nccl::datatype<std::int32_t>::value == ncclInt32);
  static_assert(nccl::datatype<std::uint64_t>::value == ncclUint64);
  static_assert(nccl::datatype<std::complex<float>>::value == ncclFloat32 && nccl::datatype<std::complex<float>>::lanes == 2);
  static_assert(nccl::datatype<std::complex<double>>::value == ncclFloat64 && nccl::datatype<std::complex<double>>::lanes == 2);
  CHECK(nccl::op_of(ReduceOp::sum) == ncclSum);
  CHECK(nccl::op_of(ReduceOp::max) == ncclMax);
  CHECK(nccl::op_of(ReduceOp::min) == ncclMin);
  CHECK(nccl::op_of(ReduceOp::avg) == ncclAvg);
  static_assert(std::is_same_v<weft::CommOver<weft::transport::Mpi>, weft::Comm>);
  static_assert(std::is_same_v<weft::CommOver<weft::transport::Nccl>, weft::NcclComm>);
}

TEST_CASE("every ncclResult_t but success becomes a CommError with the call, the axis and NCCL's text") {
  CHECK_NOTHROW(nccl::check(ncclSuccess, "all_reduce", "tp", 0, 2));
  const ncclResult_t failures[] = {ncclUnhandledCudaError, ncclSystemError, ncclInternalError,
                                   ncclInvalidArgument,    ncclInvalidUsage, ncclRemoteError};
  for (const ncclResult_t rc : failures) {
    try {
      nccl::check(rc, "all_gather", "dp*cp", 1, 4);
      FAIL("no CommError for ", nccl::result_name(rc));
    } catch (const CommError& e) {
      const std::string m = e.what();
      CHECK(e.operation() == "all_gather");
      CHECK(e.axis() == "dp*cp");
      CHECK(contains(m, "weft::NcclComm::all_gather on axis 'dp*cp' (rank 1 of 4)"));
      CHECK(contains(m, nccl::result_name(rc)));
      CHECK(contains(m, "(" + std::to_string(static_cast<int>(rc)) + ")"));
      CHECK(contains(m, ncclGetErrorString(rc)));
    }
  }
  CHECK(contains(nccl::error_text(ncclUnhandledCudaError), "is a device visible to this rank?"));
  CHECK(contains(nccl::error_text(ncclRemoteError), "a peer failed"));
  CHECK(std::string(nccl::result_name(static_cast<ncclResult_t>(99))) == "an unknown ncclResult_t");
  const std::string cuda = comm_error([] { nccl::check_cuda(cudaErrorInvalidValue, "create", "tp", 0, 1); });
  CHECK(contains(cuda, "CUDA error cudaErrorInvalidValue"));
  CHECK(contains(cuda, cudaGetErrorString(cudaErrorInvalidValue)));
  CHECK_NOTHROW(nccl::check_cuda(cudaSuccess, "create", "tp", 0, 1));
}

TEST_CASE("argument checks raise CommError before anything is enqueued") {
  Comm c = fresh(false);
  nccl::Checks k(c);
  const std::size_t p = static_cast<std::size_t>(c.size());
  Kokkos::View<float*> a("a", 6), b("b", 6), odd("odd", 7), g("g", 6 * p);
  Kokkos::View<int*> ints("ints", 6);
  Kokkos::View<std::complex<double>*> z("z", 3);

  // Counts NCCL is given: elements x lanes.
  CHECK(k.all_reduce(a, b, ReduceOp::sum) == 6);
  CHECK(k.all_reduce(z, z, ReduceOp::sum) == 6);
  CHECK(k.all_gather(a, g) == 6);
  CHECK(k.reduce_scatter(g, a, ReduceOp::avg) == 6);
  CHECK(k.broadcast(z, 0) == 6);
  CHECK(k.point_to_point(a, 0, weft::CommKind::send) == 6);

  CHECK(contains(comm_error([&] { k.all_reduce(a, odd, ReduceOp::sum); }),
                 "the send view has 6 elements but the receive view has 7"));
  CHECK(contains(comm_error([&] { k.all_reduce(a, odd, ReduceOp::sum); }), "weft::NcclComm::all_reduce on axis 'tp'"));
  CHECK(contains(comm_error([&] { k.all_reduce(ints, ints, ReduceOp::avg); }), "ReduceOp::avg needs a floating-point"));
  CHECK(contains(comm_error([&] { k.all_reduce(z, z, ReduceOp::max); }), "not defined for complex elements"));
  CHECK(contains(comm_error([&] { k.all_gather(a, odd); }), "it needs " + std::to_string(p) + " blocks of the send view's 6"));
  CHECK(contains(comm_error([&] { k.reduce_scatter(odd, a, ReduceOp::sum); }), "the send view has 7 elements"));
  CHECK(contains(comm_error([&] { k.broadcast(a, int(p)); }), "the root rank " + std::to_string(p) + " is outside"));
  CHECK(contains(comm_error([&] { k.broadcast(a, -1); }), "the root rank -1 is outside"));
  CHECK(contains(comm_error([&] { k.point_to_point(a, int(p), weft::CommKind::send); }), "the destination rank"));
  CHECK(contains(comm_error([&] { k.point_to_point(a, -2, weft::CommKind::recv); }), "the source rank -2"));

  // A strided view: NCCL needs one contiguous block. (LayoutRight: under
  // CUDA the default layout is LayoutLeft, whose columns are contiguous.)
  Kokkos::View<float**, Kokkos::LayoutRight> m("m", 4, 3);
  auto column = Kokkos::subview(m, Kokkos::ALL, 1);
  Kokkos::View<float*> four("four", 4);
  CHECK(contains(comm_error([&] { k.all_reduce(column, four, ReduceOp::sum); }), "is not contiguous"));

  // all_to_all: equal sizes that divide into p blocks.
  Kokkos::View<double*> s("s", 2 * p), r("r", 2 * p), r1("r1", 2 * p + 1);
  CHECK(k.all_to_all(s, r) == 2);
  CHECK(contains(comm_error([&] { k.all_to_all(s, r1); }), "all_to_all needs equal sizes"));
  if (p > 1) {
    Kokkos::View<double*> s1("s1", 2 * p + 1);
    CHECK(contains(comm_error([&] { k.all_to_all(s1, r1); }), "divide into " + std::to_string(p) + " blocks"));
  }

  // all_to_allv: one count per rank, non-negative, within the views; displacements in elements.
  std::vector<int> sc(p, 2), rc(p, 2);
  const auto [sd, rd] = k.all_to_allv(s, std::span<const int>(sc), r, std::span<const int>(rc));
  for (std::size_t j = 0; j < p; ++j) CHECK((sd[j] == 2 * j && rd[j] == 2 * j));
  std::vector<int> short_counts(p + 1, 1);
  CHECK(contains(comm_error([&] { k.all_to_allv(s, std::span<const int>(short_counts), r, std::span<const int>(rc)); }),
                 "expected one per rank"));
  std::vector<int> negative(p, 1);
  negative[p - 1] = -1;
  CHECK(contains(comm_error([&] { k.all_to_allv(s, std::span<const int>(negative), r, std::span<const int>(rc)); }),
                 "negative count for rank " + std::to_string(p - 1)));
  std::vector<int> too_many(p, 3);
  CHECK(contains(comm_error([&] { k.all_to_allv(s, std::span<const int>(too_many), r, std::span<const int>(rc)); }),
                 "the counts add up to " + std::to_string(3 * p) + " elements to send"));
}

TEST_CASE("checked mode: ranks that disagree on a NCCL call get a CommError on every rank, before it is enqueued") {
  Comm c = fresh(true);
  nccl::Checks k(c);
  const int p = c.size(), me = c.rank();
  if (p == 1) return;
  Kokkos::View<float*> a("a", 4), b("b", 5);
  const std::string m = comm_error([&] {
    if (me == 0) k.all_reduce(a, a, ReduceOp::sum);
    else k.all_reduce(b, b, ReduceOp::sum);
  });
  CHECK(contains(m, "called different collectives"));
  CHECK(contains(m, "rank 0 called all_reduce(float x 4, sum)"));
  CHECK(contains(m, "rank 1 called all_reduce(float x 5, sum)"));
  // Another kind of call on one rank.
  const std::string m2 = comm_error([&] {
    if (me == p - 1) k.broadcast(a, 0);
    else k.all_reduce(a, a, ReduceOp::max);
  });
  CHECK(contains(m2, "rank " + std::to_string(p - 1) + " called broadcast(float x 4, root 0)"));
  // all_to_allv counts that do not match the peers'.
  std::vector<int> sc(static_cast<std::size_t>(p), 1), rc(static_cast<std::size_t>(p), 1);
  if (me == 0) rc[1] = 2;
  Kokkos::View<double*> s("s", static_cast<std::size_t>(p)), r("r", static_cast<std::size_t>(p) + 1);
  const std::string m3 = comm_error([&] { k.all_to_allv(s, std::span<const int>(sc), r, std::span<const int>(rc)); });
  if (me == 0) CHECK(contains(m3, "rank 1 sends 1 elements to this rank, which expects 2"));
  else CHECK(contains(m3, "counts do not match"));
  // Calls that agree pass, and the communicator is still in step.
  CHECK(k.all_reduce(a, a, ReduceOp::sum) == 4);
  c.barrier();
}

TEST_CASE("creating a NcclComm without a usable device raises a CommError on every rank and does not hang") {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    // A GPU machine: creation must work and give the Comm's ranks.
    Comm c = fresh(false);
    weft::NcclComm n(c);
    CHECK(n.rank() == c.rank());
    CHECK(n.size() == c.size());
    CHECK(n.native() != nullptr);
    return;
  }
  Comm c = fresh(false);
  std::string m;
  try {
    weft::NcclComm n(c);
    m = "created";
  } catch (const CommError& e) {
    m = e.what();
  }
  CHECK(contains(m, "weft::NcclComm::create on axis 'tp'"));
  MESSAGE("without a device: ", m);
  c.barrier();  // every rank got here: nothing hung
}

#if defined(KOKKOS_ENABLE_CUDA)
// On a GPU machine (one device per rank: NCCL refuses two ranks on one GPU),
// every collective and the point-to-point pair on device views, checked
// element by element against what the call must produce.
namespace {
using DevView = Kokkos::View<double*, Kokkos::CudaSpace>;
// v[r block + i] = base + stride_block r + i
void fill(const DevView& v, double base, double stride_block, int block) {
  Kokkos::parallel_for("fill", Kokkos::RangePolicy<Kokkos::Cuda>(0, v.extent(0)), KOKKOS_LAMBDA(std::size_t j) {
    v(j) = base + stride_block * double(int(j) / block) + double(int(j) % block);
  });
}
std::vector<double> host(const DevView& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, v);
  return std::vector<double>(h.data(), h.data() + h.extent(0));
}
}  // namespace

TEST_CASE("on a GPU, every NCCL collective moves the right values") {
  int devices = 0;
  Comm c = fresh(false);
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < c.size()) {
    MESSAGE("skipped: ", devices, " CUDA devices for ", c.size(), " ranks");
    c.barrier();
    return;
  }
  weft::NcclComm k(c);
  using Dev = DevView;
  const int p = c.size(), me = c.rank();
  const int n = 5;

  Dev a("a", n), ar("ar", n);
  fill(a, me + 1, 0, n);  // a[i] = me + 1 + i
  k.all_reduce(a, ar);
  auto h = host(ar);
  for (int i = 0; i < n; ++i) CHECK(h[i] == p * (p + 1) / 2.0 + double(p) * i);

  Dev g("g", p * n);
  fill(a, me * 10.0, 0, n);  // a[i] = 10 me + i
  k.all_gather(a, g);
  h = host(g);
  for (int r = 0; r < p; ++r)
    for (int i = 0; i < n; ++i) CHECK(h[r * n + i] == r * 10.0 + i);

  Dev s("s", p * n), rs("rs", n);
  fill(s, me, 100, n);  // s[r n + i] = me + 100 r + i
  k.reduce_scatter(s, rs);
  h = host(rs);
  for (int i = 0; i < n; ++i) CHECK(h[i] == p * (p - 1) / 2.0 + double(p) * (100.0 * me + i));

  Dev t("t", p * n);
  fill(s, me * 1000.0, 10, n);  // s[r n + i] = 1000 me + 10 r + i
  k.all_to_all(s, t);
  h = host(t);
  for (int r = 0; r < p; ++r)
    for (int i = 0; i < n; ++i) CHECK(h[r * n + i] == r * 1000.0 + me * 10.0 + i);

  fill(a, me == 0 ? 42.0 : -1.0, 0, n);
  k.broadcast(a, 0);
  h = host(a);
  for (int i = 0; i < n; ++i) CHECK(h[i] == 42.0 + i);

  if (p > 1) {  // a ring: even ranks send first
    Dev out("out", n), in("in", n);
    fill(out, 7.0 * me, 0, n);
    const int right = (me + 1) % p, left = (me + p - 1) % p;
    if (me % 2 == 0) {
      k.send(out, right);
      k.recv(in, left);
    } else {
      k.recv(in, left);
      k.send(out, right);
    }
    h = host(in);
    for (int i = 0; i < n; ++i) CHECK(h[i] == 7.0 * left + i);
  }
  k.check_async();
  c.barrier();
}
#endif
