// Comm: typed collectives and point-to-point on Kokkos views over one MPI
// communicator (a mesh axis or axis group), blocking and non-blocking, with
// MPI errors turned into weft::CommError, an optional checked mode, and every
// call counted in CommStats.
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <climits>
#include <complex>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/comm/datatype.hpp>
#include <weft/comm/request.hpp>
#include <weft/comm/stats.hpp>
#include <weft/config.hpp>
#include <weft/core/error.hpp>
#include <weft/core/kokkos_compat.hpp>

namespace weft {

/// Reduction operators of all_reduce and reduce_scatter. avg is the sum
/// divided by the communicator size (floating-point and complex types only).
enum class ReduceOp { sum, max, min, avg };

/// The name of a reduction, e.g. "sum".
constexpr const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::avg: return "avg";
  }
  return "?";
}

/// Sets the process-wide default of the checked mode for communicators created
/// afterwards (also settable by WEFT_CHECKED=0/1 and WEFT_DEADLINE=seconds).
inline void set_checked_default(bool checked, double deadline_seconds = 60.0) {
  detail::checked_defaults().checked = checked;
  detail::checked_defaults().deadline_s = deadline_seconds;
}

namespace detail {

// WEFT_FORCE_STAGING (tests only) sends host views through the staging path
// too, so the path device views take without GPU-aware MPI is exercised on
// machines that have no device.
#if defined(WEFT_FORCE_STAGING)
template <class V>
inline constexpr bool mpi_can_use_directly = false;
#else
template <class V>
inline constexpr bool mpi_can_use_directly = host_accessible_v<V> || (WEFT_GPU_AWARE_MPI != 0);
#endif

// A contiguous 1-D alias of any contiguous view, in the view's memory space.
template <class V>
using flat_view_t = Kokkos::View<typename std::remove_cvref_t<V>::value_type*,
                                 typename std::remove_cvref_t<V>::memory_space,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

template <class V>
flat_view_t<V> flatten(const V& v) {
  return flat_view_t<V>(v.data(), v.size());
}

// The real type of an element: U for std::complex<U>, else the type itself.
template <class T>
struct real_of {
  using type = T;
};
template <class U>
struct real_of<std::complex<U>> {
  using type = U;
};

// Multiplies every element by a real scale. A named functor rather than a
// KOKKOS_LAMBDA in a member function (nvcc refuses extended lambdas in
// private members); complex elements are scaled part by part through their
// two reals (std::complex is layout-compatible with Real[2]), since every
// member function of std::complex is host-only.
template <class Flat>
struct ScaleElements {
  using T = typename Flat::non_const_value_type;
  using Real = typename real_of<T>::type;
  Flat flat;
  Real scale;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    if constexpr (std::is_same_v<Real, T>) {
      flat(i) *= scale;
    } else {
      Real* parts = reinterpret_cast<Real*>(&flat(i));
      parts[0] *= scale;
      parts[1] *= scale;
    }
  }
};

// The completion step of ReduceOp::avg: scales recv by 1/size on its own
// execution space.
template <class R>
std::function<void()> averaging(const R& recv, int size) {
  auto flat = flatten(recv);
  using Exec = typename R::execution_space;
  using K = ScaleElements<decltype(flat)>;
  const typename K::Real scale = typename K::Real(1) / typename K::Real(static_cast<double>(size));
  return [flat, scale] {
    Kokkos::parallel_for("weft::average", Kokkos::RangePolicy<Exec>(0, flat.size()), K{flat, scale});
    Exec().fence();
  };
}

// A buffer MPI may touch: the view itself where MPI can use its memory,
// otherwise a host copy (send side: filled now; receive side: copied back by
// unstage()).
template <class V>
struct Staged {
  using T = element_t<V>;
  using Host = Kokkos::View<T*, Kokkos::HostSpace>;
  // A reference to the caller's view: a request abandoned while an error
  // unwinds keeps its Staged alive, and with it the memory MPI may still
  // write into (dev below is an unmanaged alias and would not).
  std::remove_cvref_t<V> owner;
  Host host;
  flat_view_t<V> dev;
  T* ptr = nullptr;

  Staged(const V& v, bool fill) : owner(v), dev(flatten(v)) {
    typename std::remove_cvref_t<V>::execution_space().fence();  // kernels that wrote v must be done
    if constexpr (mpi_can_use_directly<V>) {
      ptr = const_cast<T*>(v.data());
      (void)fill;
    } else {
      host = Host(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::staging"), v.size());
      if (fill) Kokkos::deep_copy(host, dev);
      ptr = host.data();
    }
  }
  void unstage() {
    if constexpr (!mpi_can_use_directly<V>) {
      if constexpr (!std::is_const_v<typename std::remove_cvref_t<V>::value_type>) Kokkos::deep_copy(dev, host);
    }
  }
};

}  // namespace detail

/// Where the p blocks of an all_gather or all_to_all buffer sit, for blocks
/// that are not contiguous: rank r's block is `count` runs of `run` elements,
/// run o starting at element r * run + o * stride. This is the layout of a
/// tensor split along a dimension that is not the leading one (a matrix split
/// by columns: count = rows, run = columns per rank, stride = all columns), so
/// a redistribution can hand it to MPI as a derived datatype instead of
/// packing it first. The default-constructed layout means contiguous blocks.
struct BlockLayout {
  std::size_t count = 0;   ///< runs per block (0: contiguous blocks)
  std::size_t run = 0;     ///< elements per run
  std::size_t stride = 0;  ///< elements from the start of one run to the next of the same block
  /// Whether this describes contiguous blocks (no derived datatype needed).
  bool contiguous() const noexcept { return count <= 1; }
};

namespace detail {
// A committed MPI datatype for one block of a BlockLayout (a vector resized to
// one run, so block r starts r runs in); freed on destruction, which MPI
// allows while operations that use it are pending.
struct BlockType {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  BlockType(const BlockLayout& l, MPI_Datatype element, std::size_t element_bytes) {
    MPI_Datatype vec = MPI_DATATYPE_NULL;
    MPI_Type_vector(static_cast<int>(l.count), static_cast<int>(l.run), static_cast<int>(l.stride), element, &vec);
    MPI_Type_create_resized(vec, 0, static_cast<MPI_Aint>(l.run * element_bytes), &type);
    MPI_Type_commit(&type);
    MPI_Type_free(&vec);
  }
  BlockType(const BlockType&) = delete;
  BlockType& operator=(const BlockType&) = delete;
  ~BlockType() {
    if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  }
};
}  // namespace detail

/// A communicator of weft: one mesh axis, an axis group, or the world.
/// Non-copyable, movable. Created by Environment and Mesh; usable on its own
/// through Comm::duplicate.
class Comm {
 public:
  /// Wraps a duplicate of `user` (the user's communicator is never modified)
  /// named `name` (an axis name such as "tp", used in error messages).
  static Comm duplicate(MPI_Comm user, std::string name) {
    MPI_Comm c = MPI_COMM_NULL;
    int rc = MPI_Comm_dup(user, &c);
    if (rc != MPI_SUCCESS) throw CommError("duplicate", name, "weft::Comm::duplicate of '" + name + "': " + detail::mpi_error_text(rc));
    return adopt(c, std::move(name));
  }

  /// Takes ownership of `c` (it is freed with the Comm).
  static Comm adopt(MPI_Comm c, std::string name) {
    Comm out;
    auto& k = *out.core_;
    k.comm = c;
    k.owned = true;
    k.name = std::move(name);
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    MPI_Comm_rank(c, &k.rank);
    MPI_Comm_size(c, &k.size);
    k.check(MPI_Comm_dup(c, &k.shadow), "adopt");
    MPI_Comm_set_errhandler(k.shadow, MPI_ERRORS_RETURN);
    // The world ranks of this communicator's ranks, so that a wait past its
    // deadline can say which peers did not arrive.
    MPI_Group g = MPI_GROUP_NULL, wg = MPI_GROUP_NULL;
    MPI_Comm_group(c, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    std::vector<int> mine(static_cast<std::size_t>(k.size));
    std::iota(mine.begin(), mine.end(), 0);
    k.world_ranks.assign(mine.size(), MPI_UNDEFINED);
    MPI_Group_translate_ranks(g, k.size, mine.data(), wg, k.world_ranks.data());
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    return out;
  }

  Comm(Comm&&) noexcept = default;
  Comm& operator=(Comm&& o) noexcept {
    if (this != &o) {
      release();
      core_ = std::move(o.core_);
    }
    return *this;
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() { release(); }

  /// This process' rank in the communicator.
  int rank() const noexcept { return core_->rank; }
  /// Number of ranks.
  int size() const noexcept { return core_->size; }
  /// The axis (or group) name used in messages and statistics.
  const std::string& name() const noexcept { return core_->name; }
  /// The underlying MPI communicator (errors on it are returned, not fatal).
  MPI_Comm native() const noexcept { return core_->comm; }
  /// What this communicator's calls cost so far.
  const CommStats& stats() const noexcept { return core_->stats; }
  /// Forgets the statistics.
  void reset_stats() noexcept { core_->stats.reset(); }
  /// Counts an operation that moved this communicator's data without an MPI
  /// call (redistribute copying peers' blocks out of node-shared memory), so
  /// that stats() totals cover every transfer: one call of `kind`, `bytes`
  /// (in the convention of the collective it replaces) and `seconds`, all of
  /// them exposed.
  void record(CommKind kind, std::uint64_t bytes, double seconds) noexcept {
    core_->stats.record(kind, bytes, seconds, seconds);
  }

  /// The checked mode's agreement on one call, for transports that move the
  /// bytes of this communicator's ranks without MPI (weft::NcclComm): with
  /// checked() on and more than one rank, every rank must pass the same
  /// (kind, element type id of mpi_datatype, count, extra: the ReduceOp of a
  /// reduction, the root of a broadcast), or every rank raises a CommError
  /// listing what each called. Collective; does nothing when not checked.
  void agree_on_call(CommKind kind, int type_id, std::int64_t count, std::int64_t extra, const char* op) {
    agree(kind, type_id, count, extra, op);
  }
  /// The checked mode's check of all_to_allv counts, for the same transports:
  /// what rank i sends to j must be what j expects from i, else a CommError on
  /// every rank. Collective; does nothing when not checked.
  void agree_on_counts(std::span<const int> send_counts, std::span<const int> recv_counts, const char* op) {
    if (!core_->checked || core_->size == 1) return;
    check_counts_match(std::vector<int>(send_counts.begin(), send_counts.end()),
                       std::vector<int>(recv_counts.begin(), recv_counts.end()), op);
  }

  /// Whether redistribute over this communicator looks for inputs held in
  /// node-shared memory (weft::NodeShared turns it on for the mesh axes whose
  /// groups lie within one node, and off again when released). It is the same
  /// on every rank of the communicator, so that all of them take part in the
  /// small agreement that step starts with.
  bool node_shared_peers() const noexcept { return core_->node_shared_users > 0; }
  /// Adds (on = true) or removes one user of node_shared_peers(). Call it at
  /// the same point on every rank of the communicator, as weft::NodeShared
  /// does; a rank that disagrees would leave the others waiting in redistribute.
  void use_node_shared_peers(bool on) noexcept { core_->node_shared_users += on ? 1 : -1; }

  /// Whether redistribute over this communicator may stage ordinary host
  /// inputs through a node-shared scratch window (Shard<i> -> Replicate and
  /// Shard<i> -> Shard<j> splitting a non-leading dimension, when all ranks
  /// share one node and a rank copies at most
  /// WEFT_NODE_SHARED_STAGING_MAX_BYTES (512 KiB by default) into the
  /// window; see docs/placement.md, "Node-shared staging"). On by default;
  /// the environment variable WEFT_NODE_SHARED_STAGING=0 turns the default off.
  bool node_shared_staging() const noexcept {
    return core_->staging < 0 ? detail::node_shared_staging_default() : core_->staging != 0;
  }
  /// Turns the staging of node_shared_staging() on or off for this
  /// communicator. Every rank of the communicator must set the same value at
  /// the same point of the program (redistribute is collective, and the path
  /// it takes must be the same on every rank). The scratch window already
  /// allocated is kept until the communicator is freed.
  void set_node_shared_staging(bool on) noexcept { core_->staging = on ? 1 : 0; }
  /// Whether redistribute over this communicator may read its peers' host
  /// inputs directly out of their address spaces (Linux cross-memory attach,
  /// process_vm_readv) for Shard<i> -> Replicate and Shard<i> -> Shard<j>
  /// splitting a non-leading dimension, when all ranks share one node: each
  /// rank copies its peers' blocks straight into their places in its result,
  /// one copy with no packing, as MPI's own single-copy transport does for
  /// contiguous messages (docs/placement.md, "Cross-memory reads"). On by
  /// default; WEFT_CROSS_MEMORY_ATTACH=0 turns the default off. Off for good
  /// on this communicator, on every rank, after a read failed on any rank
  /// (e.g. where the kernel forbids it): redistribute then takes the other paths.
  bool cross_memory_attach() const noexcept {
    return !core_->cma_failed && (core_->cma < 0 ? detail::cross_memory_attach_default() : core_->cma != 0);
  }
  /// Turns cross_memory_attach() on or off for this communicator; every rank
  /// must set the same value at the same point of the program.
  void set_cross_memory_attach(bool on) noexcept { core_->cma = on ? 1 : 0; }
  /// Bytes of this rank's segment of the staging scratch window (0 until
  /// a redistribution first staged over this communicator): two buffers of
  /// the largest local input staged so far (rounded up to 64 KiB) and 64
  /// bytes of alignment. It never shrinks and is freed with the communicator.
  std::size_t node_shared_staging_bytes() const noexcept { return core_->staging_bytes; }
  /// Internal to weft (weft/comm/node_local.hpp): the shared state
  /// redistribute keeps per communicator for staging — whether the ranks
  /// share one node, the scratch window and its size. The window is released
  /// before the communicator is freed.
  detail::CommCore& staging_state() noexcept { return *core_; }

  /// Checked mode: before each collective the ranks agree on operation,
  /// element type and count (a mismatch is a CommError on every rank naming
  /// each rank's call), and every wait has a deadline (a CommError instead of a
  /// hang). Costs one small extra all-reduce per collective.
  void set_checked(bool on, double deadline_seconds = detail::checked_defaults().deadline_s) {
    WEFT_REQUIRE(deadline_seconds > 0, ConfigError, "weft::Comm::set_checked: the deadline must be positive, got ",
                 deadline_seconds, " s");
    core_->checked = on;
    core_->deadline_s = deadline_seconds;
  }
  /// Whether the checked mode is on.
  bool checked() const noexcept { return core_->checked; }
  /// The deadline of every wait on this communicator, in seconds (0: not
  /// bounded). Past it a checked-mode wait raises CommError; a default-mode
  /// wait ends the job on every rank with a message that names the operation,
  /// the axis and the ranks that did not arrive (the watchdog of
  /// weft::Environment keeps that bound; without an Environment it is not kept).
  double deadline() const noexcept { return core_->deadline_s; }
  /// This communicator's ranks as ranks of MPI_COMM_WORLD (what the
  /// watchdog's reports name).
  const std::vector<int>& world_ranks() const noexcept { return core_->world_ranks; }
  /// Sets deadline(); 0 turns the bound off for this communicator (the
  /// process default comes from WEFT_DEADLINE, 60 s when unset).
  void set_deadline(double seconds) {
    WEFT_REQUIRE(seconds >= 0, ConfigError, "weft::Comm::set_deadline on axis '", core_->name,
                 "': the deadline must be >= 0 seconds (0: no bound), got ", seconds);
    core_->deadline_s = seconds;
  }

  /// Splits like MPI_Comm_split; the result is named `name`. Collective.
  Comm split(int color, int key, std::string name) const {
    MPI_Comm c = MPI_COMM_NULL;
    core_->check(MPI_Comm_split(core_->comm, color, key, &c), "split");
    return adopt(c, std::move(name));
  }

  // ---------------------------------------------------------------- all_reduce
  /// recv = op over ranks of send (element-wise). Sizes must match.
  template <KokkosView S, KokkosView R>
  void all_reduce(const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    auto r = iall_reduce_impl(send, recv, op, false, false);
    r.wait();
  }
  /// In place: buf = op over ranks of buf.
  template <KokkosView V>
  void all_reduce(const V& buf, ReduceOp op = ReduceOp::sum) {
    auto r = iall_reduce_impl(buf, buf, op, true, false);
    r.wait();
  }
  /// Non-blocking all_reduce; recv is valid after the request's wait().
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request iall_reduce(const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    return iall_reduce_impl(send, recv, op, false, true);
  }
  /// Non-blocking in-place all_reduce.
  template <KokkosView V>
  [[nodiscard]] Request iall_reduce(const V& buf, ReduceOp op = ReduceOp::sum) {
    return iall_reduce_impl(buf, buf, op, true, true);
  }

  // ---------------------------------------------------------------- all_gather
  /// recv = concatenation of every rank's send, in rank order; recv.size() == size() * send.size().
  template <KokkosView S, KokkosView R>
  void all_gather(const S& send, const R& recv) {
    auto r = iall_gather_impl(send, recv, false);
    r.wait();
  }
  /// Non-blocking all_gather.
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request iall_gather(const S& send, const R& recv) {
    return iall_gather_impl(send, recv, true);
  }
  /// all_gather whose received blocks are laid out as `recv_layout` says
  /// (rank r's block: recv_layout.count runs of recv_layout.run elements at
  /// r * run + o * stride); send is contiguous. MPI writes the strided blocks
  /// itself (a derived datatype): no pack or unpack pass.
  template <KokkosView S, KokkosView R>
  void all_gather(const S& send, const R& recv, const BlockLayout& recv_layout) {
    auto r = iall_gather_impl(send, recv, false, recv_layout);
    r.wait();
  }
  /// Non-blocking all_gather into a blocked layout.
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request iall_gather(const S& send, const R& recv, const BlockLayout& recv_layout) {
    return iall_gather_impl(send, recv, true, recv_layout);
  }

  // ------------------------------------------------------------ reduce_scatter
  /// send holds size() equal blocks; rank i receives op over ranks of block i.
  template <KokkosView S, KokkosView R>
  void reduce_scatter(const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    auto r = ireduce_scatter_impl(send, recv, op, false);
    r.wait();
  }
  /// Non-blocking reduce_scatter.
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request ireduce_scatter(const S& send, const R& recv, ReduceOp op = ReduceOp::sum) {
    return ireduce_scatter_impl(send, recv, op, true);
  }

  // ---------------------------------------------------------------- all_to_all
  /// send and recv hold size() equal blocks; block j of send goes to rank j and
  /// arrives as block (this rank) of its recv.
  template <KokkosView S, KokkosView R>
  void all_to_all(const S& send, const R& recv) {
    auto r = iall_to_all_impl(send, recv, false);
    r.wait();
  }
  /// Non-blocking all_to_all.
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request iall_to_all(const S& send, const R& recv) {
    return iall_to_all_impl(send, recv, true);
  }
  /// all_to_all whose blocks (block j of send goes to rank j; block r of recv
  /// comes from rank r) are laid out as the two layouts say; a contiguous
  /// BlockLayout{} on either side means plain blocks there.
  template <KokkosView S, KokkosView R>
  void all_to_all(const S& send, const BlockLayout& send_layout, const R& recv, const BlockLayout& recv_layout) {
    auto r = iall_to_all_impl(send, recv, false, send_layout, recv_layout);
    r.wait();
  }
  /// Non-blocking all_to_all over blocked layouts.
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request iall_to_all(const S& send, const BlockLayout& send_layout, const R& recv,
                                    const BlockLayout& recv_layout) {
    return iall_to_all_impl(send, recv, true, send_layout, recv_layout);
  }

  /// Variable all_to_all: send_counts[j] elements (packed in rank order) go to
  /// rank j; recv_counts[j] elements arrive from rank j, packed in rank order.
  template <KokkosView S, KokkosView R>
  void all_to_allv(const S& send, std::span<const int> send_counts, const R& recv, std::span<const int> recv_counts) {
    auto r = iall_to_allv_impl(send, send_counts, recv, recv_counts, false);
    r.wait();
  }
  /// Non-blocking all_to_allv (the counts are copied; the caller may drop them).
  template <KokkosView S, KokkosView R>
  [[nodiscard]] Request iall_to_allv(const S& send, std::span<const int> send_counts, const R& recv,
                                     std::span<const int> recv_counts) {
    return iall_to_allv_impl(send, send_counts, recv, recv_counts, true);
  }

  // ----------------------------------------------------------------- broadcast
  /// buf on every rank = buf on root.
  template <KokkosView V>
  void broadcast(const V& buf, int root) {
    auto r = ibroadcast_impl(buf, root, false);
    r.wait();
  }
  /// Non-blocking broadcast.
  template <KokkosView V>
  [[nodiscard]] Request ibroadcast(const V& buf, int root) {
    return ibroadcast_impl(buf, root, true);
  }

  // ------------------------------------------------------------ point to point
  /// Sends buf to rank dest of this communicator.
  template <KokkosView V>
  void send(const V& buf, int dest, int tag = 0) {
    auto r = isend(buf, dest, tag);
    r.wait();
  }
  /// Receives exactly buf.size() elements from rank src.
  template <KokkosView V>
  void recv(const V& buf, int src, int tag = 0) {
    auto r = irecv(buf, src, tag);
    r.wait();
  }
  /// Non-blocking send.
  template <KokkosView V>
  [[nodiscard]] Request isend(const V& buf, int dest, int tag = 0) {
    using T = checked_element_t<V>;
    check_view(buf, "isend", "buffer");
    check_peer(dest, "isend");
    auto s = std::make_shared<detail::Staged<V>>(buf, true);
    const int n = count_of(buf.size(), "isend");
    auto st = begin(CommKind::send, "send", buf.size() * sizeof(T), s, {});
    post(*st, MPI_Isend(s->ptr, n, mpi_datatype<T>::get(), dest, tag, core_->comm, &st->reqs[0]));
    return Request(std::move(st));
  }
  /// Non-blocking receive.
  template <KokkosView V>
  [[nodiscard]] Request irecv(const V& buf, int src, int tag = 0) {
    using T = checked_element_t<V>;
    static_assert(!std::is_const_v<typename V::value_type>, "weft::Comm::recv: the receive buffer is a view of const elements; pass a view MPI can write into");
    check_view(buf, "irecv", "buffer");
    check_peer(src, "irecv");
    auto s = std::make_shared<detail::Staged<V>>(buf, false);
    const int n = count_of(buf.size(), "irecv");
    auto st = begin(CommKind::recv, "recv", buf.size() * sizeof(T), s, [s] { s->unstage(); });
    post(*st, MPI_Irecv(s->ptr, n, mpi_datatype<T>::get(), src, tag, core_->comm, &st->reqs[0]));
    return Request(std::move(st));
  }
  /// Sends send to dest while receiving recv from src (no deadlock for rings).
  template <KokkosView S, KokkosView R>
  void sendrecv(const S& send_buf, int dest, const R& recv_buf, int src, int tag = 0) {
    using T = checked_element_t<S>;
    static_assert(std::is_same_v<T, checked_element_t<R>>, "weft::Comm::sendrecv: send and receive views must have the same element type");
    check_view(send_buf, "sendrecv", "send buffer");
    check_view(recv_buf, "sendrecv", "receive buffer");
    check_peer(dest, "sendrecv");
    check_peer(src, "sendrecv");
    auto s = std::make_shared<detail::Staged<S>>(send_buf, true);
    auto r = std::make_shared<detail::Staged<R>>(recv_buf, false);
    auto st = begin(CommKind::sendrecv, "sendrecv", send_buf.size() * sizeof(T), std::make_shared<std::pair<decltype(s), decltype(r)>>(s, r),
                    [r] { r->unstage(); });
    st->reqs.resize(2, MPI_REQUEST_NULL);
    post(*st, MPI_Irecv(r->ptr, count_of(recv_buf.size(), "sendrecv"), mpi_datatype<T>::get(), src, tag, core_->comm, &st->reqs[0]));
    post(*st, MPI_Isend(s->ptr, count_of(send_buf.size(), "sendrecv"), mpi_datatype<T>::get(), dest, tag, core_->comm, &st->reqs[1]));
    Request(std::move(st)).wait();
  }

  /// Blocks until every rank arrived.
  void barrier() {
    agree(CommKind::barrier, 0, 0, 0, "barrier");
    MPI_Comm c = core_->comm;
    launch(begin(CommKind::barrier, "barrier", 0, nullptr, {}), false, [&](MPI_Request* q) { return MPI_Ibarrier(c, q); },
           [&] { return MPI_Barrier(c); })
        .wait();
  }

 private:
  Comm() : core_(std::make_unique<detail::CommCore>()) {}

  void release() noexcept {
    if (!core_) return;
    core_->staging_window.reset();  // collective, like freeing the communicator: before it
    if (!core_->owned) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      if (core_->shadow != MPI_COMM_NULL) MPI_Comm_free(&core_->shadow);
      if (core_->comm != MPI_COMM_NULL) MPI_Comm_free(&core_->comm);
    }
    core_.reset();
  }

  template <class V>
  using checked_element_t = std::enable_if_t<sizeof(mpi_datatype<element_t<V>>) != 0, element_t<V>>;

  template <class V>
  void check_view(const V& v, const char* op, const char* which) const {
    if (!v.span_is_contiguous() || v.span() != v.size())
      core_->fail(op, std::string("the ") + which + " view '" + v.label() +
                          "' is not contiguous (a strided subview or LayoutStride view); MPI needs one contiguous "
                          "block: deep_copy it into a contiguous view first");
  }
  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= core_->size)
      core_->fail(op, "peer rank " + std::to_string(peer) + " is outside the communicator (valid ranks 0.." +
                          std::to_string(core_->size - 1) + ")");
  }
  int count_of(std::size_t n, const char* op) const {
    if (n > static_cast<std::size_t>(INT_MAX))
      core_->fail(op, "a block of " + std::to_string(n) + " elements exceeds MPI's int count limit of " +
                          std::to_string(INT_MAX) + "; split the transfer into smaller views");
    return static_cast<int>(n);
  }
  static MPI_Op mpi_op(ReduceOp op) {
    switch (op) {
      case ReduceOp::max: return MPI_MAX;
      case ReduceOp::min: return MPI_MIN;
      default: return MPI_SUM;
    }
  }
  template <class T>
  void check_op(ReduceOp op, const char* where) const {
    constexpr bool is_complex = std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>;
    if (op == ReduceOp::avg && !std::is_floating_point_v<T> && !is_complex)
      core_->fail(where, std::string("ReduceOp::avg needs a floating-point or complex element type, got ") +
                             mpi_datatype<T>::name + "; reduce with ReduceOp::sum and divide yourself");
    if ((op == ReduceOp::max || op == ReduceOp::min) && is_complex)
      core_->fail(where, "ReduceOp::max and ReduceOp::min are not defined for complex elements");
  }

  // Checked mode: all ranks agree on (kind, type, count, extra) before a
  // collective; a disagreement becomes a CommError on every rank listing what
  // each rank called.
  void agree(CommKind kind, int type_id, std::int64_t count, std::int64_t extra, const char* op) {
    if (!core_->checked || core_->size == 1) return;
    std::int64_t sig[8] = {static_cast<std::int64_t>(kind), type_id, count, extra,
                           -static_cast<std::int64_t>(kind), -type_id, -count, -extra};
    std::int64_t res[8];
    MPI_Request rq;
    double exposed = 0;
    const std::string what = describe(kind, type_id, count, extra);
    core_->check(MPI_Iallreduce(sig, res, 8, MPI_INT64_T, MPI_MAX, core_->shadow, &rq), op);
    core_->wait_all(&rq, 1, op, exposed, "waiting for every rank to reach " + what);
    bool same = true;
    for (int i = 0; i < 4; ++i) same = same && (res[i] == -res[i + 4]);
    if (same) return;
    std::vector<std::int64_t> all(4 * static_cast<std::size_t>(core_->size));
    core_->check(MPI_Iallgather(sig, 4, MPI_INT64_T, all.data(), 4, MPI_INT64_T, core_->shadow, &rq), op);
    core_->wait_all(&rq, 1, op, exposed);
    std::string msg = "the ranks of this axis called different collectives:";
    for (int r = 0; r < core_->size; ++r) {
      const auto* s = &all[4 * static_cast<std::size_t>(r)];
      msg += "\n  rank " + std::to_string(r) + " called " + describe(static_cast<CommKind>(s[0]), static_cast<int>(s[1]), s[2], s[3]);
    }
    msg += "\nEvery rank of a communicator must make the same sequence of collective calls with matching sizes.";
    core_->fail(op, msg);
  }
  static std::string describe(CommKind kind, int type_id, std::int64_t count, std::int64_t extra) {
    std::string s(to_string(kind));
    if (kind == CommKind::barrier) return s + "()";
    s += "(";
    s += detail::datatype_name_of_id(type_id);
    s += " x " + std::to_string(count);
    if (kind == CommKind::all_reduce || kind == CommKind::reduce_scatter)
      s += std::string(", ") + to_string(static_cast<ReduceOp>(extra));
    if (kind == CommKind::broadcast) s += ", root " + std::to_string(extra);
    return s + ")";
  }

  std::unique_ptr<Request::State> begin(CommKind kind, const char* op, std::uint64_t bytes, std::shared_ptr<void> keep,
                                        std::function<void()> on_complete) {
    auto st = std::make_unique<Request::State>();
    st->core = core_.get();
    st->reqs.assign(1, MPI_REQUEST_NULL);
    st->kind = kind;
    st->op = op;
    st->bytes = bytes;
    st->keep = std::move(keep);
    st->on_complete = std::move(on_complete);
    st->t_start = detail::now_seconds();
    return st;
  }
  void post(Request::State& st, int rc) {
    if (rc != MPI_SUCCESS) {
      // Requests already posted (the first half of a sendrecv) must not be
      // abandoned with live buffers: keep them alive.
      new std::shared_ptr<void>(st.keep);
      core_->check(rc, st.op);
    }
  }

  // Starts the operation: the non-blocking MPI call when asked for one or in
  // checked mode (whose waits need deadlines); otherwise the blocking MPI call,
  // which MPI implementations tune better than their non-blocking twins.
  template <class NonBlocking, class Blocking>
  Request launch(std::unique_ptr<Request::State> st, bool nonblocking, NonBlocking&& nb, Blocking&& blocking) {
    if (nonblocking || core_->checked) {
      post(*st, nb(&st->reqs[0]));
    } else {
      const double t0 = detail::now_seconds();
      int rc = MPI_SUCCESS;
      {
        detail::WaitScope scope(st->op, core_->name, core_->world_ranks, core_->deadline_s);
        rc = blocking();
      }
      st->exposed += detail::now_seconds() - t0;
      post(*st, rc);
    }
    return Request(std::move(st));
  }

  template <class S, class R>
  Request iall_reduce_impl(const S& send, const R& recv, ReduceOp op, bool in_place, bool nonblocking) {
    using T = checked_element_t<S>;
    static_assert(std::is_same_v<T, checked_element_t<R>>, "weft::Comm::all_reduce: send and receive views must have the same element type");
    static_assert(detail::require_mpi_reducible<T>());
    const char* name = nonblocking ? "iall_reduce" : "all_reduce";
    check_op<T>(op, name);
    check_view(send, name, "send");
    check_view(recv, name, "receive");
    if (send.size() != recv.size())
      core_->fail(name, "the send view has " + std::to_string(send.size()) + " elements but the receive view has " +
                            std::to_string(recv.size()) + "; all_reduce needs equal sizes");
    const int n = count_of(send.size(), name);
    agree(CommKind::all_reduce, mpi_datatype<T>::id, n, static_cast<int>(op), name);
    std::function<void()> done;
    std::shared_ptr<void> keep;
    void* sp = MPI_IN_PLACE;
    void* rp = nullptr;
    auto r = std::make_shared<detail::Staged<R>>(recv, in_place);
    rp = r->ptr;
    if (!in_place) {
      auto s = std::make_shared<detail::Staged<S>>(send, true);
      sp = s->ptr;
      keep = std::make_shared<std::pair<decltype(s), decltype(r)>>(s, r);
    } else {
      keep = r;
    }
    auto avg = op == ReduceOp::avg ? detail::averaging(recv, core_->size) : std::function<void()>{};
    done = [r, avg] {
      r->unstage();
      if (avg) avg();
    };
    auto st = begin(CommKind::all_reduce, "all_reduce", send.size() * sizeof(T), std::move(keep), std::move(done));
    const auto dt = mpi_datatype<T>::get();
    const auto mop = mpi_op(op);
    MPI_Comm c = core_->comm;
    return launch(std::move(st), nonblocking, [&](MPI_Request* q) { return MPI_Iallreduce(sp, rp, n, dt, mop, c, q); },
                  [&] { return MPI_Allreduce(sp, rp, n, dt, mop, c); });
  }

  // Checks that a blocked layout of p blocks of `block` elements each fits a
  // buffer of `size` elements without overlapping itself.
  void check_layout(const BlockLayout& l, std::size_t block, std::size_t size, const char* op, const char* which) {
    if (l.contiguous()) return;
    const auto p = static_cast<std::size_t>(core_->size);
    auto fail = [&](const std::string& why) {
      core_->fail(op, std::string("the ") + which + " layout (count " + std::to_string(l.count) + ", run " +
                          std::to_string(l.run) + ", stride " + std::to_string(l.stride) + ") " + why);
    };
    if (l.run == 0 || l.count * l.run != block)
      fail("does not describe blocks of " + std::to_string(block) + " elements (count x run must equal it)");
    if (l.stride < p * l.run)
      fail("overlaps itself: the stride must be at least " + std::to_string(p) + " ranks x run = " +
           std::to_string(p * l.run));
    if ((l.count - 1) * l.stride + p * l.run > size)
      fail("reaches element " + std::to_string((l.count - 1) * l.stride + p * l.run) + " of a buffer of " +
           std::to_string(size));
    if (l.count > std::size_t(std::numeric_limits<int>::max()) || l.stride > std::size_t(std::numeric_limits<int>::max()))
      fail("has a count or stride beyond MPI's int range");
  }

  template <class S, class R>
  Request iall_gather_impl(const S& send, const R& recv, bool nonblocking, const BlockLayout& recv_layout = {}) {
    using T = checked_element_t<S>;
    static_assert(std::is_same_v<T, checked_element_t<R>>, "weft::Comm::all_gather: send and receive views must have the same element type");
    const char* name = nonblocking ? "iall_gather" : "all_gather";
    check_view(send, name, "send");
    check_view(recv, name, "receive");
    if (recv_layout.contiguous() && recv.size() != send.size() * static_cast<std::size_t>(core_->size))
      core_->fail(name, "the receive view has " + std::to_string(recv.size()) + " elements; expected " +
                            std::to_string(core_->size) + " ranks x " + std::to_string(send.size()) + " = " +
                            std::to_string(send.size() * static_cast<std::size_t>(core_->size)));
    const int n = count_of(send.size(), name);
    check_layout(recv_layout, send.size(), recv.size(), name, "receive");
    agree(CommKind::all_gather, mpi_datatype<T>::id, n, 0, name);
    auto s = std::make_shared<detail::Staged<S>>(send, true);
    // A blocked layout leaves gaps that MPI does not write: a host staging copy
    // must start from the view's contents, or copying it back would clobber them.
    auto r = std::make_shared<detail::Staged<R>>(recv, !recv_layout.contiguous());
    auto st = begin(CommKind::all_gather, "all_gather", recv.size() * sizeof(T), std::make_shared<std::pair<decltype(s), decltype(r)>>(s, r),
                    [r] { r->unstage(); });
    const auto dt = mpi_datatype<T>::get();
    MPI_Comm c = core_->comm;
    std::optional<detail::BlockType> blocked;
    int rn = n;
    MPI_Datatype rdt = dt;
    if (!recv_layout.contiguous()) {
      blocked.emplace(recv_layout, dt, sizeof(T));
      rn = 1;
      rdt = blocked->type;
    }
    return launch(std::move(st), nonblocking, [&](MPI_Request* q) { return MPI_Iallgather(s->ptr, n, dt, r->ptr, rn, rdt, c, q); },
                  [&] { return MPI_Allgather(s->ptr, n, dt, r->ptr, rn, rdt, c); });
  }

  template <class S, class R>
  Request ireduce_scatter_impl(const S& send, const R& recv, ReduceOp op, bool nonblocking) {
    using T = checked_element_t<S>;
    static_assert(std::is_same_v<T, checked_element_t<R>>, "weft::Comm::reduce_scatter: send and receive views must have the same element type");
    static_assert(detail::require_mpi_reducible<T>());
    const char* name = nonblocking ? "ireduce_scatter" : "reduce_scatter";
    check_op<T>(op, name);
    check_view(send, name, "send");
    check_view(recv, name, "receive");
    if (send.size() != recv.size() * static_cast<std::size_t>(core_->size))
      core_->fail(name, "the send view has " + std::to_string(send.size()) + " elements; expected " +
                            std::to_string(core_->size) + " ranks x " + std::to_string(recv.size()) +
                            " (the receive size) = " + std::to_string(recv.size() * static_cast<std::size_t>(core_->size)));
    const int n = count_of(recv.size(), name);
    agree(CommKind::reduce_scatter, mpi_datatype<T>::id, n, static_cast<int>(op), name);
    auto s = std::make_shared<detail::Staged<S>>(send, true);
    auto r = std::make_shared<detail::Staged<R>>(recv, false);
    auto avg = op == ReduceOp::avg ? detail::averaging(recv, core_->size) : std::function<void()>{};
    auto st = begin(CommKind::reduce_scatter, "reduce_scatter", send.size() * sizeof(T),
                    std::make_shared<std::pair<decltype(s), decltype(r)>>(s, r), [r, avg] {
                      r->unstage();
                      if (avg) avg();
                    });
    const auto dt = mpi_datatype<T>::get();
    const auto mop = mpi_op(op);
    MPI_Comm c = core_->comm;
    return launch(std::move(st), nonblocking, [&](MPI_Request* q) { return MPI_Ireduce_scatter_block(s->ptr, r->ptr, n, dt, mop, c, q); },
                  [&] { return MPI_Reduce_scatter_block(s->ptr, r->ptr, n, dt, mop, c); });
  }

  template <class S, class R>
  Request iall_to_all_impl(const S& send, const R& recv, bool nonblocking, const BlockLayout& send_layout = {},
                           const BlockLayout& recv_layout = {}) {
    using T = checked_element_t<S>;
    static_assert(std::is_same_v<T, checked_element_t<R>>, "weft::Comm::all_to_all: send and receive views must have the same element type");
    const char* name = nonblocking ? "iall_to_all" : "all_to_all";
    check_view(send, name, "send");
    check_view(recv, name, "receive");
    const auto p = static_cast<std::size_t>(core_->size);
    if (send.size() != recv.size() || send.size() % p != 0)
      core_->fail(name, "send has " + std::to_string(send.size()) + " and receive " + std::to_string(recv.size()) +
                            " elements; all_to_all needs equal sizes divisible by the " + std::to_string(p) +
                            " ranks (use all_to_allv for uneven blocks)");
    const int n = count_of(send.size() / p, name);
    check_layout(send_layout, send.size() / p, send.size(), name, "send");
    check_layout(recv_layout, recv.size() / p, recv.size(), name, "receive");
    agree(CommKind::all_to_all, mpi_datatype<T>::id, n, 0, name);
    auto s = std::make_shared<detail::Staged<S>>(send, true);
    auto r = std::make_shared<detail::Staged<R>>(recv, !recv_layout.contiguous());  // see iall_gather_impl
    auto st = begin(CommKind::all_to_all, "all_to_all", send.size() * sizeof(T), std::make_shared<std::pair<decltype(s), decltype(r)>>(s, r),
                    [r] { r->unstage(); });
    const auto dt = mpi_datatype<T>::get();
    MPI_Comm c = core_->comm;
    std::optional<detail::BlockType> sblocked, rblocked;
    int sn = n, rn = n;
    MPI_Datatype sdt = dt, rdt = dt;
    if (!send_layout.contiguous()) {
      sblocked.emplace(send_layout, dt, sizeof(T));
      sn = 1;
      sdt = sblocked->type;
    }
    if (!recv_layout.contiguous()) {
      rblocked.emplace(recv_layout, dt, sizeof(T));
      rn = 1;
      rdt = rblocked->type;
    }
    return launch(std::move(st), nonblocking, [&](MPI_Request* q) { return MPI_Ialltoall(s->ptr, sn, sdt, r->ptr, rn, rdt, c, q); },
                  [&] { return MPI_Alltoall(s->ptr, sn, sdt, r->ptr, rn, rdt, c); });
  }

  template <class S, class R>
  Request iall_to_allv_impl(const S& send, std::span<const int> send_counts, const R& recv,
                            std::span<const int> recv_counts, bool nonblocking) {
    using T = checked_element_t<S>;
    static_assert(std::is_same_v<T, checked_element_t<R>>, "weft::Comm::all_to_allv: send and receive views must have the same element type");
    const char* name = nonblocking ? "iall_to_allv" : "all_to_allv";
    check_view(send, name, "send");
    check_view(recv, name, "receive");
    const auto p = static_cast<std::size_t>(core_->size);
    if (send_counts.size() != p || recv_counts.size() != p)
      core_->fail(name, "got " + std::to_string(send_counts.size()) + " send counts and " +
                            std::to_string(recv_counts.size()) + " receive counts; expected one per rank (" +
                            std::to_string(p) + ")");
    struct Counts {
      std::vector<int> sc, sd, rc, rd;
    };
    auto c = std::make_shared<Counts>();
    c->sc.assign(send_counts.begin(), send_counts.end());
    c->rc.assign(recv_counts.begin(), recv_counts.end());
    c->sd.resize(p);
    c->rd.resize(p);
    long long st_total = 0, rt_total = 0;
    for (std::size_t j = 0; j < p; ++j) {
      if (c->sc[j] < 0 || c->rc[j] < 0) core_->fail(name, "negative count for rank " + std::to_string(j));
      c->sd[j] = count_of(static_cast<std::size_t>(st_total), name);
      c->rd[j] = count_of(static_cast<std::size_t>(rt_total), name);
      st_total += c->sc[j];
      rt_total += c->rc[j];
    }
    if (static_cast<std::size_t>(st_total) > send.size() || static_cast<std::size_t>(rt_total) > recv.size())
      core_->fail(name, "the counts add up to " + std::to_string(st_total) + " elements to send and " +
                            std::to_string(rt_total) + " to receive, but the views hold " + std::to_string(send.size()) +
                            " and " + std::to_string(recv.size()));
    agree(CommKind::all_to_allv, mpi_datatype<T>::id, 0, 0, name);
    if (core_->checked && core_->size > 1) check_counts_match(c->sc, c->rc, name);
    auto s = std::make_shared<detail::Staged<S>>(send, true);
    auto r = std::make_shared<detail::Staged<R>>(recv, false);
    auto keep = std::make_shared<std::tuple<decltype(s), decltype(r), decltype(c)>>(s, r, c);
    auto st = begin(CommKind::all_to_allv, "all_to_allv", static_cast<std::uint64_t>(st_total) * sizeof(T), keep, [r] { r->unstage(); });
    const auto dt = mpi_datatype<T>::get();
    MPI_Comm mc = core_->comm;
    return launch(std::move(st), nonblocking,
                  [&](MPI_Request* q) { return MPI_Ialltoallv(s->ptr, c->sc.data(), c->sd.data(), dt, r->ptr, c->rc.data(), c->rd.data(), dt, mc, q); },
                  [&] { return MPI_Alltoallv(s->ptr, c->sc.data(), c->sd.data(), dt, r->ptr, c->rc.data(), c->rd.data(), dt, mc); });
  }

  // Checked mode for all_to_allv: what rank i sends to j must be what j
  // expects from i. Exchanged with an all_to_all of the counts.
  void check_counts_match(const std::vector<int>& sc, const std::vector<int>& rc, const char* op) {
    std::vector<int> peer_sends(sc.size());
    MPI_Request rq;
    double exposed = 0;
    core_->check(MPI_Ialltoall(sc.data(), 1, MPI_INT, peer_sends.data(), 1, MPI_INT, core_->shadow, &rq), op);
    core_->wait_all(&rq, 1, op, exposed);
    int bad = -1;
    for (std::size_t j = 0; j < sc.size(); ++j)
      if (peer_sends[j] != rc[j]) bad = static_cast<int>(j);
    int any_bad = bad >= 0 ? 1 : 0, all_bad = 0;
    core_->check(MPI_Iallreduce(&any_bad, &all_bad, 1, MPI_INT, MPI_MAX, core_->shadow, &rq), op);
    core_->wait_all(&rq, 1, op, exposed);
    if (bad >= 0)
      core_->fail(op, "rank " + std::to_string(bad) + " sends " + std::to_string(peer_sends[static_cast<std::size_t>(bad)]) +
                          " elements to this rank, which expects " + std::to_string(rc[static_cast<std::size_t>(bad)]) +
                          "; send_counts on each rank must equal the matching recv_counts on its peers");
    if (all_bad) core_->fail(op, "another rank's all_to_allv counts do not match its peers' (see that rank's error)");
  }

  template <class V>
  Request ibroadcast_impl(const V& buf, int root, bool nonblocking) {
    using T = checked_element_t<V>;
    const char* name = nonblocking ? "ibroadcast" : "broadcast";
    check_view(buf, name, "buffer");
    if (root < 0 || root >= core_->size)
      core_->fail(name, "root " + std::to_string(root) + " is outside the communicator (valid ranks 0.." +
                            std::to_string(core_->size - 1) + ")");
    const int n = count_of(buf.size(), name);
    agree(CommKind::broadcast, mpi_datatype<T>::id, n, root, name);
    auto b = std::make_shared<detail::Staged<V>>(buf, core_->rank == root);
    auto st = begin(CommKind::broadcast, "broadcast", buf.size() * sizeof(T), b, [b] { b->unstage(); });
    const auto dt = mpi_datatype<T>::get();
    MPI_Comm c = core_->comm;
    return launch(std::move(st), nonblocking, [&](MPI_Request* q) { return MPI_Ibcast(b->ptr, n, dt, root, c, q); },
                  [&] { return MPI_Bcast(b->ptr, n, dt, root, c); });
  }

  std::unique_ptr<detail::CommCore> core_;
};

}  // namespace weft
