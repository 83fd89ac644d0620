// CommStats: what every communication call cost -- calls, bytes, wall time and,
// for non-blocking calls, the time a rank actually spent waiting (exposed time).
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>

namespace weft {

/// The kinds of communication weft counts.
enum class CommKind : int {
  all_reduce,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_to_allv,
  broadcast,
  send,
  recv,
  sendrecv,
  barrier,
  count_
};

/// Number of CommKind values.
inline constexpr int comm_kind_count = static_cast<int>(CommKind::count_);

/// The snake_case name of a kind, e.g. "all_reduce".
constexpr std::string_view to_string(CommKind k) {
  constexpr std::array<std::string_view, comm_kind_count> names{
      "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_allv",
      "broadcast",  "send",       "recv",           "sendrecv",   "barrier"};
  return names[static_cast<int>(k)];
}

/// Totals of one kind. Bytes follow the convention of nccl-tests' "size": the
/// full buffer a rank holds -- all_reduce and broadcast: the buffer;
/// all_gather: the gathered output; reduce_scatter: the full input;
/// all_to_all(v): the send buffer; send/recv: the message; sendrecv: sent bytes.
struct KindStats {
  std::uint64_t calls = 0;        ///< completed calls
  std::uint64_t bytes = 0;        ///< bytes, by the convention above
  double seconds = 0.0;           ///< wall time from start to completion
  double exposed_seconds = 0.0;   ///< time the caller was blocked (all of it for blocking calls)

  KindStats& operator+=(const KindStats& o) {
    calls += o.calls;
    bytes += o.bytes;
    seconds += o.seconds;
    exposed_seconds += o.exposed_seconds;
    return *this;
  }
};

/// Per-kind totals of one communicator.
class CommStats {
 public:
  /// Adds one completed call.
  void record(CommKind k, std::uint64_t bytes, double seconds, double exposed_seconds) {
    auto& s = per_kind_[static_cast<int>(k)];
    s.calls += 1;
    s.bytes += bytes;
    s.seconds += seconds;
    s.exposed_seconds += exposed_seconds;
  }
  /// Totals of one kind.
  const KindStats& operator[](CommKind k) const { return per_kind_[static_cast<int>(k)]; }
  /// Totals over all kinds.
  KindStats total() const {
    KindStats t;
    for (const auto& s : per_kind_) t += s;
    return t;
  }
  /// Forgets everything recorded so far.
  void reset() { per_kind_ = {}; }

  /// Adds another communicator's totals to this one.
  CommStats& operator+=(const CommStats& o) {
    for (int i = 0; i < comm_kind_count; ++i) per_kind_[i] += o.per_kind_[i];
    return *this;
  }

  /// One table row per kind with calls, labelled with the axis name.
  void print(std::ostream& os, std::string_view axis) const {
    char line[200];
    for (int i = 0; i < comm_kind_count; ++i) {
      const auto& s = per_kind_[i];
      if (s.calls == 0) continue;
      std::snprintf(line, sizeof line, "%-10.*s %-15.*s %10llu %14llu %12.6f %12.6f\n",
                    static_cast<int>(axis.size()), axis.data(),
                    static_cast<int>(to_string(static_cast<CommKind>(i)).size()),
                    to_string(static_cast<CommKind>(i)).data(), static_cast<unsigned long long>(s.calls),
                    static_cast<unsigned long long>(s.bytes), s.seconds, s.exposed_seconds);
      os << line;
    }
  }
  /// Header line matching print().
  static void print_header(std::ostream& os) {
    os << "axis       kind                 calls          bytes      seconds      exposed\n";
  }

  /// {"all_reduce": {"calls":..,"bytes":..,"seconds":..,"exposed_seconds":..}, ...} (kinds with calls only).
  std::string to_json() const {
    std::string out = "{";
    bool first = true;
    char buf[256];
    for (int i = 0; i < comm_kind_count; ++i) {
      const auto& s = per_kind_[i];
      if (s.calls == 0) continue;
      std::snprintf(buf, sizeof buf, "%s\"%.*s\": {\"calls\": %llu, \"bytes\": %llu, \"seconds\": %.9g, \"exposed_seconds\": %.9g}",
                    first ? "" : ", ", static_cast<int>(to_string(static_cast<CommKind>(i)).size()),
                    to_string(static_cast<CommKind>(i)).data(), static_cast<unsigned long long>(s.calls),
                    static_cast<unsigned long long>(s.bytes), s.seconds, s.exposed_seconds);
      out += buf;
      first = false;
    }
    return out + "}";
  }

 private:
  std::array<KindStats, comm_kind_count> per_kind_{};
};

}  // namespace weft
