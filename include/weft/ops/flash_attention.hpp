// Blockwise ("flash") attention: softmax(scale Q K^T [+ causal mask]) V
// without materialising the [Tq, Tk] scores. Queries are processed in blocks
// of `query_block` rows against keys in blocks of `key_block`, with an online
// softmax: a running maximum and sum per query row, the partial output
// rescaled whenever the maximum grows. The forward pass keeps only each
// row's log-sum-exp; the backward pass recomputes every block's
// probabilities from it.
//
// Views are rank 3, [heads, T, head_dim], of any layout whose last dimension
// is contiguous: a batch's heads inside a fused QKV matrix are a LayoutStride
// view over it (see nn::Attention), so nothing is copied. Grouped-query
// attention: Q has H heads and K, V have H / group; query head h reads
// key/value head h / group. With `causal`, query i sees keys
// j <= i + (Tk - Tq), so the last Tq queries of a sequence against all its
// Tk keys mask correctly (a context-parallel block of keys passes its own
// offset through Tk - Tq by its slicing, or none with causal = false).
//
// Accumulation: scores, the running sums and the output rows are kept in the
// compute type T = detail::compute_t of the views (float in training and for
// bf16/fp16 views, double in the gradient tests); every reduction uses
// lane-wise partial sums so that it vectorises. Mixed precision: Q, K, V, O
// and the gradients may be bf16 or fp16 views and lse a float view; K and V
// are widened to T once (into the transposed scratch the kernels read
// anyway), O is rounded once per element, and 2-byte dK and dV are
// accumulated in T scratch and rounded once per call (see
// flash_attention_backward), so no partial sum is ever rounded to 2 bytes.
#pragma once

#include <algorithm>
#include <string>

#include <weft/ops/common.hpp>

namespace weft::ops {

namespace detail {
inline constexpr std::size_t flash_query_block = 4;   // query rows sharing each key/value row load
inline constexpr std::size_t flash_key_block = 64;    // keys per block: four AVX-512 registers of scores
inline constexpr std::size_t flash_max_head_dim = 256;

template <class V>
void flash_check(const char* op, const char* arg, const V& v, std::size_t heads, std::size_t t, std::size_t hd) {
  static_assert(V::rank == 3, "weft::ops flash attention takes rank-3 views [heads, T, head_dim]");
  require_extent(op, arg, v, 0, heads);
  require_extent(op, arg, v, 1, t);
  require_extent(op, arg, v, 2, hd);
  require_contiguous_rows(op, arg, v, 2);
}

/// Kt(h, d, j) = K(h, j, d), with the keys padded with zeros to a multiple of
/// flash_key_block: the score loops then run over whole key blocks.
template <class T, class KV, class SV>
void flash_transpose(const KV& K, const SV& Kt) {
  const std::size_t hd = K.extent(2), tk = K.extent(1), tkp = Kt.extent(2);
  Kokkos::parallel_for(
      "weft::flash_transpose", range(Kt, K.extent(0)), KOKKOS_LAMBDA(std::size_t h) {
        for (std::size_t j = 0; j < tkp; ++j)
          for (std::size_t d = 0; d < hd; ++d) Kt(h, d, j) = j < tk ? T(K(h, j, d)) : T(0);
      });
}

/// s[j] = scale * sum_d q[d] kt[d * ld + j] for one key block (fixed width:
/// the compiler keeps the block's scores in vector registers); q may be a
/// row of a narrower type, read as T.
template <class T, class QT>
KOKKOS_INLINE_FUNCTION void flash_scores(const QT* q, const T* kt, std::size_t ld, std::size_t hd, T scale, T* s) {
  constexpr std::size_t BC = flash_key_block;
  T acc[BC] = {};
  for (std::size_t d = 0; d < hd; ++d) {
    const T qd = load<T>(q[d]);
    const T* k = kt + d * ld;
    for (std::size_t j = 0; j < BC; ++j) acc[j] += qd * k[j];
  }
  for (std::size_t j = 0; j < BC; ++j) s[j] = scale * acc[j];
}

/// y += a0 x0 + a1 x1 + a2 x2 + a3 x3 over n elements (x read as T).
template <class T, class X>
KOKKOS_INLINE_FUNCTION void flash_axpy4(T* __restrict y, std::size_t n, T a0, const X* __restrict x0, T a1,
                                        const X* __restrict x1, T a2, const X* __restrict x2, T a3,
                                        const X* __restrict x3) {
  for (std::size_t d = 0; d < n; ++d)
    y[d] += a0 * load<T>(x0[d]) + a1 * load<T>(x1[d]) + a2 * load<T>(x2[d]) + a3 * load<T>(x3[d]);
}

/// y += a x over n elements (x read as T).
template <class T, class X>
KOKKOS_INLINE_FUNCTION void flash_axpy(T* __restrict y, std::size_t n, T a, const X* __restrict x) {
  for (std::size_t d = 0; d < n; ++d) y[d] += a * load<T>(x[d]);
}

/// The view a kernel computing in T accumulates a rank-3 gradient G into:
/// G itself when it holds T, else a LayoutRight scratch of T holding G's
/// values (widened, exactly); accumulator_finish rounds it back into G once.
// (A function of its own, with its return type spelled: nvcc's extended
// lambdas may not sit in a function whose return type is deduced.)
template <class T, class G>
Kokkos::View<T***, Kokkos::LayoutRight, typename G::memory_space> widened_copy(const G& g, const char* label) {
  Kokkos::View<T***, Kokkos::LayoutRight, typename G::memory_space> a(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), g.extent(0), g.extent(1), g.extent(2));
  const std::size_t n1 = g.extent(1), n2 = g.extent(2);
  Kokkos::parallel_for(
      "weft::flash_attention.widen", range(g, g.extent(0) * n1), KOKKOS_LAMBDA(std::size_t r) {
        for (std::size_t d = 0; d < n2; ++d) a(r / n1, r % n1, d) = load<T>(g(r / n1, r % n1, d));
      });
  return a;
}
template <class T, class G>
auto accumulator_for(const G& g, const char* label) {
  if constexpr (stores_exactly_v<value_t<G>, T>) {
    return g;
  } else {
    return widened_copy<T>(g, label);
  }
}
/// g = a rounded to g's element type, when accumulator_for gave a scratch.
template <class G, class A>
void accumulator_finish(const G& g, const A& a) {
  if constexpr (!std::is_same_v<G, A>) {
    using GT = value_t<G>;
    const std::size_t n1 = g.extent(1), n2 = g.extent(2);
    Kokkos::parallel_for(
        "weft::flash_attention.round", range(g, g.extent(0) * n1), KOKKOS_LAMBDA(std::size_t r) {
          for (std::size_t d = 0; d < n2; ++d) g(r / n1, r % n1, d) = store<GT>(a(r / n1, r % n1, d));
        });
  }
}
}  // namespace detail

/// O = softmax(scale Q K^T, causal) V and lse(h, i) = log sum_j exp(scale q_i . k_j)
/// over the keys row i sees. Q, O: [H, Tq, hd]; K, V: [H / group, Tk, hd];
/// lse: [H, Tq]. O is overwritten. head_dim <= 256. Computed in
/// compute_t<QV, KV, VV, OV> (float for 2-byte views); O rounded once, lse
/// stored as its element type (keep it float).
template <class QV, class KV, class VV, class OV, class LV>
void flash_attention_forward(const QV& Q, const KV& K, const VV& V, detail::compute_t<QV, KV, VV, OV> scale,
                             bool causal, const OV& O, const LV& lse) {
  using T = detail::compute_t<QV, KV, VV, OV>;
  using OT = detail::value_t<OV>;
  using LT = detail::value_t<LV>;
  constexpr const char* op = "weft::ops::flash_attention_forward";
  const std::size_t H = Q.extent(0), tq = Q.extent(1), hd = Q.extent(2), hk = K.extent(0), tk = K.extent(1);
  WEFT_REQUIRE(hk > 0 && H % hk == 0, ShapeError, op, ": ", H, " query heads are not a multiple of ", hk,
               " key/value heads");
  WEFT_REQUIRE(hd <= detail::flash_max_head_dim, ShapeError, op, ": head_dim ", hd, " exceeds ",
               detail::flash_max_head_dim);
  WEFT_REQUIRE(!causal || tk >= tq, ShapeError, op, ": causal attention needs at least as many keys (", tk,
               ") as queries (", tq, ")");
  detail::flash_check(op, "Q", Q, H, tq, hd);
  detail::flash_check(op, "K", K, hk, tk, hd);
  detail::flash_check(op, "V", V, hk, tk, hd);
  detail::flash_check(op, "O", O, H, tq, hd);
  detail::require_extent(op, "lse", lse, 0, H);
  detail::require_extent(op, "lse", lse, 1, tq);
  if (H == 0 || tq == 0) return;
  WEFT_REQUIRE(tk > 0, ShapeError, op, ": no keys");
  constexpr std::size_t BR = detail::flash_query_block, BC = detail::flash_key_block;
  const std::size_t tkp = (tk + BC - 1) / BC * BC, group = H / hk, shift = tk - tq;
  Kokkos::View<T***, Kokkos::LayoutRight, typename OV::memory_space> Kt(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::flash_attention.kt"), hk, hd, tkp);
  detail::flash_transpose<T>(K, Kt);
  const std::size_t nqb = (tq + BR - 1) / BR;
  Kokkos::parallel_for(
      op, detail::range(O, H * nqb), KOKKOS_LAMBDA(std::size_t item) {
        const std::size_t h = item / nqb, i0 = (item % nqb) * BR, kh = h / group;
        const std::size_t rows = tq - i0 < BR ? tq - i0 : BR;
        T o[BR][detail::flash_max_head_dim];
        T m[BR], l[BR], p[BR][BC];
        std::size_t lim[BR];
        for (std::size_t r = 0; r < BR; ++r) {
          m[r] = 0;
          l[r] = 0;
          lim[r] = r < rows ? (causal ? i0 + r + shift + 1 : tk) : 0;
          for (std::size_t d = 0; d < hd; ++d) o[r][d] = 0;
        }
        const std::size_t nmax = lim[rows - 1];
        const T* kt = &Kt(kh, 0, 0);
        for (std::size_t jb = 0; jb < nmax; jb += BC) {
          const std::size_t w = nmax - jb < BC ? nmax - jb : BC;
          for (std::size_t r = 0; r < rows; ++r) {
            const std::size_t wr = lim[r] > jb ? (lim[r] - jb < BC ? lim[r] - jb : BC) : 0;
            T s[BC];
            detail::flash_scores(&Q(h, i0 + r, 0), kt + jb, tkp, hd, T(scale), s);
            if (wr == 0) {
              for (std::size_t j = 0; j < BC; ++j) p[r][j] = 0;
              continue;
            }
            const T bm = detail::lane_max<T>(wr, [&](std::size_t j) { return s[j]; });
            const T mnew = l[r] == 0 || bm > m[r] ? bm : m[r];
            const T alpha = l[r] == 0 ? T(0) : math::fast_exp(m[r] - mnew);
            const T sum = detail::lane_sum<T>(wr, [&](std::size_t j) {
              const T e = math::fast_exp(s[j] - mnew);
              p[r][j] = e;
              return e;
            });
            for (std::size_t j = wr; j < BC; ++j) p[r][j] = 0;
            l[r] = l[r] * alpha + sum;
            m[r] = mnew;
            for (std::size_t d = 0; d < hd; ++d) o[r][d] *= alpha;
          }
          for (std::size_t j = 0; j < w; ++j) {
            const auto* v = &V(kh, jb + j, 0);
            for (std::size_t r = 0; r < rows; ++r) detail::flash_axpy(o[r], hd, p[r][j], v);
          }
        }
        for (std::size_t r = 0; r < rows; ++r) {
          const T inv = T(1) / l[r];
          OT* out = &O(h, i0 + r, 0);
          for (std::size_t d = 0; d < hd; ++d) out[d] = detail::store<OT>(o[r][d] * inv);
          lse(h, i0 + r) = detail::store<LT>(m[r] + math::log(l[r]));
        }
      });
}

/// Backward of flash_attention_forward from its output O and lse: dQ, dK and
/// dV ACCUMULATE (+=) the gradients of sum(dO * O), so that the query heads
/// of a group, or the key blocks of several calls, add up; zero them first
/// for a plain gradient. Each key/value head is one work item (its query
/// heads and blocks run in order), so the sums do not depend on the thread
/// count and no two threads write the same dK or dV row. Computed in
/// compute_t of all the views but lse; a 2-byte dQ gets its one addition
/// per element rounded once, and 2-byte dK and dV are accumulated in a
/// scratch of the compute type and rounded once at the end of the call.
template <class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void flash_attention_backward(const QV& Q, const KV& K, const VV& V, const OV& O, const DOV& dO, const LV& lse,
                              detail::compute_t<QV, KV, VV, OV, DOV, DQV, DKV, DVV> scale, bool causal, const DQV& dQ,
                              const DKV& dK, const DVV& dV) {
  using T = detail::compute_t<QV, KV, VV, OV, DOV, DQV, DKV, DVV>;
  using DQT = detail::value_t<DQV>;
  using GT = const detail::value_t<DOV>;  // dO's rows
  using QT = const detail::value_t<QV>;
  constexpr const char* op = "weft::ops::flash_attention_backward";
  const std::size_t H = Q.extent(0), tq = Q.extent(1), hd = Q.extent(2), hk = K.extent(0), tk = K.extent(1);
  WEFT_REQUIRE(hk > 0 && H % hk == 0, ShapeError, op, ": ", H, " query heads are not a multiple of ", hk,
               " key/value heads");
  WEFT_REQUIRE(hd <= detail::flash_max_head_dim, ShapeError, op, ": head_dim ", hd, " exceeds ",
               detail::flash_max_head_dim);
  WEFT_REQUIRE(!causal || tk >= tq, ShapeError, op, ": causal attention needs at least as many keys (", tk,
               ") as queries (", tq, ")");
  detail::flash_check(op, "Q", Q, H, tq, hd);
  detail::flash_check(op, "K", K, hk, tk, hd);
  detail::flash_check(op, "V", V, hk, tk, hd);
  detail::flash_check(op, "O", O, H, tq, hd);
  detail::flash_check(op, "dO", dO, H, tq, hd);
  detail::flash_check(op, "dQ", dQ, H, tq, hd);
  detail::flash_check(op, "dK", dK, hk, tk, hd);
  detail::flash_check(op, "dV", dV, hk, tk, hd);
  detail::require_extent(op, "lse", lse, 0, H);
  detail::require_extent(op, "lse", lse, 1, tq);
  if (H == 0 || tq == 0 || tk == 0) return;
  constexpr std::size_t BR = detail::flash_query_block, BC = detail::flash_key_block;
  static_assert(BR == 4, "the dK/dV update below is written out for four query rows");
  const std::size_t tkp = (tk + BC - 1) / BC * BC, group = H / hk, shift = tk - tq;
  using Scratch = Kokkos::View<T***, Kokkos::LayoutRight, typename DQV::memory_space>;
  Scratch Kt(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::flash_attention.kt"), hk, hd, tkp);
  Scratch Vt(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::flash_attention.vt"), hk, hd, tkp);
  detail::flash_transpose<T>(K, Kt);
  detail::flash_transpose<T>(V, Vt);
  const auto dKa = detail::accumulator_for<T>(dK, "weft::flash_attention.dk");
  const auto dVa = detail::accumulator_for<T>(dV, "weft::flash_attention.dv");
  const std::size_t nqb = (tq + BR - 1) / BR;
  Kokkos::parallel_for(
      op, detail::range(dK, hk), KOKKOS_LAMBDA(std::size_t kh) {
        const T* kt = &Kt(kh, 0, 0);
        const T* vt = &Vt(kh, 0, 0);
        for (std::size_t h = kh * group; h < (kh + 1) * group; ++h)
          for (std::size_t qb = 0; qb < nqb; ++qb) {
            const std::size_t i0 = qb * BR, rows = tq - i0 < BR ? tq - i0 : BR;
            T dq[BR][detail::flash_max_head_dim];
            T D[BR], L[BR], p[BR][BC], ds[BR][BC];
            std::size_t lim[BR];
            for (std::size_t r = 0; r < BR; ++r) {
              lim[r] = r < rows ? (causal ? i0 + r + shift + 1 : tk) : 0;
              for (std::size_t d = 0; d < hd; ++d) dq[r][d] = 0;
              if (r < rows) {
                const auto* o = &O(h, i0 + r, 0);
                const auto* g = &dO(h, i0 + r, 0);
                D[r] = detail::lane_sum<T>(
                    hd, [&](std::size_t d) { return T(detail::load<T>(o[d]) * detail::load<T>(g[d])); });
                L[r] = detail::load<T>(lse(h, i0 + r));
              }
            }
            for (std::size_t r = rows; r < BR; ++r)
              for (std::size_t j = 0; j < BC; ++j) p[r][j] = ds[r][j] = 0;
            const std::size_t nmax = lim[rows - 1];
            for (std::size_t jb = 0; jb < nmax; jb += BC) {
              const std::size_t w = nmax - jb < BC ? nmax - jb : BC;
              for (std::size_t r = 0; r < rows; ++r) {
                const std::size_t wr = lim[r] > jb ? (lim[r] - jb < BC ? lim[r] - jb : BC) : 0;
                T s[BC], dp[BC];
                detail::flash_scores(&Q(h, i0 + r, 0), kt + jb, tkp, hd, T(scale), s);
                detail::flash_scores(&dO(h, i0 + r, 0), vt + jb, tkp, hd, T(1), dp);
                for (std::size_t j = 0; j < BC; ++j) {
                  // Masked keys (j >= wr) get p = 0 through selects and a multiply, not a branch, so
                  // the loop vectorises; their exponent is first replaced, so nothing overflows.
                  const T keep = T(j < wr ? 1 : 0);
                  const T x0 = s[j] - L[r];
                  const T x = j < wr ? x0 : T(-100);
                  const T e = keep * math::fast_exp(x);
                  p[r][j] = e;
                  ds[r][j] = T(scale) * e * (dp[j] - D[r]);
                }
              }
              // dV_j += sum_r p_rj dO_r and dK_j += sum_r ds_rj q_r with the block's four
              // rows in one pass over head_dim (rows past the end have p = ds = 0 and
              // point at row i0), then dQ_r += sum_j ds_rj k_j.
              auto row = [&](std::size_t r) { return i0 + (r < rows ? r : 0); };
              GT *__restrict g0 = &dO(h, row(0), 0), *__restrict g1 = &dO(h, row(1), 0),
                              *__restrict g2 = &dO(h, row(2), 0), *__restrict g3 = &dO(h, row(3), 0);
              QT *__restrict q0 = &Q(h, row(0), 0), *__restrict q1 = &Q(h, row(1), 0),
                              *__restrict q2 = &Q(h, row(2), 0), *__restrict q3 = &Q(h, row(3), 0);
              for (std::size_t j = 0; j < w; ++j) {
                T* __restrict dv = &dVa(kh, jb + j, 0);
                T* __restrict dk = &dKa(kh, jb + j, 0);
                const T p0 = p[0][j], p1 = p[1][j], p2 = p[2][j], p3 = p[3][j];
                const T s0 = ds[0][j], s1 = ds[1][j], s2 = ds[2][j], s3 = ds[3][j];
                detail::flash_axpy4(dv, hd, p0, g0, p1, g1, p2, g2, p3, g3);
                detail::flash_axpy4(dk, hd, s0, q0, s1, q1, s2, q2, s3, q3);
              }
              for (std::size_t j = 0; j < w; ++j) {
                const auto* __restrict k = &K(kh, jb + j, 0);
                for (std::size_t r = 0; r < rows; ++r) detail::flash_axpy(dq[r], hd, ds[r][j], k);
              }
            }
            for (std::size_t r = 0; r < rows; ++r) {
              DQT* out = &dQ(h, i0 + r, 0);
              for (std::size_t d = 0; d < hd; ++d) out[d] = detail::store<DQT>(detail::load<T>(out[d]) + dq[r][d]);
            }
          }
      });
  detail::accumulator_finish(dK, dKa);
  detail::accumulator_finish(dV, dVa);
}

}  // namespace weft::ops
