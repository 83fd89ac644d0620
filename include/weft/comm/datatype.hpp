// Maps C++ element types to MPI datatypes at compile time. An element type with
// no MPI counterpart is a compile error that says which types are supported.
#pragma once

#include <mpi.h>

#include <complex>
#include <cstdint>
#include <type_traits>

#include <weft/core/half.hpp>

namespace weft {

namespace detail {
template <class T>
struct always_false : std::false_type {};
}  // namespace detail

/// mpi_datatype<T>::get() returns T's MPI datatype; name is T's spelling and
/// id a small integer used by the checked mode to compare element types.
template <class T>
struct mpi_datatype {
  static_assert(detail::always_false<T>::value,
                "weft::Comm: this element type has no MPI datatype. Supported element types: float, double, "
                "std::int8_t..std::int64_t, std::uint8_t..std::uint64_t, char, bool, std::complex<float>, "
                "std::complex<double>, weft::bf16, weft::fp16. Copy the data into a view of a supported type, or "
                "specialise weft::mpi_datatype<T> with get(), name and id.");
};

#define WEFT_DETAIL_DATATYPE(T, MPI_T, ID)                        \
  template <>                                                     \
  struct mpi_datatype<T> {                                        \
    static MPI_Datatype get() noexcept { return MPI_T; }          \
    static constexpr const char* name = #T;                       \
    static constexpr int id = ID;                                 \
  };
WEFT_DETAIL_DATATYPE(float, MPI_FLOAT, 1)
WEFT_DETAIL_DATATYPE(double, MPI_DOUBLE, 2)
WEFT_DETAIL_DATATYPE(std::int8_t, MPI_INT8_T, 3)
WEFT_DETAIL_DATATYPE(std::int16_t, MPI_INT16_T, 4)
WEFT_DETAIL_DATATYPE(std::int32_t, MPI_INT32_T, 5)
WEFT_DETAIL_DATATYPE(std::int64_t, MPI_INT64_T, 6)
WEFT_DETAIL_DATATYPE(std::uint8_t, MPI_UINT8_T, 7)
WEFT_DETAIL_DATATYPE(std::uint16_t, MPI_UINT16_T, 8)
WEFT_DETAIL_DATATYPE(std::uint32_t, MPI_UINT32_T, 9)
WEFT_DETAIL_DATATYPE(std::uint64_t, MPI_UINT64_T, 10)
WEFT_DETAIL_DATATYPE(char, MPI_CHAR, 11)
WEFT_DETAIL_DATATYPE(bool, MPI_CXX_BOOL, 12)
WEFT_DETAIL_DATATYPE(std::complex<float>, MPI_CXX_FLOAT_COMPLEX, 13)
WEFT_DETAIL_DATATYPE(std::complex<double>, MPI_CXX_DOUBLE_COMPLEX, 14)
// MPI has no bf16 or fp16 type: they travel as 2-byte integers, which moves
// their bits unchanged (copies, gathers, all-to-alls, point-to-point). The
// ids differ from std::uint16_t's so checked mode tells the three apart.
// Reductions would add the integers, not the values: see mpi_reducible_v.
WEFT_DETAIL_DATATYPE(weft::bf16, MPI_UINT16_T, 15)
WEFT_DETAIL_DATATYPE(weft::fp16, MPI_UINT16_T, 16)
#undef WEFT_DETAIL_DATATYPE

/// Whether MPI's reductions (MPI_SUM, MPI_MAX, MPI_MIN) on mpi_datatype<T>
/// compute on T's values. False for bf16 and fp16, whose MPI datatype is an
/// integer stand-in: Comm's reductions refuse them at compile time (reduce a
/// float copy instead, or use the precision policy's reduce type).
template <class T>
inline constexpr bool mpi_reducible_v = !is_reduced_precision_v<T>;

namespace detail {
// Comm's reductions call this: the refusal's text lives beside the mapping that causes it.
template <class T>
constexpr bool require_mpi_reducible() {
  static_assert(mpi_reducible_v<T>,
                "weft::Comm: a reduction (all_reduce, reduce_scatter) of weft::bf16 or weft::fp16 elements is "
                "refused: MPI has no 2-byte floating-point type, so they travel as 2-byte integers and MPI would add "
                "their bit patterns, not their values. Convert into a view of float (weft::convert), reduce that, "
                "and convert back");
  return true;
}
}  // namespace detail

/// Element types weft can communicate.
template <class T>
concept Communicable = requires { mpi_datatype<std::remove_cv_t<T>>::id; };

namespace detail {
inline const char* datatype_name_of_id(long id) {
  switch (id) {
    case 1: return "float";
    case 2: return "double";
    case 3: return "std::int8_t";
    case 4: return "std::int16_t";
    case 5: return "std::int32_t";
    case 6: return "std::int64_t";
    case 7: return "std::uint8_t";
    case 8: return "std::uint16_t";
    case 9: return "std::uint32_t";
    case 10: return "std::uint64_t";
    case 11: return "char";
    case 12: return "bool";
    case 13: return "std::complex<float>";
    case 14: return "std::complex<double>";
    case 15: return "weft::bf16";
    case 16: return "weft::fp16";
    default: return "(user type)";
  }
}
}  // namespace detail

}  // namespace weft
