// weft's 2-byte floating-point storage types, weft::bf16 and weft::fp16: the
// element types of mixed-precision parameters, activations and transfers, with
// conversions from float that round to nearest even and exact ones to float.
#pragma once

#include <Kokkos_Core.hpp>

#include <concepts>
#include <cstdint>
#include <limits>
#include <type_traits>

// Why weft has its own types: Debian's Kokkos 3.4 has no bhalf_t and its
// half_t is a float on the host, and Kokkos >= 4 falls back to float for
// both on host backends, so arrays of Kokkos' types are not 2-byte arrays
// there. weft::bf16 and weft::fp16 are the same 2-byte, bit-level types on
// every backend (CUDA and HIP included): a view of them has the same bytes
// wherever it lives, so MPI, checkpoints, oneDNN (dnnl_bf16 / dnnl_f16) and
// cuBLAS (CUDA_R_16BF / CUDA_R_16F) can take their memory as is, and a
// conversion gives the same bits on the host and on a device. The
// conversions from and to float are plain integer operations, so they do not
// depend on the instruction set (AVX512_BF16 or not), on the rounding mode,
// or on flush-to-zero settings. (The conversion from double goes through one
// hardware double-to-float conversion, corrected to round-to-odd for any
// rounding mode; a flush-to-zero mode would change its subnormal results.)

namespace weft {

namespace detail {

// Bits of a float and back. __builtin_bit_cast is what std::bit_cast is made
// of in libstdc++ and libc++; calling it directly keeps the functions below
// usable in device code without nvcc's --expt-relaxed-constexpr (std::bit_cast
// is a host function to nvcc).
KOKKOS_INLINE_FUNCTION constexpr std::uint32_t float_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}
KOKKOS_INLINE_FUNCTION constexpr float float_of_bits(std::uint32_t u) noexcept { return __builtin_bit_cast(float, u); }
KOKKOS_INLINE_FUNCTION constexpr std::uint64_t double_bits(double d) noexcept {
  return __builtin_bit_cast(std::uint64_t, d);
}

/// float -> bf16 bits, round to nearest, ties to even. A NaN stays a NaN
/// (sign and the payload's top bits kept, quiet bit set: truncating a NaN
/// whose payload lies in the low 16 bits would make it an infinity);
/// infinities stay infinities; finite values at or above
/// max + ulp/2 (the midpoint to 2^128) become infinities, as IEEE 754 says.
KOKKOS_INLINE_FUNCTION constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  // Adding 0x7fff rounds up exactly when the low half exceeds 0x8000; the
  // kept half's lowest bit added on top turns the tie into ties-to-even. A
  // carry out of the mantissa increments the exponent, which is the right
  // result (up to the infinity 0x7f80), and cannot overflow 32 bits.
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

/// bf16 bits -> float, exact (bf16 is the top half of a float).
KOKKOS_INLINE_FUNCTION constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return float_of_bits(static_cast<std::uint32_t>(b) << 16);
}

/// float -> fp16 bits, round to nearest, ties to even, with fp16's subnormals
/// (magnitudes below 2^-14, in steps of 2^-24). NaN stays NaN (quiet, sign
/// and top payload bits kept); magnitudes >= 65520 (the midpoint between the
/// largest finite fp16, 65504, and 2^16) become infinities.
KOKKOS_INLINE_FUNCTION constexpr std::uint16_t float_to_fp16_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  if (a >= 0x38800000u) {  // |f| >= 2^-14: an fp16 normal (or an overflow)
    // Rebias the exponent (127 -> 15) in place, then round the 13 bits that
    // fp16 drops as in float_to_bf16_bits. Rounding may carry into the
    // exponent; an exponent of 31 or more is an infinity.
    std::uint32_t r = a - (112u << 23);
    r += 0x0fffu + ((r >> 13) & 1u);
    if (r >= (0x1fu << 23)) return static_cast<std::uint16_t>(sign | 0x7c00u);
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  // |f| < 2^-14: the result is a multiple of 2^-24 (a subnormal, zero, or --
  // after rounding up -- the smallest normal 0x0400, which the same encoding
  // gives). Below 2^-25 every float rounds to zero (2^-25 itself is a tie,
  // and zero is the even choice); float subnormals are far below that.
  if (a < 0x33000000u) return static_cast<std::uint16_t>(sign);
  const std::uint32_t exponent = a >> 23;                   // 102 ... 112
  const std::uint32_t mantissa = (a & 0x007fffffu) | 0x00800000u;  // 24 significant bits
  const std::uint32_t shift = 126u - exponent;              // |f| / 2^-24 = mantissa >> shift; 14 ... 24
  std::uint32_t q = mantissa >> shift;
  const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

/// fp16 bits -> float, exact: every fp16 value, subnormals included, is a
/// float. NaN payloads are kept bit for bit (shifted into the float's
/// mantissa), so a quiet fp16 NaN round-trips exactly.
KOKKOS_INLINE_FUNCTION constexpr float fp16_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x03ffu;
  if (exponent == 0x1fu) return float_of_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return float_of_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return float_of_bits(sign);
  // A subnormal, mantissa x 2^-24: normalise it by integer shifts (no float
  // arithmetic, so flush-to-zero modes cannot touch it). Starting from
  // 2^-14's biased exponent, each shift halves the scale.
  std::uint32_t e = 113;
  while ((mantissa & 0x0400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return float_of_bits(sign | (e << 23) | ((mantissa & 0x03ffu) << 13));
}

/// double -> float rounded to odd: the float nearest to d toward zero, with
/// its lowest bit set when d was not exact. A later round-to-nearest-even to
/// a format of at most 22 significant bits (bf16: 8, fp16: 11) then equals
/// rounding d directly (the classic argument for round-to-odd: the odd bit
/// only records "inexact" far below the second rounding's position), so
/// bf16(double) and fp16(double) round once, not twice.
KOKKOS_INLINE_FUNCTION constexpr float double_to_float_round_to_odd(double d) noexcept {
  const float f = static_cast<float>(d);
  if (d != d || static_cast<double>(f) == d) return f;  // NaN, or exact
  // f is one of the two floats around d (whatever the rounding mode); the
  // answer is the one with an odd mantissa. Finite magnitudes are ordered
  // like their bit patterns, so the neighbour is one bit pattern away
  // (inf - 1 is the largest finite float, which round-to-odd gives beyond it).
  const std::uint32_t u = float_bits(f);
  if (u & 1u) return f;
  const bool toward_larger = (d < 0 ? -d : d) > static_cast<double>(f < 0 ? -f : f);
  return float_of_bits(toward_larger ? u + 1u : u - 1u);
}

}  // namespace detail

/// bfloat16: 1 sign bit, 8 exponent bits (float's range), 7 mantissa bits.
/// A 2-byte storage type, trivially copyable and standard-layout, whose
/// object representation is the IEEE-style bfloat16 bit pattern (the top 16
/// bits of a float) -- what oneDNN's dnnl_bf16, cuBLAS' CUDA_R_16BF and
/// __nv_bfloat16 hold. Arithmetic is done in float: a bf16 converts
/// implicitly and exactly to float, so `a * b` is a float product; going
/// back is explicit, `bf16(x)`, because it rounds.
///
/// Default construction leaves the bits uninitialised (as for float);
/// `bf16{}` and Kokkos' view initialisation give +0.
class bf16 {
 public:
  bf16() = default;
  /// f rounded to nearest, ties to even; NaN stays NaN, +-inf stay +-inf,
  /// |f| >= 2^128 - 2^119 (half an ulp above the largest bf16) becomes +-inf.
  KOKKOS_INLINE_FUNCTION constexpr explicit bf16(float f) noexcept : bits_(detail::float_to_bf16_bits(f)) {}
  /// d rounded once to nearest, ties to even (through a float rounded to odd, see
  /// detail::double_to_float_round_to_odd), with the same NaN, infinity and overflow rules.
  KOKKOS_INLINE_FUNCTION constexpr explicit bf16(double d) noexcept
      : bits_(detail::float_to_bf16_bits(detail::double_to_float_round_to_odd(d))) {}
  /// An integer through double: rounded once for |i| <= 2^53 (every 32-bit integer).
  template <std::integral I>
  KOKKOS_INLINE_FUNCTION constexpr explicit bf16(I i) noexcept : bf16(static_cast<double>(i)) {}

  /// The value as a float, exactly.
  KOKKOS_INLINE_FUNCTION constexpr operator float() const noexcept { return detail::bf16_bits_to_float(bits_); }

  /// The bf16 whose bit pattern is b.
  KOKKOS_INLINE_FUNCTION static constexpr bf16 from_bits(std::uint16_t b) noexcept {
    bf16 x{};
    x.bits_ = b;
    return x;
  }
  /// The bit pattern: sign << 15 | biased exponent << 7 | mantissa.
  KOKKOS_INLINE_FUNCTION constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

/// IEEE 754 binary16 (half): 1 sign bit, 5 exponent bits, 10 mantissa bits;
/// largest finite 65504, smallest normal 2^-14, smallest subnormal 2^-24. A
/// 2-byte storage type with the same properties and interface as bf16; its
/// object representation is the binary16 bit pattern (dnnl_f16, CUDA_R_16F,
/// __half, _Float16).
class fp16 {
 public:
  fp16() = default;
  /// f rounded to nearest, ties to even, subnormals included; NaN stays
  /// NaN, +-inf stay +-inf, |f| >= 65520 becomes +-inf.
  KOKKOS_INLINE_FUNCTION constexpr explicit fp16(float f) noexcept : bits_(detail::float_to_fp16_bits(f)) {}
  /// d rounded once to nearest, ties to even, with the same rules.
  KOKKOS_INLINE_FUNCTION constexpr explicit fp16(double d) noexcept
      : bits_(detail::float_to_fp16_bits(detail::double_to_float_round_to_odd(d))) {}
  /// An integer through double: rounded once for |i| <= 2^53 (every 32-bit integer).
  template <std::integral I>
  KOKKOS_INLINE_FUNCTION constexpr explicit fp16(I i) noexcept : fp16(static_cast<double>(i)) {}

  /// The value as a float, exactly.
  KOKKOS_INLINE_FUNCTION constexpr operator float() const noexcept { return detail::fp16_bits_to_float(bits_); }

  /// The fp16 whose bit pattern is b.
  KOKKOS_INLINE_FUNCTION static constexpr fp16 from_bits(std::uint16_t b) noexcept {
    fp16 x{};
    x.bits_ = b;
    return x;
  }
  /// The bit pattern: sign << 15 | biased exponent << 10 | mantissa.
  KOKKOS_INLINE_FUNCTION constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2 && sizeof(fp16) == 2 && alignof(fp16) == 2,
              "weft::bf16 and weft::fp16 must be exactly 2 bytes: libraries and MPI read arrays of them as 2-byte "
              "elements");
static_assert(std::is_trivially_copyable_v<bf16> && std::is_standard_layout_v<bf16> &&
                  std::is_trivially_copyable_v<fp16> && std::is_standard_layout_v<fp16>,
              "weft::bf16 and weft::fp16 must be trivially copyable and standard-layout: views of them are copied "
              "byte-wise (deep_copy, MPI, checkpoints)");

/// The value of x as a float, exactly (float and double pass through; a
/// double is rounded to float). For generic kernels: `to_float(x(i))` reads
/// any of weft's element types.
KOKKOS_INLINE_FUNCTION constexpr float to_float(bf16 x) noexcept { return static_cast<float>(x); }
KOKKOS_INLINE_FUNCTION constexpr float to_float(fp16 x) noexcept { return static_cast<float>(x); }
KOKKOS_INLINE_FUNCTION constexpr float to_float(float x) noexcept { return x; }
KOKKOS_INLINE_FUNCTION constexpr float to_float(double x) noexcept { return static_cast<float>(x); }

/// True for weft's 2-byte floating-point storage types, bf16 and fp16 (cv-qualified too).
template <class T>
inline constexpr bool is_reduced_precision_v = std::is_same_v<std::remove_cv_t<T>, bf16> ||
                                               std::is_same_v<std::remove_cv_t<T>, fp16>;

/// A reduced-precision storage type: weft::bf16 or weft::fp16.
template <class T>
concept ReducedPrecision = is_reduced_precision_v<T>;

namespace detail {
template <class T>
struct accumulation_type {
  using type = std::remove_cv_t<T>;
};
template <ReducedPrecision T>
struct accumulation_type<T> {
  using type = float;
};
}  // namespace detail

/// The type a kernel accumulates elements of T in: float for bf16 and fp16
/// (sums, dot products, norms and softmax statistics of 2-byte values are
/// computed in float and rounded once at the end), T itself for float,
/// double and integers.
template <class T>
using accumulation_t = typename detail::accumulation_type<T>::type;

}  // namespace weft

// numeric_limits for both types, so generic code (tolerances, infinities,
// initial values of max-reductions) treats them like float and double.
namespace std {
template <>
struct numeric_limits<weft::bf16> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr std::float_denorm_style has_denorm = std::denorm_present;
  static constexpr bool has_denorm_loss = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr bool is_iec559 = false;  // not an IEEE 754 interchange format
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr int digits = 8;
  static constexpr int digits10 = 2;
  static constexpr int max_digits10 = 4;
  static constexpr int radix = 2;
  static constexpr int min_exponent = -125;
  static constexpr int min_exponent10 = -37;
  static constexpr int max_exponent = 128;
  static constexpr int max_exponent10 = 38;
  static constexpr bool traps = false;
  static constexpr bool tinyness_before = false;
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 min() noexcept { return weft::bf16::from_bits(0x0080); }         // 2^-126
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 lowest() noexcept { return weft::bf16::from_bits(0xff7f); }      // -(2 - 2^-7) 2^127
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 max() noexcept { return weft::bf16::from_bits(0x7f7f); }         // (2 - 2^-7) 2^127
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 epsilon() noexcept { return weft::bf16::from_bits(0x3c00); }     // 2^-7
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 round_error() noexcept { return weft::bf16::from_bits(0x3f00); } // 0.5
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 infinity() noexcept { return weft::bf16::from_bits(0x7f80); }
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 quiet_NaN() noexcept { return weft::bf16::from_bits(0x7fc0); }
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 signaling_NaN() noexcept { return weft::bf16::from_bits(0x7fa0); }
  KOKKOS_INLINE_FUNCTION static constexpr weft::bf16 denorm_min() noexcept { return weft::bf16::from_bits(0x0001); }  // 2^-133
};

template <>
struct numeric_limits<weft::fp16> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr std::float_denorm_style has_denorm = std::denorm_present;
  static constexpr bool has_denorm_loss = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr bool is_iec559 = true;  // IEEE 754 binary16
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr int digits = 11;
  static constexpr int digits10 = 3;
  static constexpr int max_digits10 = 5;
  static constexpr int radix = 2;
  static constexpr int min_exponent = -13;
  static constexpr int min_exponent10 = -4;
  static constexpr int max_exponent = 16;
  static constexpr int max_exponent10 = 4;
  static constexpr bool traps = false;
  static constexpr bool tinyness_before = false;
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 min() noexcept { return weft::fp16::from_bits(0x0400); }         // 2^-14
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 lowest() noexcept { return weft::fp16::from_bits(0xfbff); }      // -65504
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 max() noexcept { return weft::fp16::from_bits(0x7bff); }         // 65504
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 epsilon() noexcept { return weft::fp16::from_bits(0x1400); }     // 2^-10
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 round_error() noexcept { return weft::fp16::from_bits(0x3800); } // 0.5
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 infinity() noexcept { return weft::fp16::from_bits(0x7c00); }
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 quiet_NaN() noexcept { return weft::fp16::from_bits(0x7e00); }
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 signaling_NaN() noexcept { return weft::fp16::from_bits(0x7d00); }
  KOKKOS_INLINE_FUNCTION static constexpr weft::fp16 denorm_min() noexcept { return weft::fp16::from_bits(0x0001); }  // 2^-24
};
}  // namespace std
