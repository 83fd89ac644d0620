// Attention over a sequence sharded over the CP axis: the run time of
// weft::Context<Ring>, Context<AllGather> and Context<AllToAll>.
//
// Every rank holds its tokens in the causally balanced layout of
// vocabulary/context_policy.hpp (chunks r and 2·cp−1−r of 2·cp) as rank-3
// views [heads, T / cp, head_dim] with a contiguous last dimension, the
// layout ops::flash_attention_* take. The blockwise kernel of
// ops/flash_attention.hpp is the local kernel of every variant:
//   Ring       per ring step, each local query chunk against each chunk of
//              the visiting K/V block that it sees (earlier chunks whole, its
//              own chunk under the causal mask, later chunks not at all);
//              partial outputs merge by log-sum-exp.
//   AllGather  the whole K/V in global order, each query chunk against the
//              keys up to its own end (one kernel call per chunk).
//   AllToAll   the whole sequence for heads / cp query heads (and their K/V
//              heads) in global order, one causal kernel call.
// Backward takes the final output and log-sum-exp, so every block's
// probabilities are recomputed exactly (exp(s − lse)); the gradients of a
// layout equal the unsharded ones up to the order of the sums.
#pragma once

#include <cstddef>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include <weft/comm/comm.hpp>
#include <weft/nn/sequence_attention.hpp>
#include <weft/core/error.hpp>
#include <weft/ops/flash_attention.hpp>
#include <weft/vocabulary/context_policy.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::context {

namespace detail {

template <class T, class Mem>
using V3 = Kokkos::View<T***, Kokkos::LayoutRight, Mem>;
template <class T, class Mem>
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
template <class T, class Mem>
using V5 = Kokkos::View<T*****, Kokkos::LayoutRight, Mem>;

inline std::pair<std::size_t, std::size_t> span(std::size_t begin, std::size_t n) { return {begin, begin + n}; }

/// Tokens [t0, t0 + n) of a [heads, T, hd] view.
template <class V>
auto tokens(const V& v, std::size_t t0, std::size_t n) {
  return Kokkos::subview(v, Kokkos::ALL, span(t0, n), Kokkos::ALL);
}
/// Tokens [t0, t0 + n) of a [heads, T] view.
template <class V>
auto rows(const V& v, std::size_t t0, std::size_t n) {
  return Kokkos::subview(v, Kokkos::ALL, span(t0, n));
}

/// Merges a partial attention result (Op, lp) over a subset of the keys into
/// the running one (O, l): l' = log(e^l + e^lp), O' = e^(l−l') O + e^(lp−l') Op.
/// l = −inf marks rows with no keys yet (they take the partial as it is).
template <class OV, class LV, class PV, class QV>
void merge(const OV& O, const LV& l, const PV& Op, const QV& lp) {
  using T = typename OV::non_const_value_type;
  const std::size_t H = O.extent(0), n = O.extent(1), hd = O.extent(2);
  const T ninf = -std::numeric_limits<T>::infinity();
  Kokkos::parallel_for(
      "weft::context::merge", ops::detail::range(O, H * n), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t h = item / n, t = item % n;
        const T a = l(h, t), b = lp(h, t);
        if (!(a > ninf)) {
          for (std::size_t d = 0; d < hd; ++d) O(h, t, d) = Op(h, t, d);
          l(h, t) = b;
          return;
        }
        const T m = a > b ? a : b, lo = a > b ? b : a;
        const T lnew = m + ops::math::log(T(1) + ops::math::exp(lo - m));
        const T wa = ops::math::exp(a - lnew), wb = ops::math::exp(b - lnew);
        for (std::size_t d = 0; d < hd; ++d) O(h, t, d) = wa * O(h, t, d) + wb * Op(h, t, d);
        l(h, t) = lnew;
      });
}

/// dst(part, h, t, d) = src_part(h, t, d) for a stack of rank-3 views,
/// rounded once to dst's element type when it is narrower (a 2-byte K/V
/// block of a mixed-precision model).
template <class DV, class SV>
void pack_into(const DV& dst, std::size_t part, const SV& src) {
  using DT = typename DV::non_const_value_type;
  const std::size_t H = src.extent(0), n = src.extent(1), hd = src.extent(2);
  Kokkos::parallel_for(
      "weft::context::pack", ops::detail::range(dst, H * n), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t h = item / n, t = item % n;
        for (std::size_t d = 0; d < hd; ++d) dst(part, h, t, d) = ops::detail::store<DT>(src(h, t, d));
      });
}

/// dst(h, t, d) (+)= src(part, h, t, d).
template <class DV, class SV>
void unpack_from(const DV& dst, const SV& src, std::size_t part, bool add) {
  const std::size_t H = dst.extent(0), n = dst.extent(1), hd = dst.extent(2);
  Kokkos::parallel_for(
      "weft::context::unpack", ops::detail::range(dst, H * n), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t h = item / n, t = item % n;
        for (std::size_t d = 0; d < hd; ++d) dst(h, t, d) = (add ? dst(h, t, d) : 0) + src(part, h, t, d);
      });
}

/// out = a + b, element by element (contiguous views of one shape).
template <class OV, class AV, class BV>
void add(const OV& out, const AV& a, const BV& b) {
  auto* o = out.data();
  const auto* x = a.data();
  const auto* y = b.data();
  Kokkos::parallel_for(
      "weft::context::add", ops::detail::range(out, out.size()), KOKKOS_LAMBDA(std::size_t i) { o[i] = x[i] + y[i]; });
}

/// dst(h, g, d) = gathered(s, part, h, t, d) with g the global index of rank
/// s's token t: K or V of every rank, in global token order.
template <class DV, class GV>
void to_global(const DV& dst, const GV& gathered, std::size_t part, std::size_t P, std::size_t seq) {
  const std::size_t hk = gathered.extent(2), tl = gathered.extent(3), hd = gathered.extent(4);
  Kokkos::parallel_for(
      "weft::context::to_global", ops::detail::range(dst, P * hk * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t s = item / (hk * tl), h = (item / tl) % hk, t = item % tl;
        const std::size_t g = global_index(t, seq, P, s);
        for (std::size_t d = 0; d < hd; ++d) dst(h, g, d) = gathered(s, part, h, t, d);
      });
}

/// The reverse of to_global: scattered(s, part, h, t, d) = src(h, g, d).
template <class SV, class GV>
void from_global(const SV& scattered, std::size_t part, const GV& src, std::size_t P, std::size_t seq) {
  const std::size_t hk = scattered.extent(2), tl = scattered.extent(3), hd = scattered.extent(4);
  Kokkos::parallel_for(
      "weft::context::from_global", ops::detail::range(src, P * hk * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t s = item / (hk * tl), h = (item / tl) % hk, t = item % tl;
        const std::size_t g = global_index(t, seq, P, s);
        for (std::size_t d = 0; d < hd; ++d) scattered(s, part, h, t, d) = src(h, g, d);
      });
}

/// The heads rank j works on under AllToAll: query heads from j·qpr, K/V
/// heads from j·qpr / group (the K/V head of its first query head).
KOKKOS_INLINE_FUNCTION std::size_t first_head(std::size_t j, std::size_t qpr, std::size_t group, bool kv) {
  return kv ? j * qpr / group : j * qpr;
}

/// send(j, i, t, d) = X(first_head(j) + i, t, d): block j goes to rank j
/// (rounded once to send's element type when it is narrower).
template <class SV, class XV>
void heads_pack(const SV& send, const XV& X, std::size_t qpr, std::size_t group, bool kv) {
  using ST = typename SV::non_const_value_type;
  const std::size_t P = send.extent(0), per = send.extent(1), tl = send.extent(2), hd = send.extent(3);
  Kokkos::parallel_for(
      "weft::context::a2a_pack", ops::detail::range(send, P * per * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t j = item / (per * tl), i = (item / tl) % per, t = item % tl;
        const std::size_t h = first_head(j, qpr, group, kv) + i;
        for (std::size_t d = 0; d < hd; ++d) send(j, i, t, d) = ops::detail::store<ST>(X(h, t, d));
      });
}

/// Xh(i, g, d) = recv(s, i, t, d), g the global index of rank s's token t.
template <class HV, class RV>
void heads_from_recv(const HV& Xh, const RV& recv, std::size_t seq) {
  const std::size_t P = recv.extent(0), per = recv.extent(1), tl = recv.extent(2), hd = recv.extent(3);
  Kokkos::parallel_for(
      "weft::context::a2a_unpack", ops::detail::range(Xh, P * per * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t s = item / (per * tl), i = (item / tl) % per, t = item % tl;
        const std::size_t g = global_index(t, seq, P, s);
        for (std::size_t d = 0; d < hd; ++d) Xh(i, g, d) = recv(s, i, t, d);
      });
}

/// The reverse of heads_from_recv: send(s, i, t, d) = Xh(i, g, d).
template <class SV, class HV>
void heads_to_send(const SV& send, const HV& Xh, std::size_t seq) {
  const std::size_t P = send.extent(0), per = send.extent(1), tl = send.extent(2), hd = send.extent(3);
  Kokkos::parallel_for(
      "weft::context::a2a_pack_back", ops::detail::range(send, P * per * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t s = item / (per * tl), i = (item / tl) % per, t = item % tl;
        const std::size_t g = global_index(t, seq, P, s);
        for (std::size_t d = 0; d < hd; ++d) send(s, i, t, d) = Xh(i, g, d);
      });
}

/// X(h, t, d) from the blocks recv(j, h − first_head(j), t, d) that hold head
/// h: query heads land once; K/V heads replicated over several ranks add up,
/// in rank order (one work item per head and token).
template <class XV, class RV>
void heads_gather(const XV& X, const RV& recv, std::size_t qpr, std::size_t group, bool kv) {
  using T = typename XV::non_const_value_type;
  const std::size_t P = recv.extent(0), per = recv.extent(1), tl = recv.extent(2), hd = recv.extent(3);
  const std::size_t heads = X.extent(0);
  Kokkos::parallel_for(
      "weft::context::a2a_gather", ops::detail::range(X, heads * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t h = item / tl, t = item % tl;
        for (std::size_t d = 0; d < hd; ++d) X(h, t, d) = T(0);
        for (std::size_t j = 0; j < P; ++j) {
          const std::size_t h0 = first_head(j, qpr, group, kv);
          if (h < h0 || h >= h0 + per) continue;
          for (std::size_t d = 0; d < hd; ++d) X(h, t, d) += recv(j, h - h0, t, d);
        }
      });
}

/// send(s, i, t, 0) = lh(i, g(t, s)) and, after the exchange,
/// lse(j·qpr + i, t) = recv(j, i, t, 0).
template <class SV, class LV>
void lse_pack(const SV& send, const LV& lh, std::size_t seq) {
  const std::size_t P = send.extent(0), per = send.extent(1), tl = send.extent(2);
  Kokkos::parallel_for(
      "weft::context::a2a_lse", ops::detail::range(send, P * per * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t s = item / (per * tl), i = (item / tl) % per, t = item % tl;
        send(s, i, t, 0) = lh(i, global_index(t, seq, P, s));
      });
}
template <class LV, class RV>
void lse_unpack(const LV& lse, const RV& recv) {
  const std::size_t P = recv.extent(0), per = recv.extent(1), tl = recv.extent(2);
  Kokkos::parallel_for(
      "weft::context::a2a_lse_back", ops::detail::range(lse, P * per * tl), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t j = item / (per * tl), i = (item / tl) % per, t = item % tl;
        lse(j * per + i, t) = recv(j, i, t, 0);
      });
}

/// Is key chunk kc visible from query chunk qc, and through the causal mask?
enum class Visibility { none, whole, diagonal };
constexpr Visibility visibility(std::size_t qc, std::size_t kc, bool causal) {
  if (!causal) return Visibility::whole;
  return kc < qc ? Visibility::whole : kc == qc ? Visibility::diagonal : Visibility::none;
}

}  // namespace detail

/// Attention over the CP axis with the variant's communication. One object
/// per attention layer: forward keeps handles to its inputs and outputs
/// (and, for AllToAll, their head-sharded copies), backward uses them.
///
///   Q, O:  [heads, T / cp, head_dim]      K, V: [kv_heads, T / cp, head_dim]
///   lse:   [heads, T / cp]                 (tokens in the balanced layout)
///
/// `seq` is the global sequence length T: a multiple of 2·cp (ConfigError
/// otherwise, naming the lengths that work). AllToAll also needs the heads
/// to shard over cp (ConfigError listing the cp sizes that work).
///
/// KVType is the element type K and V travel and are read in: T, or under a
/// mixed weft::Precision its 2-byte type (weft::bf16, weft::fp16; T must
/// then be float, their accumulation type). With a 2-byte KVType every rank
/// rounds its own K and V once (to nearest even) into its exchange buffers,
/// so every block of the sequence -- its own as well as the visiting ones --
/// is read in the same rounding, and the Ring's blocks, AllGather's gathered
/// K/V and AllToAll's K/V head shards carry half the bytes. Q, the output,
/// the log-sum-exp, the partial results and their merge, dO and the dK/dV
/// sums stay T ("fp32 merge"); the kernel accumulates in T.
template <class Variant, class T, class ExecSpace = Kokkos::DefaultExecutionSpace, class KVType = T>
class ContextAttention {
  static_assert(is_context_variant_v<Variant>,
                "weft::context::ContextAttention<Variant, T>: the variant must be weft::Ring, weft::AllGather or "
                "weft::AllToAll");
  static_assert(std::is_same_v<KVType, T> || ((std::is_same_v<KVType, bf16> || std::is_same_v<KVType, fp16>) &&
                                          std::is_same_v<T, float>),
                "weft::context::ContextAttention<Variant, T, ExecSpace, KVType>: KVType (the K/V blocks' element type) must "
                "be T, or weft::bf16 / weft::fp16 with T = float (their accumulation type)");

 public:
  using memory_space = typename ExecSpace::memory_space;  ///< where every view lives
  using kv_type = KVType;  ///< the element type K and V travel and are read in
  using Saved3 = Kokkos::View<const T***, Kokkos::LayoutStride, memory_space>;  ///< a saved [heads, tokens, hd] view
  using Saved2 = Kokkos::View<const T**, Kokkos::LayoutStride, memory_space>;   ///< a saved [heads, tokens] view

  /// Checks the sizes against the CP communicator `cp` (kept by reference).
  ContextAttention(Comm& cp, std::size_t heads, std::size_t kv_heads, std::size_t seq, std::size_t head_dim,
                   bool causal)
      : cp_(&cp), H_(heads), Hk_(kv_heads), T_(seq), hd_(head_dim), causal_(causal) {
    const std::size_t n = std::size_t(cp.size());
    check_sequence(seq, n);
    WEFT_REQUIRE(kv_heads > 0 && heads % kv_heads == 0, ConfigError, "weft::context::ContextAttention: ", heads,
                 " query heads are not a multiple of ", kv_heads, " K/V heads");
    if constexpr (std::is_same_v<Variant, AllToAll>) check_alltoall(heads, kv_heads, n);
  }

  /// Local tokens per rank: T / cp.
  std::size_t local_tokens() const noexcept { return T_ / std::size_t(cp_->size()); }

  /// O = softmax(scale Q K^T [causal]) V over the whole sequence, for this
  /// rank's queries; lse = each row's log-sum-exp (what backward needs).
  template <class QV, class KV, class VV, class OV, class LV>
  void forward(const QV& Q, const KV& K, const VV& V, T scale, const OV& O, const LV& lse) {
    check("forward", Q, K, V, O);
    ops::detail::require_extent("weft::context::ContextAttention::forward", "lse", lse, 0, H_);
    ops::detail::require_extent("weft::context::ContextAttention::forward", "lse", lse, 1, local_tokens());
    scale_ = scale;
    if constexpr (std::is_same_v<Variant, Ring>) ring_forward(Q, K, V, O, lse);
    else if constexpr (std::is_same_v<Variant, AllGather>) allgather_forward(Q, K, V, O, lse);
    else alltoall_forward(Q, K, V, O, lse);
    if constexpr (!std::is_same_v<Variant, AllToAll>) {
      q_ = Q;
      k_ = K;
      v_ = V;
      o_ = O;
      lse_ = lse;
    }
    have_forward_ = true;
  }

  /// dQ, dK, dV (overwritten) of sum(dO * O) for the last forward's inputs.
  template <class GV, class DQV, class DKV, class DVV>
  void backward(const GV& dO, const DQV& dQ, const DKV& dK, const DVV& dV) {
    WEFT_REQUIRE(have_forward_, ConfigError, "weft::context::ContextAttention::backward: no forward to go back through");
    check("backward", dO, dK, dV, dQ);
    if constexpr (std::is_same_v<Variant, Ring>) ring_backward(dO, dQ, dK, dV);
    else if constexpr (std::is_same_v<Variant, AllGather>) allgather_backward(dO, dQ, dK, dV);
    else alltoall_backward(dO, dQ, dK, dV);
  }

  /// Bytes of what the last forward keeps for backward: the inputs, output
  /// and log-sum-exp it was given (Ring, AllGather), the gathered K/V in
  /// global order (AllGather), or the head-sharded copies over the whole
  /// sequence (AllToAll, which needs nothing of the caller's afterwards).
  std::size_t saved_bytes() const {
    auto b = [](const auto& v) { return bytes_of(v); };
    return b(q_) + b(k_) + b(v_) + b(o_) + b(lse_) + b(kg_) + b(vg_) + b(qh_) + b(kh_) + b(vh_) + b(oh_) + b(lh_);
  }

  /// Bytes of what the last forward keeps in buffers of its own (the views
  /// it was given are the caller's): AllGather's gathered K/V, AllToAll's
  /// head-sharded copies; none for Ring.
  std::size_t owned_bytes() const {
    auto b = [](const auto& v) { return bytes_of(v); };
    return b(kg_) + b(vg_) + b(qh_) + b(kh_) + b(vh_) + b(oh_) + b(lh_);
  }

  /// The most bytes of exchange and scratch buffers held at once during one
  /// forward or backward so far (they are freed when it returns): the
  /// planner's context_buffer_bytes predicts it.
  std::size_t peak_buffer_bytes() const { return peak_buffers_; }

  /// Drops what forward kept.
  void release() {
    q_ = {};
    k_ = {};
    v_ = {};
    o_ = {};
    lse_ = {};
    kg_ = {};
    vg_ = {};
    qh_ = {};
    kh_ = {};
    vh_ = {};
    oh_ = {};
    lh_ = {};
    have_forward_ = false;
  }

 private:
  using B3 = detail::V3<T, memory_space>;
  using B4 = detail::V4<T, memory_space>;
  using B5 = detail::V5<T, memory_space>;
  using L2 = Kokkos::View<T**, Kokkos::LayoutRight, memory_space>;
  using K3 = detail::V3<KVType, memory_space>;  // K/V blocks in their travelling type
  using K4 = detail::V4<KVType, memory_space>;
  using K5 = detail::V5<KVType, memory_space>;

  // Bytes of v's elements (size, not span: the saved Q, K, V and O are
  // strided views into the caller's matrices, whose other columns are not
  // this layer's; nn::detail::bytes_of counts the span).
  template <class V>
  static std::size_t bytes_of(const V& v) {
    return std::size_t(v.size()) * sizeof(typename V::value_type);
  }

  std::size_t cpn() const { return std::size_t(cp_->size()); }
  std::size_t rank() const { return std::size_t(cp_->rank()); }
  std::size_t chunk() const { return chunk_tokens(T_, cpn()); }

  template <class A, class B, class C, class D>
  void check(const char* what, const A& q, const B& k, const C& v, const D& o) const {
    // A literal, not a concatenated std::string: g++ 12 at -O2 reports a false
    // array-bounds overflow in the concatenation once this is inlined deep
    // into a user's layer (a -Werror build of such a layer then fails).
    const char* op = std::string_view(what) == "forward" ? "weft::context::ContextAttention::forward"
                                                         : "weft::context::ContextAttention::backward";
    const std::size_t tl = local_tokens();
    auto shape = [&](const char* arg, const auto& x, std::size_t h) {
      ops::detail::require_extent(op, arg, x, 0, h);
      ops::detail::require_extent(op, arg, x, 1, tl);
      ops::detail::require_extent(op, arg, x, 2, hd_);
    };
    shape("1st", q, H_);
    shape("2nd", k, Hk_);
    shape("3rd", v, Hk_);
    shape("4th", o, H_);
  }

  // ------------------------------------------------------------------ Ring
  template <class QV, class KV, class VV, class OV, class LV>
  void ring_forward(const QV& Q, const KV& K, const VV& V, const OV& O, const LV& lse) {
    const std::size_t P = cpn(), r = rank(), C = chunk(), tl = local_tokens();
    K4 cur(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.kv"), 2, Hk_, tl, hd_);
    K4 next(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.kv_next"), 2, Hk_, tl, hd_);
    detail::pack_into(cur, 0, K);
    detail::pack_into(cur, 1, V);
    Kokkos::deep_copy(lse, -std::numeric_limits<T>::infinity());
    const std::size_t qn = causal_ ? C : tl;  // queries per kernel call
    B3 op(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.o_part"), H_, qn, hd_);
    L2 lp(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.lse_part"), H_, qn);
    note_buffers(cur, next, op, lp);
    const int to = int((r + 1) % P), from = int((r + P - 1) % P);
    for (std::size_t s = 0; s < P; ++s) {
      const std::size_t src = (r + P - s) % P;
      Request rq, sq;
      if (s + 1 < P) {
        rq = cp_->irecv(next, from, 1);
        sq = cp_->isend(cur, to, 1);
      }
      auto Kb = Kokkos::subview(cur, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
      auto Vb = Kokkos::subview(cur, 1, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
      if (!causal_) {
        ops::flash_attention_forward(Q, Kb, Vb, scale_, false, op, lp);
        detail::merge(O, lse, op, lp);
      } else {
        for (std::size_t a = 0; a < 2; ++a)
          for (std::size_t b = 0; b < 2; ++b) {
            const auto vis = detail::visibility(chunk_of(r, a, P), chunk_of(src, b, P), true);
            if (vis == detail::Visibility::none) continue;
            ops::flash_attention_forward(detail::tokens(Q, a * C, C), detail::tokens(Kb, b * C, C),
                                         detail::tokens(Vb, b * C, C), scale_, vis == detail::Visibility::diagonal,
                                         op, lp);
            detail::merge(detail::tokens(O, a * C, C), detail::rows(lse, a * C, C), op, lp);
          }
      }
      if (s + 1 < P) {
        rq.wait();
        sq.wait();
        std::swap(cur, next);
      }
    }
  }

  template <class GV, class DQV, class DKV, class DVV>
  void ring_backward(const GV& dO, const DQV& dQ, const DKV& dK, const DVV& dV) {
    const std::size_t P = cpn(), r = rank(), C = chunk(), tl = local_tokens();
    // K/V travel ahead of the compute; each block's dK/dV (the sum over the
    // ranks it has visited) travels one step behind it and reaches the
    // block's owner after cp hops.
    K4 cur(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.kv"), 2, Hk_, tl, hd_);
    K4 next(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.kv_next"), 2, Hk_, tl, hd_);
    B4 part("weft::context.dkv_part", 2, Hk_, tl, hd_);
    B4 acc_in(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.dkv_in"), 2, Hk_, tl, hd_);
    B4 acc_out(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.dkv_out"), 2, Hk_, tl, hd_);
    note_buffers(cur, next, part, acc_in, acc_out);
    detail::pack_into(cur, 0, k_);
    detail::pack_into(cur, 1, v_);
    Kokkos::deep_copy(dQ, T(0));
    const int to = int((r + 1) % P), from = int((r + P - 1) % P);
    Request send_acc;
    for (std::size_t s = 0; s < P; ++s) {
      const std::size_t src = (r + P - s) % P;
      Request rq, sq, racc;
      if (s + 1 < P) {
        rq = cp_->irecv(next, from, 1);
        sq = cp_->isend(cur, to, 1);
      }
      if (s > 0) racc = cp_->irecv(acc_in, from, 2);
      Kokkos::deep_copy(part, T(0));
      auto Kb = Kokkos::subview(cur, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
      auto Vb = Kokkos::subview(cur, 1, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
      auto dKb = Kokkos::subview(part, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
      auto dVb = Kokkos::subview(part, 1, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
      if (!causal_) {
        ops::flash_attention_backward(q_, Kb, Vb, o_, dO, lse_, scale_, false, dQ, dKb, dVb);
      } else {
        for (std::size_t a = 0; a < 2; ++a)
          for (std::size_t b = 0; b < 2; ++b) {
            const auto vis = detail::visibility(chunk_of(r, a, P), chunk_of(src, b, P), true);
            if (vis == detail::Visibility::none) continue;
            ops::flash_attention_backward(detail::tokens(q_, a * C, C), detail::tokens(Kb, b * C, C),
                                          detail::tokens(Vb, b * C, C), detail::tokens(o_, a * C, C),
                                          detail::tokens(dO, a * C, C), detail::rows(lse_, a * C, C), scale_,
                                          vis == detail::Visibility::diagonal, detail::tokens(dQ, a * C, C),
                                          detail::tokens(dKb, b * C, C), detail::tokens(dVb, b * C, C));
          }
      }
      // The previous step's send of acc_out must be done before it is rewritten.
      send_acc.wait();
      if (s > 0) {
        racc.wait();
        detail::add(acc_out, acc_in, part);
      } else {
        std::swap(acc_out, part);  // the first block's sum is its own part: no copy
      }
      send_acc = cp_->isend(acc_out, to, 2);
      if (s + 1 < P) {
        rq.wait();
        sq.wait();
        std::swap(cur, next);
      }
    }
    // The last hop: our own block's dK/dV, summed over every rank.
    auto fin = cp_->irecv(acc_in, from, 2);
    fin.wait();
    send_acc.wait();
    detail::unpack_from(dK, acc_in, 0, false);
    detail::unpack_from(dV, acc_in, 1, false);
  }

  // ------------------------------------------------------------- AllGather
  // The gathered K/V [cp, 2, kv_heads, T / cp, hd] hold rank s's tokens in
  // block s; detail::to_global reorders them into [kv_heads, T, hd].
  template <class QV, class KV, class VV, class OV, class LV>
  void allgather_forward(const QV& Q, const KV& K, const VV& V, const OV& O, const LV& lse) {
    gather_kv(K, V);
    local_against_global(Q, O, lse);
  }

  template <class KV, class VV>
  void gather_kv(const KV& K, const VV& V) {
    const std::size_t P = cpn(), tl = local_tokens();
    K4 mine(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.kv"), 2, Hk_, tl, hd_);
    detail::pack_into(mine, 0, K);
    detail::pack_into(mine, 1, V);
    K5 all(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.kv_all"), P, 2, Hk_, tl, hd_);
    note_buffers(mine, all);
    cp_->all_gather(mine, all);
    kg_ = K3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.k_global"), Hk_, T_, hd_);
    vg_ = K3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.v_global"), Hk_, T_, hd_);
    detail::to_global(kg_, all, 0, P, T_);
    detail::to_global(vg_, all, 1, P, T_);
  }

  template <class QV, class OV, class LV>
  void local_against_global(const QV& Q, const OV& O, const LV& lse) {
    const std::size_t P = cpn(), r = rank(), C = chunk();
    if (!causal_) {
      ops::flash_attention_forward(Q, kg_, vg_, scale_, false, O, lse);
      return;
    }
    for (std::size_t a = 0; a < 2; ++a) {
      const std::size_t keys = (chunk_of(r, a, P) + 1) * C;  // up to the chunk's end; the mask shifts by its start
      ops::flash_attention_forward(detail::tokens(Q, a * C, C), detail::tokens(kg_, 0, keys),
                                   detail::tokens(vg_, 0, keys), scale_, true, detail::tokens(O, a * C, C),
                                   detail::rows(lse, a * C, C));
    }
  }

  template <class GV, class DQV, class DKV, class DVV>
  void allgather_backward(const GV& dO, const DQV& dQ, const DKV& dK, const DVV& dV) {
    const std::size_t P = cpn(), r = rank(), C = chunk(), tl = local_tokens();
    B3 dkg("weft::context.dk_global", Hk_, T_, hd_), dvg("weft::context.dv_global", Hk_, T_, hd_);
    Kokkos::deep_copy(dQ, T(0));
    if (!causal_) {
      ops::flash_attention_backward(q_, kg_, vg_, o_, dO, lse_, scale_, false, dQ, dkg, dvg);
    } else {
      for (std::size_t a = 0; a < 2; ++a) {
        const std::size_t keys = (chunk_of(r, a, P) + 1) * C;
        ops::flash_attention_backward(detail::tokens(q_, a * C, C), detail::tokens(kg_, 0, keys),
                                      detail::tokens(vg_, 0, keys), detail::tokens(o_, a * C, C),
                                      detail::tokens(dO, a * C, C), detail::rows(lse_, a * C, C), scale_, true,
                                      detail::tokens(dQ, a * C, C), detail::tokens(dkg, 0, keys),
                                      detail::tokens(dvg, 0, keys));
      }
    }
    B5 scattered(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.dkv_all"), P, 2, Hk_, tl, hd_);
    detail::from_global(scattered, 0, dkg, P, T_);
    detail::from_global(scattered, 1, dvg, P, T_);
    B4 mine(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.dkv"), 2, Hk_, tl, hd_);
    note_buffers(dkg, dvg, scattered, mine);
    cp_->reduce_scatter(scattered, mine);
    detail::unpack_from(dK, mine, 0, false);
    detail::unpack_from(dV, mine, 1, false);
  }

  // -------------------------------------------------------------- AllToAll
  // Rank j computes query heads [j·H/cp, (j+1)·H/cp) and the K/V heads they
  // read: [kv0(j), kv0(j) + hkl) with hkl = max(Hk / cp, 1) (replicated when
  // K/V heads are fewer than cp).
  std::size_t q_per_rank() const { return H_ / cpn(); }
  std::size_t kv_per_rank() const { return Hk_ >= cpn() ? Hk_ / cpn() : 1; }

  // X's heads for this rank over the whole sequence, travelling and kept in E
  // (T, or KVType for the K/V heads).
  template <class E, class XV>
  detail::V3<E, memory_space> scatter_heads(const XV& X, std::size_t per_rank, bool kv, const char* label) {
    const std::size_t P = cpn(), tl = local_tokens();
    detail::V4<E, memory_space> send(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.a2a_send"), P,
                                     per_rank, tl, hd_);
    detail::V4<E, memory_space> recv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.a2a_recv"), P,
                                     per_rank, tl, hd_);
    detail::heads_pack(send, X, q_per_rank(), H_ / Hk_, kv);
    cp_->all_to_all(send, recv);
    detail::V3<E, memory_space> Xh(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), per_rank, T_,
                                   hd_);
    detail::heads_from_recv(Xh, recv, T_);
    return Xh;
  }

  // Back from head shards to this rank's tokens: for query heads each head
  // lands once; K/V heads replicated over several ranks add up.
  template <class HV, class XV>
  void gather_heads(const HV& Xh, std::size_t per_rank, bool kv, const XV& X) {
    const std::size_t P = cpn(), tl = local_tokens();
    B4 send(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.a2a_send"), P, per_rank, tl, hd_);
    B4 recv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.a2a_recv"), P, per_rank, tl, hd_);
    detail::heads_to_send(send, Xh, T_);
    note_buffers(send, recv);
    cp_->all_to_all(send, recv);
    detail::heads_gather(X, recv, q_per_rank(), H_ / Hk_, kv);
  }

  template <class QV, class KV, class VV, class OV, class LV>
  void alltoall_forward(const QV& Q, const KV& K, const VV& V, const OV& O, const LV& lse) {
    const std::size_t qpr = q_per_rank(), kpr = kv_per_rank();
    qh_ = scatter_heads<T>(Q, qpr, false, "weft::context.q_heads");
    kh_ = scatter_heads<KVType>(K, kpr, true, "weft::context.k_heads");
    vh_ = scatter_heads<KVType>(V, kpr, true, "weft::context.v_heads");
    oh_ = B3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.o_heads"), qpr, T_, hd_);
    lh_ = L2(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.lse_heads"), qpr, T_);
    ops::flash_attention_forward(qh_, kh_, vh_, scale_, causal_, oh_, lh_);
    gather_heads(oh_, qpr, false, O);
    // lse back to this rank's tokens, through the same exchange (as one head-dim column).
    const std::size_t P = cpn(), tl = local_tokens();
    B4 send(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.a2a_send"), P, qpr, tl, 1);
    B4 recv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::context.a2a_recv"), P, qpr, tl, 1);
    detail::lse_pack(send, lh_, T_);
    note_buffers(send, recv);
    cp_->all_to_all(send, recv);
    detail::lse_unpack(lse, recv);
  }

  template <class GV, class DQV, class DKV, class DVV>
  void alltoall_backward(const GV& dO, const DQV& dQ, const DKV& dK, const DVV& dV) {
    const std::size_t qpr = q_per_rank(), kpr = kv_per_rank();
    B3 doh = scatter_heads<T>(dO, qpr, false, "weft::context.do_heads");
    B3 dqh("weft::context.dq_heads", qpr, T_, hd_), dkh("weft::context.dk_heads", kpr, T_, hd_),
        dvh("weft::context.dv_heads", kpr, T_, hd_);
    ops::flash_attention_backward(qh_, kh_, vh_, oh_, doh, lh_, scale_, causal_, dqh, dkh, dvh);
    live_ = bytes_of(doh) + bytes_of(dqh) + bytes_of(dkh) + bytes_of(dvh);  // beside each exchange below
    gather_heads(dqh, qpr, false, dQ);
    gather_heads(dkh, kpr, true, dK);
    gather_heads(dvh, kpr, true, dV);
    live_ = 0;
  }

  Comm* cp_;
  std::size_t H_, Hk_, T_, hd_;
  bool causal_;
  T scale_ = T(1);
  bool have_forward_ = false;
  Saved3 q_, k_, v_, o_;
  Saved2 lse_;
  K3 kg_, vg_;                // AllGather: K and V in global order
  B3 qh_, oh_;                // AllToAll: head shards over the whole sequence
  K3 kh_, vh_;
  L2 lh_;
  std::size_t peak_buffers_ = 0;  // bytes; see peak_buffer_bytes
  std::size_t live_ = 0;          // bytes of the caller's scratch alive beside AllToAll's exchanges

  // Notes the buffers alive together at one point of forward or backward.
  template <class... Vs>
  void note_buffers(const Vs&... v) {
    peak_buffers_ = std::max(peak_buffers_, (bytes_of(v) + ... + live_));
  }
};

namespace detail {
// nn::SequenceAttention (what nn::Attention calls) over a ContextAttention of the variant.
template <class Variant, class T, class Space, class KV = T>
class SequenceAttentionOf final : public nn::SequenceAttention<T, Space> {
 public:
  using typename nn::SequenceAttention<T, Space>::View3;
  using typename nn::SequenceAttention<T, Space>::View2;
  SequenceAttentionOf(Comm& cp, std::size_t heads, std::size_t kv_heads, std::size_t seq, std::size_t head_dim)
      : a_(cp, heads, kv_heads, seq, head_dim, true) {}
  void forward(const View3& q, const View3& k, const View3& v, T scale, const View3& o, const View2& lse) override {
    a_.forward(q, k, v, scale, o, lse);
  }
  void backward(const View3& dO, const View3& dq, const View3& dk, const View3& dv) override {
    a_.backward(dO, dq, dk, dv);
  }
  std::size_t owned_bytes() const override { return a_.owned_bytes(); }
  std::size_t peak_buffer_bytes() const override { return a_.peak_buffer_bytes(); }

 private:
  ContextAttention<Variant, T, typename Space::execution_space, KV> a_;
};
}  // namespace detail

/// The context parallelism of a model under the CP policy `Policy`
/// (weft::Context<Ring | AllGather | AllToAll>) over the CP communicator:
/// what nn::GPT's constructor takes. The variant stays a type: each
/// attention layer runs ContextAttention<Policy::variant, T, Space, KV> with
/// KV = nn::context_kv_t<T, Prec>: T under Precision<> (the default), the
/// 2-byte type of a mixed Prec (bf16 or fp16 K/V blocks). A model checks at
/// construction that the ContextParallel was made for its own precision
/// (ContextParallel::kv_type): give a Precision<BF16> model
/// attention_of<Policy, float, Space, Precision<BF16>>, or use
/// attention_of<S, T>(mesh), which takes both from the strategy.
///
///   weft::nn::GPT<float, S> gpt(mesh, cfg, weft::context::attention_of<weft::Context<weft::Ring>, float>(mesh.axis<weft::CP>()));
template <class Policy, class T, class Space = Kokkos::DefaultExecutionSpace, class Prec = Precision<>>
nn::ContextParallel<T, Space> attention_of(Comm& cp) {
  static_assert(is_context_policy_v<Policy>,
                "weft::context::attention_of<Policy, T>: Policy must be weft::Context<weft::Ring>, "
                "weft::Context<weft::AllGather> or weft::Context<weft::AllToAll> (a strategy's context_parallel)");
  static_assert(is_precision_v<Prec>,
                "weft::context::attention_of<Policy, T, Space, Prec>: Prec must be a weft::Precision<...> (the "
                "model's precision)");
  static_assert(!Prec::mixed || std::is_same_v<T, float>,
                "weft::context::attention_of<Policy, T, Space, Prec>: a mixed precision (2-byte K/V blocks) computes "
                "in float; T must be float");
  using V = typename Policy::variant;
  using KV = nn::context_kv_t<T, Prec>;
  nn::ContextParallel<T, Space> out;
  out.comm = &cp;
  out.policy = Policy::policy_name();
  out.kv_type = mpi_datatype<KV>::name;
  out.make = [&cp](std::size_t heads, std::size_t kv_heads, std::size_t seq, std::size_t head_dim) {
    return std::unique_ptr<nn::SequenceAttention<T, Space>>(
        std::make_unique<detail::SequenceAttentionOf<V, T, Space, KV>>(cp, heads, kv_heads, seq, head_dim));
  };
  return out;
}

/// The context parallelism that a strategy S gives a model on `mesh`: S's CP
/// policy (S::context_parallel) over mesh.axis<weft::CP>() in S's precision,
/// as attention_of<S::context_parallel, T, Space, S::precision>(mesh.axis<CP>())
/// gives it,
/// after the checks of the strategy against the mesh: at compile time
/// weft::check_strategy_mesh<S, MeshT> (every policy's axis is in the mesh)
/// and that S has a Context<...> entry; at run time
/// weft::validate_strategy<S>(mesh) (an axis S gives no policy must have
/// extent 1; sequence parallelism needs tp > 1; ...), ConfigError before
/// anything is built.
///
///   weft::nn::GPT<float, S> gpt(mesh, cfg, weft::context::attention_of<S, float>(mesh));
template <StrategyType S, class T, class Space = Kokkos::DefaultExecutionSpace, class MeshT>
  requires(!std::is_base_of_v<Comm, MeshT>)
nn::ContextParallel<T, Space> attention_of(MeshT& mesh) {
  static_assert(check_strategy_mesh<S, MeshT>());
  static_assert(S::template has<CP>,
                "weft::context::attention_of<S, T>(mesh): the strategy S has no Context<...> policy on the CP axis, so "
                "there is no context parallelism to give the model; add On<CP, Context<Ring>> (or AllGather, "
                "AllToAll) to S, or build the model without a ContextParallel");
  if constexpr (S::template has<CP>) {
    validate_strategy<S>(mesh);
    return attention_of<typename S::context_parallel, T, Space, typename S::precision>(mesh.template axis<CP>());
  } else {
    return {};
  }
}

}  // namespace weft::context
