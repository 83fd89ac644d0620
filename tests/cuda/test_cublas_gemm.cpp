// The cuBLAS provider's call (weft::ops::cublas::gemm_ex) on device memory:
// row-major and column-major operands, every transpose case, leading
// dimensions wider than the rows, bf16 and fp16 inputs with fp32 compute and
// a float C, and the strided-batched form, against a double loop on the host.
// Built wherever the CUDA toolkit is (so the call compiles and links against
// cuBLAS on every CI run); it runs only where a GPU is, and exits 77
// (skipped) elsewhere. A plain main, no MPI: this checks one library call.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <weft/ops/gemm_cublas.hpp>

namespace {

int failures = 0;

template <class T>
void run_case(bool row, bool ta, bool tb, int m, int n, int k, int pad, int batch) {
  // Stored shapes of A and B (before op), in the storage order `row`.
  const int ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
  auto ld_of = [&](int rows, int cols) { return (row ? cols : rows) + pad; };
  auto size_of = [&](int rows, int cols) { return std::size_t(ld_of(rows, cols)) * std::size_t(row ? rows : cols); };
  const int lda = ld_of(ar, ac), ldb = ld_of(br, bc), ldc = ld_of(m, n);
  const std::size_t sa = size_of(ar, ac), sb = size_of(br, bc), sc = size_of(m, n);
  std::vector<T> A(sa * batch), B(sb * batch);
  std::vector<float> C(sc * batch, 0.5f);
  std::mt19937 gen(unsigned(m * 131 + n * 17 + k + batch));
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : A) x = T(u(gen));
  for (auto& x : B) x = T(u(gen));
  auto at = [&](const std::vector<T>& v, std::size_t off, int ld, int i, int j) {
    return double(float(v[off + (row ? std::size_t(i) * ld + j : std::size_t(j) * ld + i)]));
  };
  T *dA, *dB;
  float* dC;
  cudaMalloc(&dA, A.size() * sizeof(T));
  cudaMalloc(&dB, B.size() * sizeof(T));
  cudaMalloc(&dC, C.size() * sizeof(float));
  cudaMemcpy(dA, A.data(), A.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), B.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemcpy(dC, C.data(), C.size() * sizeof(float), cudaMemcpyHostToDevice);
  const float alpha = 0.75f, beta = 0.5f;
  weft::ops::cublas::gemm_ex<T, float>(weft::ops::cublas::handle(), row, ta, tb, m, n, k, alpha, {dA, lda}, {dB, ldb},
                                       beta, dC, ldc, batch, std::int64_t(sa), std::int64_t(sb), std::int64_t(sc));
  std::vector<float> got(C.size());
  cudaMemcpy(got.data(), dC, got.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
  int bad = 0;
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0, sabs = 0;
        for (int q = 0; q < k; ++q) {
          const double x = ta ? at(A, b * sa, lda, q, i) : at(A, b * sa, lda, i, q);
          const double y = tb ? at(B, b * sb, ldb, j, q) : at(B, b * sb, ldb, q, j);
          s += x * y;
          sabs += std::fabs(x * y);
        }
        const std::size_t ci = b * sc + (row ? std::size_t(i) * ldc + j : std::size_t(j) * ldc + i);
        const double ref = alpha * s + beta * 0.5;
        // fp32 accumulation of exact 2-byte inputs: k eps32 of the sum of |terms|.
        if (!(std::fabs(got[ci] - ref) <= (k + 2) * 0x1p-24 * (alpha * sabs + 0.5) + 1e-30)) ++bad;
      }
  if (bad) {
    ++failures;
    std::printf("FAILED: %s ta=%d tb=%d m=%d n=%d k=%d pad=%d batch=%d: %d elements off\n", row ? "row" : "col", ta, tb,
                m, n, k, pad, batch, bad);
  }
}

}  // namespace

int main() {
  static_assert(weft::ops::cublas::data_type<weft::bf16>() == CUDA_R_16BF);
  static_assert(weft::ops::cublas::data_type<weft::fp16>() == CUDA_R_16F);
  static_assert(weft::ops::cublas::data_type<float>() == CUDA_R_32F);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("test_cublas_gemm: no CUDA device here; compiled and linked against cuBLAS, nothing run\n");
    return 77;
  }
  for (bool row : {true, false})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        run_case<weft::bf16>(row, ta, tb, 17, 33, 65, 0, 1);
        run_case<weft::bf16>(row, ta, tb, 17, 33, 65, 3, 1);
        run_case<weft::fp16>(row, ta, tb, 8, 40, 24, 2, 1);
        run_case<weft::bf16>(row, ta, tb, 16, 16, 32, 0, 5);
      }
  std::printf("test_cublas_gemm: %d case(s) failed\n", failures);
  return failures ? 1 : 0;
}
