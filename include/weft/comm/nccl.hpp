// NcclComm: weft's collectives and point-to-point transfers on CUDA device
// views over NCCL, the transport chosen at compile time for device memory
// (weft::Comm moves the bytes with MPI). A NcclComm is created over the ranks
// of a weft::Comm -- a mesh axis or group of axes -- and keeps a duplicate of
// that MPI communicator for its control traffic: the unique id's broadcast at
// creation and the checked mode's agreement before each call.
//
// Every call is enqueued on the stream of an execution-space instance (the
// views' default instance unless one is passed) and returns without waiting;
// fence that instance before reading the result on the host. Every
// ncclResult_t and cudaError_t becomes a weft::CommError naming the call, the
// axis and NCCL's own text, and the argument checks (nccl::Checks) run on the
// host before anything is enqueued, so that a wrong call fails on the rank
// that made it instead of corrupting or hanging its peers.
//
// Include this header only where <nccl.h> and the CUDA runtime headers are
// found (CMake: WEFT_HAVE_NCCL, target weft::nccl); weft.hpp does not
// include it. The collectives need a Kokkos built with CUDA: their
// instantiation fails with a message on a host-only Kokkos, while nccl::Checks
// and the error translation work with any Kokkos (tests/comm/test_nccl.cpp).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <Kokkos_Core.hpp>
#include <complex>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/comm/transport.hpp>

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0), "weft::NcclComm needs NCCL 2.13 or newer (ncclAvg, ncclGetLastError)");

namespace weft {


class NcclComm;

namespace nccl {

namespace detail {
template <class T>
struct always_false : std::false_type {};
}  // namespace detail

/// nccl::datatype<T>::value is the ncclDataType_t of T's lanes, and lanes
/// how many of them one T holds (2 for std::complex, which NCCL sums as pairs
/// of reals).
template <class T>
struct datatype {
  static_assert(detail::always_false<T>::value,
                "weft::NcclComm: this element type has no NCCL datatype. Supported element types: float, double, "
                "std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t, std::uint64_t, char, "
                "std::complex<float>, std::complex<double>. Copy the data into a view of a supported type.");
};
#define WEFT_DETAIL_NCCL_TYPE(T, NCCL_T, LANES)            \
  template <>                                              \
  struct datatype<T> {                                     \
    static constexpr ncclDataType_t value = NCCL_T;        \
    static constexpr std::size_t lanes = LANES;            \
  };
WEFT_DETAIL_NCCL_TYPE(float, ncclFloat32, 1)
WEFT_DETAIL_NCCL_TYPE(double, ncclFloat64, 1)
WEFT_DETAIL_NCCL_TYPE(std::int8_t, ncclInt8, 1)
WEFT_DETAIL_NCCL_TYPE(std::uint8_t, ncclUint8, 1)
WEFT_DETAIL_NCCL_TYPE(std::int32_t, ncclInt32, 1)
WEFT_DETAIL_NCCL_TYPE(std::uint32_t, ncclUint32, 1)
WEFT_DETAIL_NCCL_TYPE(std::int64_t, ncclInt64, 1)
WEFT_DETAIL_NCCL_TYPE(std::uint64_t, ncclUint64, 1)
WEFT_DETAIL_NCCL_TYPE(char, ncclChar, 1)
WEFT_DETAIL_NCCL_TYPE(std::complex<float>, ncclFloat32, 2)
WEFT_DETAIL_NCCL_TYPE(std::complex<double>, ncclFloat64, 2)
#undef WEFT_DETAIL_NCCL_TYPE

/// NCCL's reduction for a weft ReduceOp (avg is ncclAvg: the sum divided by
/// the number of ranks, NCCL >= 2.10).
constexpr ncclRedOp_t op_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::avg: return ncclAvg;
    default: return ncclSum;
  }
}

/// The enumerator's name of an ncclResult_t, e.g. "ncclInvalidUsage".
constexpr const char* result_name(ncclResult_t rc) {
  switch (rc) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "an unknown ncclResult_t";
  }
}

/// What to say about an ncclResult_t: its name and number, NCCL's text for it
/// and, when `comm` is given, NCCL's last error message on it.
inline std::string error_text(ncclResult_t rc, ncclComm_t comm = nullptr) {
  std::string s = std::string(result_name(rc)) + " (" + std::to_string(static_cast<int>(rc)) + "): " + ncclGetErrorString(rc);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) s += "; NCCL says: " + std::string(last);
  }
  switch (rc) {
    case ncclUnhandledCudaError: s += " (a CUDA call inside NCCL failed: is a device visible to this rank?)"; break;
    case ncclSystemError: s += " (a system call failed: sockets, shared memory or /dev/shm; NCCL_DEBUG=WARN tells which)"; break;
    case ncclRemoteError: s += " (a peer failed or went away)"; break;
    case ncclInvalidUsage: s += " (a wrong use of NCCL: mismatched calls between the ranks, or a communicator used after an error)"; break;
    default: break;
  }
  return s;
}

/// "weft::NcclComm::<op> on axis '<axis>' (rank r of p)", the start of every message.
inline std::string where(const char* op, const std::string& axis, int rank, int size) {
  return std::string("weft::NcclComm::") + op + " on axis '" + axis + "' (rank " + std::to_string(rank) + " of " +
         std::to_string(size) + ")";
}

/// Raises a CommError for any rc but ncclSuccess.
inline void check(ncclResult_t rc, const char* op, const std::string& axis, int rank, int size, ncclComm_t comm = nullptr) {
  if (rc != ncclSuccess) throw CommError(op, axis, where(op, axis, rank, size) + ": " + error_text(rc, comm));
}

/// Raises a CommError for any rc but cudaSuccess.
inline void check_cuda(cudaError_t rc, const char* op, const std::string& axis, int rank, int size) {
  if (rc != cudaSuccess)
    throw CommError(op, axis,
                    where(op, axis, rank, size) + ": CUDA error " + cudaGetErrorName(rc) + " (" +
                        std::to_string(static_cast<int>(rc)) + "): " + cudaGetErrorString(rc));
}

/// The host-side checks of every NcclComm call, apart from NCCL so that they
/// can be run (and tested) without a device: element type and reduction,
/// contiguous views, sizes, peers and roots, and -- in the checked mode of the
/// control communicator -- the agreement of every rank on the call. Each
/// returns the count NCCL is given (elements x lanes). A failed check raises
/// a CommError on the rank whose arguments are wrong (checked mode: on every
/// rank).
class Checks {
 public:
  /// Checks over the ranks of `control` (an MPI communicator of the same ranks
  /// as the NCCL one, in the same order).
  explicit Checks(Comm& control) : control_(&control) {}

  /// all_reduce of `send` into `recv`: same sizes.
  template <KokkosView S, KokkosView R>
  std::size_t all_reduce(const S& send, const R& recv, ReduceOp op) const {
    using T = typename element_of<S, R>::type;
    reduction<T>(op, "all_reduce");
    contiguous(send, "all_reduce", "send");
    contiguous(recv, "all_reduce", "receive");
    if (send.size() != recv.size())
      fail("all_reduce", "the send view has " + std::to_string(send.size()) + " elements but the receive view has " +
                             std::to_string(recv.size()) + "; all_reduce needs equal sizes");
    control_->agree_on_call(CommKind::all_reduce, mpi_datatype<T>::id, static_cast<std::int64_t>(send.size()),
                            static_cast<int>(op), "all_reduce");
    return send.size() * datatype<T>::lanes;
  }

  /// all_gather of `send` into `recv`: recv holds size() blocks of send's size.
  template <KokkosView S, KokkosView R>
  std::size_t all_gather(const S& send, const R& recv) const {
    using T = typename element_of<S, R>::type;
    contiguous(send, "all_gather", "send");
    contiguous(recv, "all_gather", "receive");
    if (recv.size() != send.size() * ranks())
      fail("all_gather", "the receive view has " + std::to_string(recv.size()) + " elements; it needs " +
                             std::to_string(ranks()) + " blocks of the send view's " + std::to_string(send.size()));
    control_->agree_on_call(CommKind::all_gather, mpi_datatype<T>::id, static_cast<std::int64_t>(send.size()), 0,
                            "all_gather");
    return send.size() * datatype<T>::lanes;
  }

  /// reduce_scatter of `send` (size() blocks of recv's size) into `recv`.
  template <KokkosView S, KokkosView R>
  std::size_t reduce_scatter(const S& send, const R& recv, ReduceOp op) const {
    using T = typename element_of<S, R>::type;
    reduction<T>(op, "reduce_scatter");
    contiguous(send, "reduce_scatter", "send");
    contiguous(recv, "reduce_scatter", "receive");
    if (send.size() != recv.size() * ranks())
      fail("reduce_scatter", "the send view has " + std::to_string(send.size()) + " elements; it needs " +
                                 std::to_string(ranks()) + " blocks of the receive view's " + std::to_string(recv.size()));
    control_->agree_on_call(CommKind::reduce_scatter, mpi_datatype<T>::id, static_cast<std::int64_t>(recv.size()),
                            static_cast<int>(op), "reduce_scatter");
    return recv.size() * datatype<T>::lanes;
  }

  /// all_to_all: both views hold size() equal blocks; returns one block's count.
  template <KokkosView S, KokkosView R>
  std::size_t all_to_all(const S& send, const R& recv) const {
    using T = typename element_of<S, R>::type;
    contiguous(send, "all_to_all", "send");
    contiguous(recv, "all_to_all", "receive");
    if (send.size() != recv.size() || send.size() % ranks() != 0)
      fail("all_to_all", "the views have " + std::to_string(send.size()) + " and " + std::to_string(recv.size()) +
                             " elements; all_to_all needs equal sizes that divide into " + std::to_string(ranks()) +
                             " blocks");
    control_->agree_on_call(CommKind::all_to_all, mpi_datatype<T>::id, static_cast<std::int64_t>(send.size()), 0,
                            "all_to_all");
    return send.size() / ranks() * datatype<T>::lanes;
  }

  /// all_to_allv: one count per rank each way, non-negative, within the views
  /// (in checked mode, what i sends j is what j expects from i). Returns the
  /// displacements of the blocks, send's then recv's, in elements.
  template <KokkosView S, KokkosView R>
  std::pair<std::vector<std::size_t>, std::vector<std::size_t>> all_to_allv(const S& send, std::span<const int> send_counts,
                                                                            const R& recv,
                                                                            std::span<const int> recv_counts) const {
    using T = typename element_of<S, R>::type;
    contiguous(send, "all_to_allv", "send");
    contiguous(recv, "all_to_allv", "receive");
    if (send_counts.size() != ranks() || recv_counts.size() != ranks())
      fail("all_to_allv", "got " + std::to_string(send_counts.size()) + " send counts and " +
                              std::to_string(recv_counts.size()) + " receive counts; expected one per rank (" +
                              std::to_string(ranks()) + ")");
    std::vector<std::size_t> sd(ranks()), rd(ranks());
    std::size_t st = 0, rt = 0;
    for (std::size_t j = 0; j < ranks(); ++j) {
      if (send_counts[j] < 0 || recv_counts[j] < 0) fail("all_to_allv", "negative count for rank " + std::to_string(j));
      sd[j] = st;
      rd[j] = rt;
      st += static_cast<std::size_t>(send_counts[j]);
      rt += static_cast<std::size_t>(recv_counts[j]);
    }
    if (st > send.size() || rt > recv.size())
      fail("all_to_allv", "the counts add up to " + std::to_string(st) + " elements to send and " + std::to_string(rt) +
                              " to receive, but the views hold " + std::to_string(send.size()) + " and " +
                              std::to_string(recv.size()));
    control_->agree_on_call(CommKind::all_to_allv, mpi_datatype<T>::id, 0, 0, "all_to_allv");
    control_->agree_on_counts(send_counts, recv_counts, "all_to_allv");
    return {std::move(sd), std::move(rd)};
  }

  /// broadcast of `buf` from `root`.
  template <KokkosView V>
  std::size_t broadcast(const V& buf, int root) const {
    using T = typename element_of<V, V>::type;
    contiguous(buf, "broadcast", "buffer");
    peer(root, "broadcast", "root");
    control_->agree_on_call(CommKind::broadcast, mpi_datatype<T>::id, static_cast<std::int64_t>(buf.size()), root,
                            "broadcast");
    return buf.size() * datatype<T>::lanes;
  }

  /// send of `buf` to `dest` or recv of it from a peer (kind send or recv).
  template <KokkosView V>
  std::size_t point_to_point(const V& buf, int peer_rank, CommKind kind) const {
    using T = typename element_of<V, V>::type;
    const char* op = kind == CommKind::send ? "send" : "recv";
    contiguous(buf, op, "buffer");
    peer(peer_rank, op, kind == CommKind::send ? "destination" : "source");
    return buf.size() * datatype<T>::lanes;
  }

  /// The control communicator.
  Comm& control() const noexcept { return *control_; }

 private:
  // The element type of both views (they must agree), checked for NCCL and MPI ids.
  template <class S, class R>
  struct element_of {
    using type = std::remove_cv_t<typename S::value_type>;
    static_assert(std::is_same_v<type, std::remove_cv_t<typename R::value_type>>,
                  "weft::NcclComm: send and receive views must have the same element type");
    static_assert(sizeof(datatype<type>) > 0 && sizeof(mpi_datatype<type>) > 0, "weft::NcclComm: element type");
  };

  template <class T>
  void reduction(ReduceOp op, const char* where_) const {
    constexpr bool is_complex = std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>;
    if (op == ReduceOp::avg && !std::is_floating_point_v<T> && !is_complex)
      fail(where_, std::string("ReduceOp::avg needs a floating-point or complex element type, got ") +
                       mpi_datatype<T>::name + "; reduce with ReduceOp::sum and divide yourself");
    if ((op == ReduceOp::max || op == ReduceOp::min) && is_complex)
      fail(where_, "ReduceOp::max and ReduceOp::min are not defined for complex elements");
  }
  template <class V>
  void contiguous(const V& v, const char* op, const char* which) const {
    if (!v.span_is_contiguous() || v.span() != v.size())
      fail(op, std::string("the ") + which + " view '" + v.label() +
                   "' is not contiguous (a strided subview or LayoutStride view); NCCL needs one contiguous block: "
                   "deep_copy it into a contiguous view first");
  }
  void peer(int r, const char* op, const char* which) const {
    if (r < 0 || r >= control_->size())
      fail(op, std::string("the ") + which + " rank " + std::to_string(r) + " is outside the communicator (valid ranks 0.." +
                   std::to_string(control_->size() - 1) + ")");
  }
  std::size_t ranks() const noexcept { return static_cast<std::size_t>(control_->size()); }
  [[noreturn]] void fail(const char* op, const std::string& msg) const {
    throw CommError(op, control_->name(), where(op, control_->name(), control_->rank(), control_->size()) + ": " + msg);
  }

  Comm* control_;
};

}  // namespace nccl

/// Collectives and point-to-point transfers on CUDA device views over NCCL
/// (see the top of this header). Move-only; the NCCL communicator is
/// destroyed with it. Every call is collective over the ranks of the Comm it
/// was created over, in the same order on every rank, as with weft::Comm.
class NcclComm {
 public:
  /// Creates a NCCL communicator over the ranks of `over` (e.g.
  /// mesh.axis<TP>(), mesh.axes<DP, CP>()): rank 0 asks NCCL for a unique id
  /// and broadcasts it over MPI, then every rank joins on its current CUDA
  /// device. Collective over `over`. If rank 0 cannot get an id every rank
  /// raises a CommError; a failed join raises one on the ranks where it
  /// failed. The checked mode and deadline are taken from `over`.
  explicit NcclComm(const Comm& over)
      : control_(std::make_unique<Comm>(Comm::duplicate(over.native(), over.name()))), checks_(*control_) {
    control_->set_checked(over.checked(), over.deadline());
    struct {
      int ok;
      ncclResult_t rc;
      ncclUniqueId id;
    } root{1, ncclSuccess, {}};
    if (rank() == 0) {
      root.rc = ncclGetUniqueId(&root.id);
      root.ok = root.rc == ncclSuccess ? 1 : 0;
    }
    const int rc = MPI_Bcast(&root, static_cast<int>(sizeof(root)), MPI_BYTE, 0, control_->native());
    if (rc != MPI_SUCCESS)
      throw CommError("create", name(), nccl::where("create", name(), rank(), size()) + ": broadcasting the unique id: " +
                                            detail::mpi_error_text(rc));
    if (!root.ok)
      throw CommError("create", name(),
                      nccl::where("create", name(), rank(), size()) +
                          ": rank 0 could not get a unique id (ncclGetUniqueId): " + nccl::error_text(root.rc));
    check(ncclCommInitRank(&comm_, size(), root.id, rank()), "create");
  }
  NcclComm(NcclComm&& o) noexcept
      : control_(std::move(o.control_)), checks_(std::move(o.checks_)), comm_(std::exchange(o.comm_, nullptr)) {}
  NcclComm& operator=(NcclComm&& o) noexcept {
    if (this != &o) {
      destroy();
      control_ = std::move(o.control_);
      checks_ = std::move(o.checks_);
      comm_ = std::exchange(o.comm_, nullptr);
    }
    return *this;
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() { destroy(); }

  /// This process' rank (the same as in the Comm it was created over).
  int rank() const noexcept { return control_->rank(); }
  /// Number of ranks.
  int size() const noexcept { return control_->size(); }
  /// The axis (or group) name used in messages.
  const std::string& name() const noexcept { return control_->name(); }
  /// The NCCL communicator.
  ncclComm_t native() const noexcept { return comm_; }
  /// The MPI communicator of the same ranks that carries the control traffic.
  Comm& control() noexcept { return *control_; }
  /// The checked mode (agreement of every rank on each call, over MPI, before
  /// it is enqueued).
  bool checked() const noexcept { return control_->checked(); }
  /// Turns the checked mode on or off (every rank alike).
  void set_checked(bool on) { control_->set_checked(on, control_->deadline()); }
  /// What the calls moved so far: calls and bytes of each kind, with the
  /// seconds it took to enqueue them (the transfers run asynchronously).
  const CommStats& stats() const noexcept { return control_->stats(); }

  /// Raises a CommError if NCCL reports an asynchronous error on this
  /// communicator (a failed peer or network); call it while waiting on a
  /// stream that a NCCL call may hold up.
  void check_async() const {
    ncclResult_t async = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &async), "check_async");
    check(async, "check_async");
  }

  /// Sums (or max/min/avg) `send` over the ranks into `recv`, on `exec`'s stream.
  template <class Exec, KokkosView S, KokkosView R>
  void all_reduce(const Exec& exec, const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    device<S>(), device<R>();
    using T = std::remove_cv_t<typename S::value_type>;
    const std::size_t n = checks_.all_reduce(send, recv, op);
    timed(CommKind::all_reduce, n / nccl::datatype<T>::lanes * sizeof(T), [&] {
      check(ncclAllReduce(send.data(), recv.data(), n, nccl::datatype<T>::value, nccl::op_of(op), comm_, stream_of(exec)),
            "all_reduce");
    });
  }
  /// all_reduce on the views' default execution-space instance.
  template <KokkosView S, KokkosView R>
  void all_reduce(const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    all_reduce(typename S::execution_space{}, send, recv, op);
  }
  /// In-place all_reduce of `buf`.
  template <KokkosView V>
  void all_reduce(const V& buf, ReduceOp op = ReduceOp::sum) {
    all_reduce(typename V::execution_space{}, buf, buf, op);
  }

  /// Gathers every rank's `send` into `recv`, in rank order, on `exec`'s stream.
  template <class Exec, KokkosView S, KokkosView R>
  void all_gather(const Exec& exec, const S& send, const R& recv) {
    device<S>(), device<R>();
    using T = std::remove_cv_t<typename S::value_type>;
    const std::size_t n = checks_.all_gather(send, recv);
    timed(CommKind::all_gather, recv.size() * sizeof(T), [&] {
      check(ncclAllGather(send.data(), recv.data(), n, nccl::datatype<T>::value, comm_, stream_of(exec)), "all_gather");
    });
  }
  /// all_gather on the views' default execution-space instance.
  template <KokkosView S, KokkosView R>
  void all_gather(const S& send, const R& recv) {
    all_gather(typename S::execution_space{}, send, recv);
  }

  /// Reduces `send` (size() blocks) over the ranks; rank r keeps block r in `recv`.
  template <class Exec, KokkosView S, KokkosView R>
  void reduce_scatter(const Exec& exec, const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    device<S>(), device<R>();
    using T = std::remove_cv_t<typename S::value_type>;
    const std::size_t n = checks_.reduce_scatter(send, recv, op);
    timed(CommKind::reduce_scatter, send.size() * sizeof(T), [&] {
      check(ncclReduceScatter(send.data(), recv.data(), n, nccl::datatype<T>::value, nccl::op_of(op), comm_,
                              stream_of(exec)),
            "reduce_scatter");
    });
  }
  /// reduce_scatter on the views' default execution-space instance.
  template <KokkosView S, KokkosView R>
  void reduce_scatter(const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    reduce_scatter(typename S::execution_space{}, send, recv, op);
  }

  /// Block j of `send` goes to rank j, whose block r of `recv` it becomes
  /// (grouped ncclSend/ncclRecv).
  template <class Exec, KokkosView S, KokkosView R>
  void all_to_all(const Exec& exec, const S& send, const R& recv) {
    device<S>(), device<R>();
    using T = std::remove_cv_t<typename S::value_type>;
    const std::size_t b = checks_.all_to_all(send, recv);
    const std::size_t lanes = nccl::datatype<T>::lanes;
    std::vector<std::size_t> counts(static_cast<std::size_t>(size()), b);
    timed(CommKind::all_to_all, send.size() * sizeof(T), [&] {
      grouped_exchange("all_to_all", exec, send.data(), recv.data(), counts, counts, [&](std::size_t j) { return j * b / lanes; },
                       [&](std::size_t j) { return j * b / lanes; });
    });
  }
  /// all_to_all on the views' default execution-space instance.
  template <KokkosView S, KokkosView R>
  void all_to_all(const S& send, const R& recv) {
    all_to_all(typename S::execution_space{}, send, recv);
  }

  /// send_counts[j] elements (from the front of `send`, in rank order) go to
  /// rank j; recv_counts[j] arrive from it into `recv`, in rank order.
  template <class Exec, KokkosView S, KokkosView R>
  void all_to_allv(const Exec& exec, const S& send, std::span<const int> send_counts, const R& recv,
                   std::span<const int> recv_counts) {
    device<S>(), device<R>();
    using T = std::remove_cv_t<typename S::value_type>;
    const auto [sd, rd] = checks_.all_to_allv(send, send_counts, recv, recv_counts);
    const std::size_t lanes = nccl::datatype<T>::lanes;
    std::vector<std::size_t> sc(send_counts.size()), rc(recv_counts.size());
    std::uint64_t bytes = 0;
    for (std::size_t j = 0; j < sc.size(); ++j) {
      sc[j] = static_cast<std::size_t>(send_counts[j]) * lanes;
      rc[j] = static_cast<std::size_t>(recv_counts[j]) * lanes;
      bytes += static_cast<std::uint64_t>(send_counts[j]) * sizeof(T);
    }
    timed(CommKind::all_to_allv, bytes, [&] {
      grouped_exchange("all_to_allv", exec, send.data(), recv.data(), sc, rc, [&](std::size_t j) { return sd[j]; },
                       [&](std::size_t j) { return rd[j]; });
    });
  }
  /// all_to_allv on the views' default execution-space instance.
  template <KokkosView S, KokkosView R>
  void all_to_allv(const S& send, std::span<const int> send_counts, const R& recv, std::span<const int> recv_counts) {
    all_to_allv(typename S::execution_space{}, send, send_counts, recv, recv_counts);
  }

  /// `root`'s `buf` to every rank.
  template <class Exec, KokkosView V>
  void broadcast(const Exec& exec, const V& buf, int root) {
    device<V>();
    using T = std::remove_cv_t<typename V::value_type>;
    const std::size_t n = checks_.broadcast(buf, root);
    timed(CommKind::broadcast, buf.size() * sizeof(T), [&] {
      check(ncclBroadcast(buf.data(), buf.data(), n, nccl::datatype<T>::value, root, comm_, stream_of(exec)), "broadcast");
    });
  }
  /// broadcast on the view's default execution-space instance.
  template <KokkosView V>
  void broadcast(const V& buf, int root) {
    broadcast(typename V::execution_space{}, buf, root);
  }

  /// Sends `buf` to `dest` (matched by a recv there, in call order).
  template <class Exec, KokkosView V>
  void send(const Exec& exec, const V& buf, int dest) {
    device<V>();
    using T = std::remove_cv_t<typename V::value_type>;
    const std::size_t n = checks_.point_to_point(buf, dest, CommKind::send);
    timed(CommKind::send, buf.size() * sizeof(T), [&] {
      check(ncclSend(buf.data(), n, nccl::datatype<T>::value, dest, comm_, stream_of(exec)), "send");
    });
  }
  /// send on the view's default execution-space instance.
  template <KokkosView V>
  void send(const V& buf, int dest) {
    send(typename V::execution_space{}, buf, dest);
  }
  /// Receives `buf` from `src`.
  template <class Exec, KokkosView V>
  void recv(const Exec& exec, const V& buf, int src) {
    device<V>();
    using T = std::remove_cv_t<typename V::value_type>;
    const std::size_t n = checks_.point_to_point(buf, src, CommKind::recv);
    timed(CommKind::recv, buf.size() * sizeof(T), [&] {
      check(ncclRecv(buf.data(), n, nccl::datatype<T>::value, src, comm_, stream_of(exec)), "recv");
    });
  }
  /// recv on the view's default execution-space instance.
  template <KokkosView V>
  void recv(const V& buf, int src) {
    recv(typename V::execution_space{}, buf, src);
  }

 private:
  void check(ncclResult_t rc, const char* op) const { nccl::check(rc, op, name(), rank(), size(), comm_); }

  // Views in CUDA memory only; a host-only Kokkos has none.
  template <class V>
  static void device() {
#if defined(KOKKOS_ENABLE_CUDA)
    static_assert(Kokkos::SpaceAccessibility<Kokkos::Cuda, typename V::memory_space>::accessible,
                  "weft::NcclComm: NCCL moves CUDA device memory; this view's memory space is not accessible from "
                  "Kokkos::Cuda. Use weft::Comm (MPI) for host views.");
#else
    static_assert(nccl::detail::always_false<V>::value,
                  "weft::NcclComm: this Kokkos has no CUDA backend, so there are no device views for NCCL to move. "
                  "Build Kokkos with CUDA (scripts/build_kokkos.sh --cuda ARCH) or use weft::Comm.");
#endif
  }
  template <class Exec>
  static cudaStream_t stream_of(const Exec& exec) {
#if defined(KOKKOS_ENABLE_CUDA)
    static_assert(std::is_same_v<Exec, Kokkos::Cuda>,
                  "weft::NcclComm: the execution space instance must be a Kokkos::Cuda (its stream carries the call)");
    return exec.cuda_stream();
#else
    (void)exec;
    static_assert(nccl::detail::always_false<Exec>::value, "weft::NcclComm: this Kokkos has no CUDA backend");
    return nullptr;
#endif
  }

  // ncclSend/ncclRecv to and from every rank in one group.
  template <class Exec, class T, class U, class SendAt, class RecvAt>
  void grouped_exchange(const char* op, const Exec& exec, const T* send, U* recv, const std::vector<std::size_t>& sc,
                        const std::vector<std::size_t>& rc, SendAt send_at, RecvAt recv_at) {
    using E = std::remove_cv_t<T>;
    const auto dt = nccl::datatype<E>::value;
    const cudaStream_t s = stream_of(exec);
    check(ncclGroupStart(), op);
    ncclResult_t first = ncclSuccess;
    for (std::size_t j = 0; j < sc.size(); ++j) {
      const int peer = static_cast<int>(j);
      if (sc[j] > 0 && first == ncclSuccess) first = ncclSend(send + send_at(j), sc[j], dt, peer, comm_, s);
      if (rc[j] > 0 && first == ncclSuccess) first = ncclRecv(recv + recv_at(j), rc[j], dt, peer, comm_, s);
    }
    const ncclResult_t end = ncclGroupEnd();  // a group once started is always ended
    check(first, op);
    check(end, op);
  }

  template <class F>
  void timed(CommKind kind, std::uint64_t bytes, F&& enqueue) {
    const double t0 = detail::now_seconds();
    enqueue();
    control_->record(kind, bytes, detail::now_seconds() - t0);
  }

  void destroy() noexcept {
    if (comm_) ncclCommDestroy(comm_);
    comm_ = nullptr;
  }

  std::unique_ptr<Comm> control_;
  nccl::Checks checks_;
  ncclComm_t comm_ = nullptr;
};

namespace detail {
template <>
struct comm_over<transport::Nccl> {
  using type = NcclComm;
};
}  // namespace detail

}  // namespace weft
