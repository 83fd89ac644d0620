// The two file-level pieces of weft's checkpoint format: the header of a
// NumPy .npy file (version 1.0, so numpy.load opens every chunk) and CRC-32
// (the polynomial of zlib and PNG, so Python's zlib.crc32 checks a chunk).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <weft/core/error.hpp>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>  // AVX-512 VPCLMULQDQ
#include <smmintrin.h>  // SSE4.1: _mm_extract_epi32
#include <wmmintrin.h>  // PCLMULQDQ
#endif

namespace weft::checkpoint {

namespace detail {
/// CRC-32 by table lookups (slicing by 8), zlib's convention.
inline std::uint32_t crc32_table(const void* data, std::size_t n, std::uint32_t crc) {
  // Slicing by 8: eight tables, eight bytes per step.
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (n >= 8) {
    const std::uint32_t a = crc ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
                                   std::uint32_t(p[3]) << 24);
    crc = tables[7][a & 0xFF] ^ tables[6][(a >> 8) & 0xFF] ^ tables[5][(a >> 16) & 0xFF] ^ tables[4][a >> 24] ^
          tables[3][p[4]] ^ tables[2][p[5]] ^ tables[1][p[6]] ^ tables[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--) crc = tables[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define WEFT_CRC32_CLMUL 1
// CRC-32 of n bytes (n >= 64, a multiple of 16) by carry-less multiplication:
// four 128-bit lanes folded 64 bytes at a time, then into one lane, then
// Barrett-reduced to 32 bits (the folding method of Gopal et al., "Fast CRC
// computation for generic polynomials using PCLMULQDQ", Intel 2009; the
// constants are x^k mod P for the reflected polynomial 0xEDB88320).
// One fold: x's two halves times the constants k, plus the next 16 bytes.
__attribute__((target("pclmul,sse4.1"))) inline __m128i crc32_fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}
// The fold constants for a distance of D bits are (x^(D+32) mod P, x^(D-32)
// mod P), bit-reflected and shifted left by one, in the low and high halves.
// The last 16-byte folds of the n remaining bytes (a multiple of 16) into x1,
// then 128 -> 64 bits (appending 32 zero bits) and 64 -> 32 by Barrett
// reduction; the result is the raw register (no inversion).
__attribute__((target("pclmul,sse4.1"))) inline std::uint32_t crc32_clmul_finish(__m128i x1, const unsigned char* p,
                                                                                  std::size_t n) {
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // D = 128
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
  const __m128i poly = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  while (n >= 16) {
    x1 = crc32_fold(x1, k3k4, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(k3k4, x1, 0x01));
  __m128i x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00), x2);
  x2 = x1;
  x1 = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10), mask32);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, poly, 0x00), x2);
  return std::uint32_t(_mm_extract_epi32(x1, 1));
}
// `crc` and the result are the raw register (no inversion).
__attribute__((target("pclmul,sse4.1"))) inline std::uint32_t crc32_clmul_raw(const unsigned char* p, std::size_t n,
                                                                               std::uint32_t crc) {
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  // D = 512
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // D = 128
  auto load = [](const unsigned char* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(int(crc))), x2 = load(p + 16), x3 = load(p + 32),
          x4 = load(p + 48);
  p += 64;
  n -= 64;
  while (n >= 64) {
    x1 = crc32_fold(x1, k1k2, load(p));
    x2 = crc32_fold(x2, k1k2, load(p + 16));
    x3 = crc32_fold(x3, k1k2, load(p + 32));
    x4 = crc32_fold(x4, k1k2, load(p + 48));
    p += 64;
    n -= 64;
  }
  x1 = crc32_fold(x1, k3k4, x2);
  x1 = crc32_fold(x1, k3k4, x3);
  x1 = crc32_fold(x1, k3k4, x4);
  return crc32_clmul_finish(x1, p, n);
}

#define WEFT_CRC32_VPCLMUL 1
// The same folding on 512-bit registers (AVX-512 VPCLMULQDQ: four 128-bit
// lanes per register): four registers fold 256 bytes at a time, which keeps
// the carry-less multipliers busy where the 128-bit loop waits on their
// latency: on data in the L2 cache, 4.6-6.2 GB/s with the 128-bit loop and
// 13-28 GB/s with this one on this machine's AMD EPYC (docs/checkpoint.md).
// n >= 256, a multiple of 16.
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1"))) inline __m512i crc32_fold512(__m512i x, __m512i k,
                                                                                                  __m512i next) {
  // x.lo * k.lo ^ x.hi * k.hi ^ next, in each 128-bit lane (0x96: three-way xor).
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1"))) inline std::uint32_t crc32_vpclmul_raw(
    const unsigned char* p, std::size_t n, std::uint32_t crc) {
  // (Set and stored rather than broadcast and extracted, whose "undefined"
  // operands GCC 12 warns about; no lambdas, which would not inherit the
  // target attribute.)
  const __m512i k2048 = _mm512_set_epi64(0x1322d1430LL, 0x11542778aLL, 0x1322d1430LL, 0x11542778aLL, 0x1322d1430LL,
                                         0x11542778aLL, 0x1322d1430LL, 0x11542778aLL);  // D = 2048
  const __m512i k512 = _mm512_set_epi64(0x1c6e41596LL, 0x154442bd4LL, 0x1c6e41596LL, 0x154442bd4LL, 0x1c6e41596LL,
                                        0x154442bd4LL, 0x1c6e41596LL, 0x154442bd4LL);  // D = 512
  __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128(int(crc)), 0));
  __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
  p += 256;
  n -= 256;
  while (n >= 256) {
    x0 = crc32_fold512(x0, k2048, _mm512_loadu_si512(p));
    x1 = crc32_fold512(x1, k2048, _mm512_loadu_si512(p + 64));
    x2 = crc32_fold512(x2, k2048, _mm512_loadu_si512(p + 128));
    x3 = crc32_fold512(x3, k2048, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  x0 = crc32_fold512(x0, k512, x1);
  x0 = crc32_fold512(x0, k512, x2);
  x0 = crc32_fold512(x0, k512, x3);
  while (n >= 64) {
    x0 = crc32_fold512(x0, k512, _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  // The four lanes into one: lane i folded over the 48 - 16 i bytes after it.
  const __m128i k384 = _mm_set_epi64x(0x174359406LL, 0x03db1ecdcLL);  // D = 384
  const __m128i k256 = _mm_set_epi64x(0x15a546366LL, 0x0f1da05aaLL);  // D = 256
  const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // D = 128
  alignas(64) __m128i lane[4];
  _mm512_store_si512(lane, x0);
  __m128i x = crc32_fold(lane[2], k128, lane[3]);
  x = crc32_fold(lane[1], k256, x);
  x = crc32_fold(lane[0], k384, x);
  return crc32_clmul_finish(x, p, n);
}
#endif
}  // namespace detail

/// CRC-32 (reflected polynomial 0xEDB88320, as zlib.crc32) of `n` bytes,
/// continuing from `crc` (0 to start). Uses carry-less multiplication where
/// the processor has it (x86 PCLMULQDQ), table lookups otherwise.
inline std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0) {
#if defined(WEFT_CRC32_CLMUL)
  static const bool clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  static const bool vpclmul = clmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                              __builtin_cpu_supports("vpclmulqdq");
  if (clmul && n >= 64) {
    const std::size_t m = n & ~std::size_t(15);
    const auto* p = static_cast<const unsigned char*>(data);
    crc = ~(vpclmul && m >= 256 ? detail::crc32_vpclmul_raw(p, m, ~crc) : detail::crc32_clmul_raw(p, m, ~crc));
    return detail::crc32_table(p + m, n - m, crc);
  }
#endif
  return detail::crc32_table(data, n, crc);
}

/// The header of a version 1.0 .npy file holding a C-order array of
/// little-endian float32 (`descr` '<f4') of `shape`, padded with spaces so
/// that the data starts at a multiple of 64 bytes.
inline std::string npy_header(const std::vector<std::size_t>& shape, const std::string& descr = "<f4") {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + (shape.size() == 1 ? "," : i + 1 < shape.size() ? ", " : "");
  dict += "), }";
  const std::size_t fixed = 10;  // magic (6), version (2), header length (2)
  std::size_t total = fixed + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  dict.append(total - fixed - dict.size() - 1, ' ');
  dict += '\n';
  std::string h = "\x93NUMPY";
  h += char(1);
  h += char(0);
  h += char(dict.size() & 0xFF);
  h += char((dict.size() >> 8) & 0xFF);
  return h + dict;
}

/// What a .npy header says.
struct NpyInfo {
  std::string descr;
  std::vector<std::size_t> shape;
  std::size_t data_offset = 0;  ///< where the data starts
};

/// Parses the .npy header at the start of `bytes` (at least the first 10 +
/// header-length bytes of the file); `what` names the file in the error.
inline NpyInfo parse_npy_header(const std::string& bytes, const std::string& what) {
  WEFT_REQUIRE(bytes.size() >= 10 && bytes.compare(0, 6, "\x93NUMPY") == 0, IoError, what,
               ": not a .npy file (no \\x93NUMPY magic at its start)");
  const unsigned major = static_cast<unsigned char>(bytes[6]);
  WEFT_REQUIRE(major == 1, IoError, what, ": .npy version ", major, ".x; weft reads version 1.0");
  const std::size_t len = std::size_t(static_cast<unsigned char>(bytes[8])) | std::size_t(static_cast<unsigned char>(bytes[9])) << 8;
  WEFT_REQUIRE(bytes.size() >= 10 + len, IoError, what, ": the .npy header is cut short (", bytes.size(), " of ", 10 + len,
               " bytes)");
  const std::string dict = bytes.substr(10, len);
  NpyInfo info;
  info.data_offset = 10 + len;
  const std::size_t d = dict.find("'descr': '");
  WEFT_REQUIRE(d != std::string::npos, IoError, what, ": the .npy header has no 'descr'");
  const std::size_t d1 = dict.find('\'', d + 10);
  WEFT_REQUIRE(d1 != std::string::npos, IoError, what, ": the .npy header's 'descr' is not closed");
  info.descr = dict.substr(d + 10, d1 - d - 10);
  WEFT_REQUIRE(dict.find("'fortran_order': False") != std::string::npos, IoError, what,
               ": the .npy array is not in C order ('fortran_order': False)");
  const std::size_t s = dict.find("'shape': (");
  WEFT_REQUIRE(s != std::string::npos, IoError, what, ": the .npy header has no 'shape'");
  std::size_t i = s + 10;
  while (i < dict.size() && dict[i] != ')') {
    if (dict[i] >= '0' && dict[i] <= '9') {
      std::size_t v = 0;
      while (i < dict.size() && dict[i] >= '0' && dict[i] <= '9') v = v * 10 + std::size_t(dict[i++] - '0');
      info.shape.push_back(v);
    } else {
      ++i;
    }
  }
  WEFT_REQUIRE(i < dict.size(), IoError, what, ": the .npy header's 'shape' is not closed");
  return info;
}

}  // namespace weft::checkpoint
