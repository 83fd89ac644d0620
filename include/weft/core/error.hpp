// weft's exception hierarchy and the WEFT_REQUIRE check. Every error a user can
// cause raises a weft::Error subclass whose message says what was wrong, the
// value seen, what was expected, and how to fix it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace weft {

/// Base of every exception weft throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A bad configuration: mesh sizes, extents, flags, options.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A tensor shape that does not fit: wrong sizes, indivisible dimensions,
/// non-contiguous views where contiguous ones are required.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// A file weft cannot read or write as it must: a missing, truncated,
/// corrupted or mismatched checkpoint (the message names the file and the
/// tensor), or a failed write.
class IoError : public Error {
 public:
  using Error::Error;
};

/// A failed communication: an MPI error, a collective whose ranks disagree, or
/// a deadline passed in checked mode. Carries the operation and the axis.
class CommError : public Error {
 public:
  /// How a wait past its deadline is reported in the job: every waiting rank
  /// raises one, and one rank of the node is elected to print it.
  enum class Deadline { no, report_here, reported_by_another_rank };

  CommError(std::string operation, std::string axis, const std::string& what, Deadline deadline = Deadline::no)
      : Error(what), operation_(std::move(operation)), axis_(std::move(axis)), deadline_(deadline) {}
  /// The weft operation that failed, e.g. "all_reduce".
  const std::string& operation() const noexcept { return operation_; }
  /// The name of the communicator's mesh axis (or axis group), e.g. "tp" or "dp*cp".
  const std::string& axis() const noexcept { return axis_; }
  /// Whether this is a wait past its deadline (the job cannot go on: a peer
  /// failed or hangs).
  bool deadline_passed() const noexcept { return deadline_ != Deadline::no; }
  /// True when another rank of this node was elected to print this failure
  /// (it names the same ranks): print nothing and end the job non-zero.
  bool reported_by_another_rank() const noexcept { return deadline_ == Deadline::reported_by_another_rank; }

 private:
  std::string operation_;
  std::string axis_;
  Deadline deadline_ = Deadline::no;
};

namespace detail {
template <class E, class... Parts>
[[noreturn]] void throw_error(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw E(os.str());
}
}  // namespace detail

}  // namespace weft

/// Throws ErrorType with the streamed message when cond is false:
///   WEFT_REQUIRE(n % k == 0, weft::ShapeError, "dim 0 has size ", n, ", not divisible by ", k);
#define WEFT_REQUIRE(cond, ErrorType, ...)                           \
  do {                                                               \
    if (!(cond)) ::weft::detail::throw_error<ErrorType>(__VA_ARGS__); \
  } while (false)
