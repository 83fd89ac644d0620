// LayerNorm and RMSNorm over the feature dimension of a [rows, features]
// matrix, forward and backward. The forward saves one mean and one reciprocal
// standard deviation per row, which is all the backward needs besides x.
//
// Mixed precision: x, y, dy and dx may be bf16 or fp16 views, gamma, beta and
// their gradients float views (or the activations' type), and the statistics
// mean and rstd are kept in float (the compute type, detail::compute_t of the
// activations): every sum is accumulated in float, every output rounded once.
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

/// y = (x - mean) * rstd * gamma + beta per row; writes mean(i) and rstd(i)
/// for the backward pass. y must not alias x (the backward needs x). The
/// statistics and the affine transform are computed in compute_t<XV, YV>
/// (float for bf16/fp16 activations); y is rounded once.
template <class XV, class GV, class BV, class YV, class SV>
void layernorm_forward(const XV& x, const GV& gamma, const BV& beta, detail::compute_t<XV, YV> eps, const YV& y,
                       const SV& mean, const SV& rstd) {
  const std::size_t rows = x.extent(0), d = x.extent(1);
  detail::require_extent("weft::ops::layernorm_forward", "gamma", gamma, 0, d);
  detail::require_extent("weft::ops::layernorm_forward", "beta", beta, 0, d);
  detail::require_extent("weft::ops::layernorm_forward", "y", y, 0, rows);
  detail::require_extent("weft::ops::layernorm_forward", "y", y, 1, d);
  detail::require_extent("weft::ops::layernorm_forward", "mean", mean, 0, rows);
  detail::require_extent("weft::ops::layernorm_forward", "rstd", rstd, 0, rows);
  using T = detail::compute_t<XV, YV>;
  using Y = detail::value_t<YV>;
  using S = detail::value_t<SV>;
  Kokkos::parallel_for(
      "weft::layernorm_forward", detail::range(x, rows), KOKKOS_LAMBDA(std::size_t i) {
        // Lane-wise sums (common.hpp) so that both reductions vectorise; the
        // affine transform is applied in the same row pass that writes y.
        const T mu = detail::lane_sum<T>(d, [&](std::size_t j) { return detail::load<T>(x(i, j)); }) / T(d);
        // two passes: the one-pass variance cancels badly for large means
        const T v = detail::lane_sum<T>(d, [&](std::size_t j) {
          const T c = detail::load<T>(x(i, j)) - mu;
          return c * c;
        });
        const T r = T(1) / math::sqrt(v / T(d) + eps);
        for (std::size_t j = 0; j < d; ++j)
          y(i, j) = detail::store<Y>((detail::load<T>(x(i, j)) - mu) * r * detail::load<T>(gamma(j)) +
                                     detail::load<T>(beta(j)));
        mean(i) = detail::store<S>(mu);
        rstd(i) = detail::store<S>(r);
      });
}

/// Backward of layernorm_forward. dx = (accumulate ? dx : 0) + d/dx; dgamma and
/// dbeta always accumulate (gradients sum over microbatches). Computed in
/// compute_t<DYV, XV, DXV>; dgamma and dbeta may be float views under bf16
/// activations (each call adds its column sums, taken in float, once).
template <class DYV, class XV, class GV, class SV, class DXV, class DGV>
void layernorm_backward(const DYV& dy, const XV& x, const GV& gamma, const SV& mean, const SV& rstd, const DXV& dx,
                        bool accumulate, const DGV& dgamma, const DGV& dbeta) {
  const std::size_t rows = x.extent(0), d = x.extent(1);
  detail::require_extent("weft::ops::layernorm_backward", "dy", dy, 0, rows);
  detail::require_extent("weft::ops::layernorm_backward", "dy", dy, 1, d);
  detail::require_extent("weft::ops::layernorm_backward", "dx", dx, 0, rows);
  detail::require_extent("weft::ops::layernorm_backward", "dx", dx, 1, d);
  detail::require_extent("weft::ops::layernorm_backward", "dgamma", dgamma, 0, d);
  detail::require_extent("weft::ops::layernorm_backward", "dbeta", dbeta, 0, d);
  using T = detail::compute_t<DYV, XV, DXV>;
  using DX = detail::value_t<DXV>;
  using DG = detail::value_t<DGV>;
  using detail::load;
  const std::size_t C = detail::column_chunk;
  Kokkos::parallel_for(
      "weft::layernorm_backward_params", detail::range(x, (d + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        T g[detail::column_chunk] = {}, b[detail::column_chunk] = {};
        const std::size_t j0 = c * C, w = d - j0 < C ? d - j0 : C;
        for (std::size_t i = 0; i < rows; ++i) {
          const T mu = load<T>(mean(i)), r = load<T>(rstd(i));
          for (std::size_t jj = 0; jj < w; ++jj) {
            g[jj] += load<T>(dy(i, j0 + jj)) * (load<T>(x(i, j0 + jj)) - mu) * r;
            b[jj] += load<T>(dy(i, j0 + jj));
          }
        }
        for (std::size_t jj = 0; jj < w; ++jj) {
          dgamma(j0 + jj) = detail::store<DG>(load<T>(dgamma(j0 + jj)) + g[jj]);
          dbeta(j0 + jj) = detail::store<DG>(load<T>(dbeta(j0 + jj)) + b[jj]);
        }
      });
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
  Kokkos::parallel_for(
      "weft::layernorm_backward_x", detail::range(x, rows), KOKKOS_LAMBDA(std::size_t i) {
        const T mu = load<T>(mean(i)), r = load<T>(rstd(i));
        const T sg =
            detail::lane_sum<T>(d, [&](std::size_t j) { return T(load<T>(dy(i, j)) * load<T>(gamma(j))); }) / T(d);
        const T sgx = detail::lane_sum<T>(d, [&](std::size_t j) {
                        return T(load<T>(dy(i, j)) * load<T>(gamma(j)) * (load<T>(x(i, j)) - mu) * r);
                      }) /
                      T(d);
        for (std::size_t j = 0; j < d; ++j) {
          const T v = r * (load<T>(dy(i, j)) * load<T>(gamma(j)) - sg - (load<T>(x(i, j)) - mu) * r * sgx);
          dx(i, j) = detail::store<DX>(accumulate ? load<T>(dx(i, j)) + v : v);
        }
      });
}

/// y = x * rstd * gamma with rstd = 1 / sqrt(mean(x^2) + eps); writes rstd(i).
/// Computed in compute_t<XV, YV>, y rounded once (as layernorm_forward).
template <class XV, class GV, class YV, class SV>
void rmsnorm_forward(const XV& x, const GV& gamma, detail::compute_t<XV, YV> eps, const YV& y, const SV& rstd) {
  const std::size_t rows = x.extent(0), d = x.extent(1);
  detail::require_extent("weft::ops::rmsnorm_forward", "gamma", gamma, 0, d);
  detail::require_extent("weft::ops::rmsnorm_forward", "y", y, 0, rows);
  detail::require_extent("weft::ops::rmsnorm_forward", "y", y, 1, d);
  detail::require_extent("weft::ops::rmsnorm_forward", "rstd", rstd, 0, rows);
  using T = detail::compute_t<XV, YV>;
  using Y = detail::value_t<YV>;
  using S = detail::value_t<SV>;
  using detail::load;
  Kokkos::parallel_for(
      "weft::rmsnorm_forward", detail::range(x, rows), KOKKOS_LAMBDA(std::size_t i) {
        const T s = detail::lane_sum<T>(d, [&](std::size_t j) { return T(load<T>(x(i, j)) * load<T>(x(i, j))); });
        const T r = T(1) / math::sqrt(s / T(d) + eps);
        for (std::size_t j = 0; j < d; ++j) y(i, j) = detail::store<Y>(load<T>(x(i, j)) * r * load<T>(gamma(j)));
        rstd(i) = detail::store<S>(r);
      });
}

/// Backward of rmsnorm_forward; same accumulation rules as layernorm_backward.
template <class DYV, class XV, class GV, class SV, class DXV, class DGV>
void rmsnorm_backward(const DYV& dy, const XV& x, const GV& gamma, const SV& rstd, const DXV& dx, bool accumulate,
                      const DGV& dgamma) {
  const std::size_t rows = x.extent(0), d = x.extent(1);
  detail::require_extent("weft::ops::rmsnorm_backward", "dy", dy, 0, rows);
  detail::require_extent("weft::ops::rmsnorm_backward", "dy", dy, 1, d);
  detail::require_extent("weft::ops::rmsnorm_backward", "dx", dx, 0, rows);
  detail::require_extent("weft::ops::rmsnorm_backward", "dx", dx, 1, d);
  detail::require_extent("weft::ops::rmsnorm_backward", "dgamma", dgamma, 0, d);
  using T = detail::compute_t<DYV, XV, DXV>;
  using DX = detail::value_t<DXV>;
  using DG = detail::value_t<DGV>;
  using detail::load;
  const std::size_t C = detail::column_chunk;
  Kokkos::parallel_for(
      "weft::rmsnorm_backward_params", detail::range(x, (d + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        T g[detail::column_chunk] = {};
        const std::size_t j0 = c * C, w = d - j0 < C ? d - j0 : C;
        for (std::size_t i = 0; i < rows; ++i) {
          const T r = load<T>(rstd(i));
          for (std::size_t jj = 0; jj < w; ++jj) g[jj] += load<T>(dy(i, j0 + jj)) * load<T>(x(i, j0 + jj)) * r;
        }
        for (std::size_t jj = 0; jj < w; ++jj) dgamma(j0 + jj) = detail::store<DG>(load<T>(dgamma(j0 + jj)) + g[jj]);
      });
  // dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma, xhat = x * rstd.
  Kokkos::parallel_for(
      "weft::rmsnorm_backward_x", detail::range(x, rows), KOKKOS_LAMBDA(std::size_t i) {
        const T r = load<T>(rstd(i));
        const T sgx = detail::lane_sum<T>(d, [&](std::size_t j) {
                        return T(load<T>(dy(i, j)) * load<T>(gamma(j)) * load<T>(x(i, j)) * r);
                      }) /
                      T(d);
        for (std::size_t j = 0; j < d; ++j) {
          const T v = r * (load<T>(dy(i, j)) * load<T>(gamma(j)) - load<T>(x(i, j)) * r * sgx);
          dx(i, j) = detail::store<DX>(accumulate ? load<T>(dx(i, j)) + v : v);
        }
      });
}

}  // namespace weft::ops
