// redistribute: changes a DistView's placement over one or several mesh axes.
// The collective is chosen at compile time from the pair (From, To); pairs
// without meaning do not compile. Non-blocking forms return a Pending handle.
#pragma once

#include <algorithm>

#include <mpi.h>

#include <complex>
#include <cstdio>
#include <exception>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include <weft/comm/comm.hpp>
#include <weft/comm/node_local.hpp>
#include <weft/comm/request.hpp>
#include <weft/comm/transport.hpp>
#include <weft/core/error.hpp>
#include <weft/placement/dist_view.hpp>
#include <weft/placement/placement.hpp>

namespace weft {

/// The type redistribute<To>(x, Axis{}) returns: DV with Axis' placement
/// replaced by To.
template <DistributedView DV, class Axis, class To>
using redistributed_t =
    with_placements_t<DV, typename detail::replace_on<Axis, To, typename std::remove_cvref_t<DV>::placements>::type>;

namespace detail {

template <class DV, class... Steps>
struct chain_result {
  using type = DV;
};
template <class DV, class First, class... Rest>
struct chain_result<DV, First, Rest...> {
  using type = typename chain_result<redistributed_t<DV, typename First::axis, typename First::placement>, Rest...>::type;
};

template <class T>
inline constexpr bool averageable_v =
    std::is_floating_point_v<T> || std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>;

template <class Axis, std::size_t D, class... Ons>
constexpr bool innermost_in(type_list<Ons...>) {
  return innermost_sharder<axis_position<Axis, Ons...>(), D, Ons...>();
}

template <class List>
struct front_axis;
template <class First, class... Rest>
struct front_axis<type_list<First, Rest...>> {
  using type = typename First::axis;
};

// Whether the placements name Axis. A DistView's type knows only the axes it
// names (its mesh's other axes are known at run time only), so a step over
// another axis is refused at compile time: over an axis the mesh lacks, a
// Shard target would fail at run time and a Replicate one silently do
// nothing. The axis and the placements are this function's template
// arguments, which the compiler's instantiation note prints.
template <class Axis, class... Ons>
constexpr bool axis_is_placed(type_list<Ons...>) {
  static_assert(axis_position<Axis, Ons...>() != npos,
                "weft::redistribute: the tensor is not placed over the axis passed (Axis in the instantiation note; "
                "the axes it is placed over are the On<...> list Ons there). A DistView's type knows only the axes "
                "it names, so it cannot tell whether its mesh has this one: redistribute<Shard<D>> over an axis the "
                "mesh lacks would fail at run time, and redistribute<Replicate> would silently do nothing. Pass one "
                "of the tensor's axes; if the mesh has this axis and the tensor is replicated over it, name the axis "
                "in the tensor's type: weft::On<Axis, weft::Replicate>.");
  return axis_position<Axis, Ons...>() != npos;
}

// Every compile-time rule of one redistribution step over Axis. The messages
// name both placements, because the step's From and To are what the user sees.
template <class DV, class Axis, class To>
constexpr bool check_step() {
  static_assert(AxisTag<Axis>, "weft::redistribute: the axis must be a mesh axis tag such as weft::TP");
  [[maybe_unused]] constexpr bool placed = axis_is_placed<Axis>(typename DV::placements{});
  static_assert(Placement<To>,
                "weft::redistribute<To>: To must be weft::Shard<D>, weft::Replicate or weft::Partial<Op> (or, for "
                "the multi-axis form, a list of weft::On<Axis, P>)");
  using From = typename DV::template placement_on<Axis>;
  using T = typename DV::value_type;
  constexpr bool same = std::is_same_v<From, To>;
  if constexpr (is_partial_v<To> && !same) {
    static_assert(!is_replicate_v<From>,
                  "weft::redistribute: Replicate -> Partial has no meaning: a replicated tensor is already complete, "
                  "and no collective turns it into partial values. Keep it Replicate; partial values come out of "
                  "computations (e.g. matmul of Shard<1> by Shard<0>), not out of redistribution.");
    static_assert(!is_shard_v<From>,
                  "weft::redistribute: Shard -> Partial has no meaning: a shard holds final values of one block, not "
                  "partial values of the whole tensor. Redistribute to Replicate (all-gather) or to another Shard<D> "
                  "(all-to-all) instead.");
    static_assert(!is_partial_v<From>,
                  "weft::redistribute: Partial<Op1> -> Partial<Op2> with another reduction has no meaning: partial "
                  "values of one reduction are not partial values of another. Redistribute to Replicate (all-reduce) "
                  "or to Shard<D> (reduce-scatter) first.");
  }
  if constexpr (is_partial_v<From> && !same) {
    static_assert(!std::is_same_v<typename From::op, Avg> || averageable_v<T>,
                  "weft::redistribute: Partial<Avg> -> Replicate or Shard needs floating-point elements: the mean of "
                  "integers is not an integer. Use Partial<Sum> and divide, or a floating-point DistView.");
  }
  if constexpr (is_shard_v<To>) {
    static_assert(To::dim < DV::rank,
                  "weft::redistribute: the target Shard<D> names a dimension D that the tensor does not have (D "
                  "must be smaller than the rank)");
  }
  using FromList = typename DV::placements;
  using ToList = typename replace_on<Axis, To, FromList>::type;
  if constexpr (is_shard_v<From> && !same) {
    static_assert(innermost_in<Axis, From::dim>(FromList{}),
                  "weft::redistribute: Shard -> another placement over this axis needs its blocks contiguous, but "
                  "a mesh axis listed after it shards the same dimension inside its blocks. Redistribute that inner "
                  "(later-listed) axis first.");
  }
  if constexpr (is_shard_v<To> && !same) {
    static_assert(innermost_in<Axis, (To::dim < DV::rank ? To::dim : 0)>(ToList{}),
                  "weft::redistribute: Replicate, Partial or Shard -> Shard<D> over this axis would split dimension "
                  "D outside a mesh axis listed after it that already shards D, which is no local operation. "
                  "Redistribute that inner (later-listed) axis first, or list the axes in the other order.");
  }
  return true;
}

// Tensor extents seen as (outer, mid, inner) around dimension d: LayoutRight
// makes element (o, k, i) sit at (o * mid + k) * inner + i.
struct Split3 {
  std::size_t outer = 1, mid = 1, inner = 1;
};
template <std::size_t R>
Split3 split3(const std::array<std::size_t, R>& e, std::size_t d) {
  Split3 s;
  for (std::size_t i = 0; i < d; ++i) s.outer *= e[i];
  s.mid = e[d];
  for (std::size_t i = d + 1; i < R; ++i) s.inner *= e[i];
  return s;
}

template <class V>
auto flat(const V& v) {
  return Kokkos::View<typename V::value_type*, typename V::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
      v.data(), v.size());
}

// Packing moves p * outer runs of m * inner contiguous elements (m = mid / p):
// a 2-D range over (run, element in run) keeps the inner loop a plain copy.
template <class Exec>
using RunPolicy = Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>, Kokkos::IndexType<std::int64_t>>;

// Host execution spaces copy whole runs with std::copy_n (memcpy speed);
// devices keep a thread per element.
template <class Exec>
inline constexpr bool host_runs = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;

// Host memory: blocks split along a non-leading dimension go to MPI as a
// derived datatype (Comm's BlockLayout), which MPI copies in one pass, when
// the tensor has at least blocked_layout_min_bytes; smaller ones, and device
// memory (MPI's datatype engines are slow there, the kernels are not), keep
// the pack kernels below. Measured on 2 ranks of one node (docs/placement.md):
// the datatype path wins from 16 MiB on and loses at 1-4 MiB.
template <class Space>
inline constexpr bool blocked_layouts = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible;
// blocked_layout_min_bytes() (comm/node_local.hpp) is the size threshold.

// The layout of the p blocks of a (outer, p*m, inner) buffer split along its
// middle dimension: block r is outer runs of m*inner elements.
inline BlockLayout block_layout(Split3 whole, std::size_t p) {
  if (whole.outer == 1) return {};
  const std::size_t run = whole.mid / p * whole.inner;
  return {whole.outer, run, p * run};
}

// dst holds p blocks, block r being src(:, r*m : (r+1)*m, :), so that
// rank-ordered collectives see each rank's block contiguously.
template <class Exec, class Src, class Dst>
void pack_blocks(const Src& src, const Dst& dst, Split3 s, std::size_t p) {
  const std::int64_t P = static_cast<std::int64_t>(p), O = static_cast<std::int64_t>(s.outer),
                     run = static_cast<std::int64_t>(s.mid / p * s.inner);
  if constexpr (host_runs<Exec>) {
    // On the host a run is a plain copy: one division per run, not per element.
    const auto* sp = src.data();
    auto* dp = dst.data();
    Kokkos::parallel_for(
        "weft::redistribute::pack", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, P * O),
        [=](const std::int64_t b) {  // a host lambda: std::copy_n is a host function
          const std::int64_t r = b / O, o = b % O;
          std::copy_n(sp + (o * P + r) * run, run, dp + b * run);
        });
  } else {
    Kokkos::parallel_for(
        "weft::redistribute::pack", RunPolicy<Exec>({0, 0}, {P * O, run}),
        KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t j) {
          const std::int64_t r = b / O, o = b % O;
          dst(b * run + j) = src((o * P + r) * run + j);
        });
  }
  Exec().fence();
}

// The inverse: src holds p blocks of (outer, m, inner); dst is (outer, p*m, inner).
template <class Exec, class Src, class Dst>
void unpack_blocks(const Src& src, const Dst& dst, Split3 block, std::size_t p) {
  const std::int64_t P = static_cast<std::int64_t>(p), O = static_cast<std::int64_t>(block.outer),
                     run = static_cast<std::int64_t>(block.mid * block.inner);
  if constexpr (host_runs<Exec>) {
    const auto* sp = src.data();
    auto* dp = dst.data();
    Kokkos::parallel_for(
        "weft::redistribute::unpack", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, P * O),
        [=](const std::int64_t b) {  // a host lambda: std::copy_n is a host function
          const std::int64_t r = b / O, o = b % O;
          std::copy_n(sp + b * run, run, dp + (o * P + r) * run);
        });
  } else {
    Kokkos::parallel_for(
        "weft::redistribute::unpack", RunPolicy<Exec>({0, 0}, {P * O, run}),
        KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t j) {
          const std::int64_t r = b / O, o = b % O;
          dst((o * P + r) * run + j) = src(b * run + j);
        });
  }
  Exec().fence();
}

// dst = block c of src along the mid dimension.
template <class Exec, class Src, class Dst>
void slice_block(const Src& src, const Dst& dst, Split3 s, std::size_t p, std::size_t c) {
  const std::int64_t P = static_cast<std::int64_t>(p), O = static_cast<std::int64_t>(s.outer),
                     run = static_cast<std::int64_t>(s.mid / p * s.inner), C = static_cast<std::int64_t>(c);
  Kokkos::parallel_for(
      "weft::redistribute::slice", RunPolicy<Exec>({0, 0}, {O, run}),
      KOKKOS_LAMBDA(const std::int64_t o, const std::int64_t j) { dst(o * run + j) = src((o * P + C) * run + j); });
  Exec().fence();
}

// One collective of a redistribution: start packs (if needed) and launches it,
// finish unpacks (if needed) once it completed. The closures own the views
// they touch, so a pending stage keeps its buffers alive.
struct Stage {
  std::function<Request(bool nonblocking)> start;
  std::function<void()> finish;
};

// Pack buffers, kept for reuse: a training loop redistributes the same shapes
// every step, and fresh large allocations cost page faults on every first
// touch. A buffer is free when only the cache holds it (a pending stage holds
// a reference); buffers are reused at their exact size, at most `keep` are
// kept per element type and memory space, and all are freed before Kokkos
// finalizes. Not thread-safe, like the Comm calls around it.
template <class T, class Space>
struct ScratchCache {
  static constexpr std::size_t keep = 8;
  std::vector<Kokkos::View<T*, Space>> buffers;

  static ScratchCache& get() {
    static ScratchCache* cache = [] {
      auto* c = new ScratchCache;
      Kokkos::push_finalize_hook([c] { c->buffers.clear(); });
      return c;
    }();
    return *cache;
  }
  Kokkos::View<T*, Space> acquire(std::size_t n, const char* label) {
    for (auto& b : buffers)
      if (b.size() == n && b.use_count() == 1) return b;
    Kokkos::View<T*, Space> b(Kokkos::view_alloc(std::string(label), Kokkos::WithoutInitializing), n);
    if (buffers.size() < keep) {
      buffers.push_back(b);
    } else {
      for (auto& old : buffers)
        if (old.use_count() == 1) {
          old = b;
          break;
        }
    }
    return b;
  }
};

template <class Exec, class T, class Space>
Kokkos::View<T*, Space> scratch(std::size_t n, const char* label) {
  return ScratchCache<T, Space>::get().acquire(n, label);
}

// Puts the node-local paths of transport Tr (exchange_in_node,
// comm/node_local.hpp) in front of a Shard -> Replicate or Shard -> Shard
// stage on host memory: when one of them moves the chunks of `layout`
// straight into the result, the planned collective and its finish are
// skipped; otherwise the stage runs as planned. Decided in start, when the
// input is ready, by every rank alike. For a transport without node-local
// paths (transport::Mpi) the stage is returned as planned.
template <class Tr, class Exec, class T, class Src, class Dst>
Stage with_transport(Stage planned, Comm* cm, Src src, Dst dst, CommKind kind, std::uint64_t bytes,
                     const ChunkLayout& layout) {
  if constexpr (!std::is_same_v<Tr, transport::NodeLocal>) {
    (void)cm, (void)src, (void)dst, (void)kind, (void)bytes, (void)layout;
    return planned;
  } else {
    auto took = std::make_shared<bool>(false);
    Stage s;
    s.start = [=, start = std::move(planned.start)](bool nb) {
      *took = exchange_in_node<Tr, Exec, T>(*cm, src.data(), src.size(), dst.data(), layout, kind, bytes);
      if (*took) return Request();
      return start(nb);
    };
    if (planned.finish)
      s.finish = [took, finish = std::move(planned.finish)] {
        if (!*took) finish();
      };
    return s;
  }
}

// Plans one step over Axis from x into out (already allocated, of the result
// type). The branch taken is fixed at compile time by (From, To); the
// transport Tr (void: transport::default_for_t of the view's memory space)
// chooses how the bytes move.
template <class Axis, class To, class TrOrVoid = void, class DV, class Out>
Stage plan_step(const DV& x, const Out& out, Comm& comm) {
  using From = typename DV::template placement_on<Axis>;
  using T = typename DV::value_type;
  using Exec = typename DV::execution_space;
  using Space = typename DV::memory_space;
  using Tr = std::conditional_t<std::is_void_v<TrOrVoid>, transport::default_for_t<Space>, TrOrVoid>;
  static_assert(!std::is_same_v<Tr, transport::Nccl>,
                "weft::redistribute: transport::Nccl needs a weft::NcclComm; redistribute moves its bytes over the "
                "mesh's weft::Comm (transport::Mpi or transport::NodeLocal)");
  static_assert(!std::is_same_v<Tr, transport::NodeLocal> ||
                    Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible,
                "weft::redistribute: transport::NodeLocal copies with the host, and this view's memory is not "
                "host-accessible; use transport::Mpi for device views");
  const std::size_t p = static_cast<std::size_t>(comm.size());
  const std::size_t c = static_cast<std::size_t>(comm.rank());
  Comm* cm = &comm;
  auto src = x.local();
  auto dst = out.local();
  Stage s;
  if constexpr (std::is_same_v<From, To>) {
    s.start = [src, dst](bool) {
      if (src.data() != dst.data()) Kokkos::deep_copy(dst, src);
      return Request();
    };
  } else if constexpr (is_shard_v<From> && is_replicate_v<To>) {
    // all-gather; blocks interleave with the outer dimensions unless D leads.
    const Split3 sp = split3(x.local_extents(), From::dim);
    if (sp.outer == 1) {
      s.start = [cm, src, dst](bool nb) {
        if (nb) return cm->iall_gather(src, dst);
        cm->all_gather(src, dst);
        return Request();
      };
    } else if (blocked_layouts<Space> && dst.size() * sizeof(T) >= blocked_layout_min_bytes()) {
      Split3 whole = sp;
      whole.mid *= p;
      const BlockLayout layout = block_layout(whole, p);
      s.start = [cm, src, dst, layout](bool nb) {
        if (nb) return cm->iall_gather(flat(src), flat(dst), layout);
        cm->all_gather(flat(src), flat(dst), layout);
        return Request();
      };
    } else {
      auto buf = scratch<Exec, T, Space>(dst.size(), "weft::redistribute::gathered");
      s.start = [cm, src, buf](bool nb) {
        if (nb) return cm->iall_gather(src, buf);
        cm->all_gather(src, buf);
        return Request();
      };
      s.finish = [buf, dst, sp, p] { unpack_blocks<Exec>(buf, flat(dst), sp, p); };
    }
    if constexpr (blocked_layouts<Space>)
      s = with_transport<Tr, Exec, T>(std::move(s), cm, src, dst, CommKind::all_gather, dst.size() * sizeof(T),
                                      ChunkLayout{src.size(), src.size(), 1, 0, sp.mid * sp.inner, sp.outer != 1});
  } else if constexpr (is_partial_v<From> && is_replicate_v<To>) {
    constexpr ReduceOp op = From::op::op;
    s.start = [cm, src, dst](bool nb) {
      if (nb) return cm->iall_reduce(src, dst, op);
      cm->all_reduce(src, dst, op);
      return Request();
    };
  } else if constexpr (is_partial_v<From> && is_shard_v<To>) {
    constexpr ReduceOp op = From::op::op;
    const Split3 sp = split3(x.local_extents(), To::dim);
    if (sp.outer == 1) {
      s.start = [cm, src, dst](bool nb) {
        if (nb) return cm->ireduce_scatter(src, dst, op);
        cm->reduce_scatter(src, dst, op);
        return Request();
      };
    } else {
      auto buf = scratch<Exec, T, Space>(src.size(), "weft::redistribute::packed");
      s.start = [cm, src, dst, buf, sp, p](bool nb) {
        pack_blocks<Exec>(flat(src), buf, sp, p);
        if (nb) return cm->ireduce_scatter(buf, dst, op);
        cm->reduce_scatter(buf, dst, op);
        return Request();
      };
    }
  } else if constexpr (is_shard_v<From> && is_shard_v<To>) {
    // all-to-all: split along To::dim into p chunks (chunk r to rank r), and
    // concatenate the chunks received along From::dim in rank order.
    const Split3 send_split = split3(x.local_extents(), To::dim);
    auto chunk = x.local_extents();
    chunk[To::dim] /= p;
    const Split3 recv_split = split3(chunk, From::dim);
    using Buf = Kokkos::View<T*, Space>;
    if (blocked_layouts<Space> && src.size() * sizeof(T) >= blocked_layout_min_bytes()) {
      Split3 whole_recv = recv_split;
      whole_recv.mid *= p;
      const BlockLayout send_layout = block_layout(send_split, p), recv_layout = block_layout(whole_recv, p);
      s.start = [cm, src, dst, send_layout, recv_layout](bool nb) {
        if (nb) return cm->iall_to_all(flat(src), send_layout, flat(dst), recv_layout);
        cm->all_to_all(flat(src), send_layout, flat(dst), recv_layout);
        return Request();
      };
      return with_transport<Tr, Exec, T>(
          std::move(s), cm, src, dst, CommKind::all_to_all, src.size() * sizeof(T),
          ChunkLayout{src.size() / p, send_split.mid / p * send_split.inner, p, c, recv_split.mid * recv_split.inner,
                      send_split.outer != 1 || recv_split.outer != 1});
    }
    Buf send_buf = send_split.outer == 1 ? Buf() : scratch<Exec, T, Space>(src.size(), "weft::redistribute::packed");
    Buf recv_buf = recv_split.outer == 1 ? Buf() : scratch<Exec, T, Space>(dst.size(), "weft::redistribute::received");
    s.start = [cm, src, dst, send_buf, recv_buf, send_split, p](bool nb) {
      auto send = flat(src);
      if (send_buf.data()) {
        pack_blocks<Exec>(flat(src), send_buf, send_split, p);
        send = flat(send_buf);
      }
      auto recv = recv_buf.data() ? flat(recv_buf) : flat(dst);
      if (nb) return cm->iall_to_all(send, recv);
      cm->all_to_all(send, recv);
      return Request();
    };
    if (recv_buf.data()) s.finish = [recv_buf, dst, recv_split, p] { unpack_blocks<Exec>(recv_buf, flat(dst), recv_split, p); };
    if constexpr (blocked_layouts<Space>)
      s = with_transport<Tr, Exec, T>(
          std::move(s), cm, src, dst, CommKind::all_to_all, src.size() * sizeof(T),
          ChunkLayout{src.size() / p, send_split.mid / p * send_split.inner, p, c, recv_split.mid * recv_split.inner,
                      send_split.outer != 1 || recv_split.outer != 1});
  } else if constexpr (is_replicate_v<From> && is_shard_v<To>) {
    const Split3 sp = split3(x.local_extents(), To::dim);
    s.start = [src, dst, sp, p, c](bool) {
      slice_block<Exec>(flat(src), flat(dst), sp, p, c);
      return Request();
    };
  } else {
    static_assert(std::is_same_v<From, To>, "weft::redistribute: internal error: an unhandled placement pair");
  }
  return s;
}

template <class Axis, class To, class DV>
redistributed_t<DV, Axis, To> make_output(const DV& x) {
  using Out = redistributed_t<DV, Axis, To>;
  if constexpr (std::is_same_v<typename DV::template placement_on<Axis>, To>)
    return Out(internal_tag{}, x.axis_table(), x.global_extents(), x.local());
  else
    return Out(internal_tag{}, x.axis_table(), x.global_extents(), std::string("weft::redistribute"));
}

template <class DV>
DV plan_chain(const DV& x, std::vector<Stage>&) {
  return x;
}
template <class First, class... Rest, class DV>
auto plan_chain(const DV& x, std::vector<Stage>& stages) {
  using Axis = typename First::axis;
  using To = typename First::placement;
  static_assert(check_step<DV, Axis, To>());
  auto out = make_output<Axis, To>(x);
  if constexpr (!std::is_same_v<typename DV::template placement_on<Axis>, To>)
    stages.push_back(plan_step<Axis, To>(x, out, x.template comm<Axis>()));
  return plan_chain<Rest...>(out, stages);
}

inline void run_blocking(Stage& s) {
  Request r = s.start(false);
  r.wait();
  if (s.finish) s.finish();
}
inline void run_blocking(std::vector<Stage>& stages) {
  for (auto& s : stages) run_blocking(s);
}

template <class DV, class Out>
void check_same_global(const DV& x, const Out& out) {
  for (std::size_t d = 0; d < DV::rank; ++d)
    WEFT_REQUIRE(x.global_extent(d) == out.global_extent(d), ShapeError,
                 "weft::redistribute: the destination has global extent ", out.global_extent(d), " in dimension ", d,
                 " but the source has ", x.global_extent(d), "; redistribution keeps the global shape");
}

}  // namespace detail

/// Handle of a non-blocking redistribution. The transfer runs while the caller
/// computes; test() makes progress (and starts the next axis' collective of a
/// multi-axis redistribution), wait() completes it and returns the result. A
/// handle destroyed while pending completes the transfer first, so that the
/// other ranks' collectives are matched. Move-only.
template <class Result>
class Pending {
 public:
  /// Starts the first collective.
  Pending(Result out, std::vector<detail::Stage> stages) : out_(std::move(out)), stages_(std::move(stages)) {
    if (!stages_.empty()) req_ = stages_[0].start(true);
  }
  Pending(Pending&&) noexcept = default;
  Pending& operator=(Pending&&) = delete;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() {
    if (next_ >= stages_.size() || std::uncaught_exceptions() > 0) return;
    try {
      (void)wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft: a pending redistribution failed while being destroyed: %s\n", e.what());
    }
  }

  /// Whether every collective has completed (and been unpacked).
  bool done() const noexcept { return next_ >= stages_.size(); }

  /// Makes progress without blocking; true once the result is complete.
  bool test() {
    while (next_ < stages_.size()) {
      if (!req_.test()) return false;
      complete_current();
    }
    return true;
  }

  /// Blocks until the result is complete and returns it.
  Result wait() {
    while (next_ < stages_.size()) {
      req_.wait();
      complete_current();
    }
    return out_;
  }

 private:
  void complete_current() {
    auto& s = stages_[next_];
    if (s.finish) s.finish();
    if (++next_ < stages_.size()) req_ = stages_[next_].start(true);
  }

  Result out_;
  std::vector<detail::Stage> stages_;
  std::size_t next_ = 0;
  Request req_;
};

/// Redistributes x over mesh axis Axis to placement To, as redistribute<To>(x,
/// Axis{}) below, with the transport named: Tr is
/// weft::transport::NodeLocal (the default for host memory: the node-local
/// paths of comm/node_local.hpp in front of MPI's collective) or
/// weft::transport::Mpi (MPI's collective only; the default for device
/// memory). The result is the same element for element; only the path the
/// bytes take differs.
///   auto y = weft::redistribute<weft::Replicate, weft::transport::Mpi>(x, weft::TP{});
template <Placement To, Transport Tr, DistributedView DV, AxisTag Axis>
redistributed_t<DV, Axis, To> redistribute(const DV& x, Axis) {
  static_assert(detail::check_step<DV, Axis, To>());
  using Out = redistributed_t<DV, Axis, To>;
  Out out = detail::make_output<Axis, To>(x);
  if constexpr (!std::is_same_v<typename DV::template placement_on<Axis>, To>) {
    auto s = detail::plan_step<Axis, To, Tr>(x, out, x.template comm<Axis>());
    detail::run_blocking(s);
  }
  return out;
}

/// As above, writing into `out` (a DistView of the result type and the same
/// global extents).
template <Placement To, Transport Tr, DistributedView DV, AxisTag Axis>
void redistribute(const DV& x, Axis, const redistributed_t<DV, Axis, To>& out) {
  static_assert(detail::check_step<DV, Axis, To>());
  detail::check_same_global(x, out);
  auto s = detail::plan_step<Axis, To, Tr>(x, out, x.template comm<Axis>());
  detail::run_blocking(s);
}

/// Redistributes x over mesh axis Axis to placement To; the collective follows
/// from (From, To): Shard->Replicate all-gather, Partial->Replicate
/// all-reduce, Partial->Shard reduce-scatter, Shard<i>->Shard<j> all-to-all,
/// Replicate->Shard a local slice, equal placements nothing (the result shares
/// x's data). Collective over the axis. Axis must be one of the axes x's
/// type names (On<Axis, P>; On<Axis, weft::Replicate> for a replicated
/// tensor to be sliced): any other does not compile, in every form that takes
/// an axis tag, because the type cannot tell whether the mesh has it.
///   auto y = weft::redistribute<weft::Replicate>(x, weft::TP{});
template <Placement To, DistributedView DV, AxisTag Axis>
redistributed_t<DV, Axis, To> redistribute(const DV& x, Axis axis) {
  return redistribute<To, transport::default_for_t<typename DV::memory_space>>(x, axis);
}

/// As above, writing into `out` (a DistView of the result type and the same
/// global extents), so that repeated redistributions reuse its memory.
template <Placement To, DistributedView DV, AxisTag Axis>
void redistribute(const DV& x, Axis axis, const redistributed_t<DV, Axis, To>& out) {
  redistribute<To, transport::default_for_t<typename DV::memory_space>>(x, axis, out);
}

/// Redistributes a DistView placed over a single mesh axis, naming that axis
/// by its communicator (mesh.axis<TP>()): the form of the design example. The
/// communicator must be the view's axis (ConfigError otherwise).
template <Placement To, DistributedView DV>
auto redistribute(const DV& x, Comm& axis) {
  static_assert(DV::placements::size == 1,
                "weft::redistribute(x, comm): the view is placed over several mesh axes (or none), so a "
                "communicator cannot say at compile time which one changes. Name the axis instead: "
                "weft::redistribute<To>(x, weft::TP{}) or weft::redistribute<weft::On<weft::TP, To>>(x).");
  using Axis = typename detail::front_axis<typename DV::placements>::type;
  Comm& own = x.template comm<Axis>();
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(own.native(), axis.native(), &cmp);
  WEFT_REQUIRE(cmp == MPI_IDENT || cmp == MPI_CONGRUENT, ConfigError, "weft::redistribute: the communicator '",
               axis.name(), "' is not the mesh axis '", Axis::name, "' that ", DV::describe(),
               " is placed over; pass mesh.axis<", Axis::name, ">() or name the axis as a tag");
  static_assert(detail::check_step<DV, Axis, To>());
  using Out = redistributed_t<DV, Axis, To>;
  Out out = detail::make_output<Axis, To>(x);
  if constexpr (!std::is_same_v<typename DV::template placement_on<Axis>, To>) {
    auto s = detail::plan_step<Axis, To>(x, out, axis);
    detail::run_blocking(s);
  }
  return out;
}

/// Redistributes over several axes, one after the other in the order given:
///   weft::redistribute<weft::On<weft::TP, weft::Replicate>, weft::On<weft::DP, weft::Shard<0>>>(x)
/// The order matters when two axes shard the same dimension: the inner
/// (later-listed) axis must change first.
template <OnPlacement... Steps, DistributedView DV>
  requires(sizeof...(Steps) >= 1)
typename detail::chain_result<DV, Steps...>::type redistribute(const DV& x) {
  std::vector<detail::Stage> stages;
  auto out = detail::plan_chain<Steps...>(x, stages);
  detail::run_blocking(stages);
  return out;
}

/// Non-blocking redistribute over one axis; wait() on the handle returns the result.
template <Placement To, DistributedView DV, AxisTag Axis>
[[nodiscard]] Pending<redistributed_t<DV, Axis, To>> iredistribute(const DV& x, Axis) {
  static_assert(detail::check_step<DV, Axis, To>());
  std::vector<detail::Stage> stages;
  auto out = detail::plan_chain<On<Axis, To>>(x, stages);
  return Pending<redistributed_t<DV, Axis, To>>(std::move(out), std::move(stages));
}

/// Non-blocking redistribute over one axis into `out` (see redistribute).
template <Placement To, DistributedView DV, AxisTag Axis>
[[nodiscard]] Pending<redistributed_t<DV, Axis, To>> iredistribute(const DV& x, Axis,
                                                                   const redistributed_t<DV, Axis, To>& out) {
  static_assert(detail::check_step<DV, Axis, To>());
  detail::check_same_global(x, out);
  std::vector<detail::Stage> stages;
  stages.push_back(detail::plan_step<Axis, To>(x, out, x.template comm<Axis>()));
  return Pending<redistributed_t<DV, Axis, To>>(out, std::move(stages));
}

/// Non-blocking redistribute over several axes: each axis' collective starts
/// when the previous one completed (in test() or wait()).
template <OnPlacement... Steps, DistributedView DV>
  requires(sizeof...(Steps) >= 1)
[[nodiscard]] Pending<typename detail::chain_result<DV, Steps...>::type> iredistribute(const DV& x) {
  std::vector<detail::Stage> stages;
  auto out = detail::plan_chain<Steps...>(x, stages);
  return Pending<typename detail::chain_result<DV, Steps...>::type>(std::move(out), std::move(stages));
}

}  // namespace weft
