// What weft's test files include: doctest, weft, and the MPI harness' helpers
// (the world communicator, the execution spaces every test body runs on).
#pragma once

#include <exception>
#include <string>

#include <doctest/doctest.h>

#include <weft/weft.hpp>

namespace weft::test {

/// weft's world communicator of the running test executable.
Comm& world();

/// The what() of the exception of type E (any std::exception by default)
/// that f() throws; "" when it throws none. Other exceptions propagate.
template <class E = std::exception, class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

/// Whether part occurs in s.
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace weft::test

// The execution spaces of this build: TEST_CASE_TEMPLATE bodies run on each.
#if defined(KOKKOS_ENABLE_CUDA)
#define WEFT_TEST_EXEC_SPACES Kokkos::DefaultHostExecutionSpace, Kokkos::Cuda
#elif defined(KOKKOS_ENABLE_HIP)
#define WEFT_TEST_EXEC_SPACES Kokkos::DefaultHostExecutionSpace, Kokkos::HIP
#elif defined(KOKKOS_ENABLE_OPENMP) && defined(KOKKOS_ENABLE_SERIAL)
#define WEFT_TEST_EXEC_SPACES Kokkos::Serial, Kokkos::OpenMP
#else
#define WEFT_TEST_EXEC_SPACES Kokkos::DefaultExecutionSpace
#endif
