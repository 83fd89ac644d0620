// Pipeline stage boundaries: which consecutive layers of a GPT each (virtual)
// stage runs. A GPT is cut into units -- the embedding, each block, the head
// (final norm + LM head) -- and a partition gives each stage a non-empty run of
// consecutive units. `--stages auto|equal|L1,L2,...` picks one: auto minimises
// the slowest stage's measured time under a per-stage memory limit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>

namespace weft::pipeline {

/// Units of a GPT with `layers` blocks: 0 is the embedding, 1..layers the
/// blocks, layers + 1 the head (final norm and LM head).
constexpr std::size_t unit_count(std::size_t layers) { return layers + 2; }

/// Stage s runs units [bounds[s], bounds[s+1]); bounds[0] = 0 and
/// bounds.back() = unit_count(layers). Every stage has at least one unit.
struct StagePartition {
  std::vector<std::size_t> bounds;

  /// Number of stages.
  std::size_t stages() const { return bounds.empty() ? 0 : bounds.size() - 1; }
  /// First unit of stage s.
  std::size_t begin(std::size_t s) const { return bounds.at(s); }
  /// One past the last unit of stage s.
  std::size_t end(std::size_t s) const { return bounds.at(s + 1); }
  /// Blocks of stage s, as the counts `--stages L1,L2,...` would give.
  std::size_t blocks(std::size_t s, std::size_t layers) const {
    std::size_t n = 0;
    for (std::size_t u = begin(s); u < end(s); ++u) n += (u >= 1 && u <= layers) ? 1 : 0;
    return n;
  }
  /// "L1,L2,..." (blocks per stage; the embedding goes with the first stage, the head with the last).
  std::string to_string(std::size_t layers) const {
    std::string s;
    for (std::size_t i = 0; i < stages(); ++i) {
      if (i) s += ',';
      s += std::to_string(blocks(i, layers));
    }
    return s;
  }
  friend bool operator==(const StagePartition&, const StagePartition&) = default;
};

/// What `--stages` asked for.
struct StageSpec {
  enum class Kind { automatic, equal, explicit_counts } kind = Kind::equal;
  std::vector<std::size_t> counts;  ///< blocks per stage (explicit_counts only)
};

/// Parses `--stages auto|equal|L1,L2,...`; a ConfigError names the value.
inline StageSpec parse_stage_spec(std::string_view v) {
  StageSpec s;
  if (v == "auto") {
    s.kind = StageSpec::Kind::automatic;
    return s;
  }
  if (v == "equal") return s;
  s.kind = StageSpec::Kind::explicit_counts;
  std::size_t start = 0;
  while (start <= v.size()) {
    const std::size_t end = std::min(v.find(',', start), v.size());
    const std::string item(v.substr(start, end - start));
    std::size_t pos = 0;
    long long x = -1;
    try {
      x = std::stoll(item, &pos);
    } catch (...) {
      pos = 0;
    }
    WEFT_REQUIRE(!item.empty() && pos == item.size() && x >= 0, ConfigError, "--stages ", v, ": '", item,
                 "' is not a block count; expected auto, equal, or non-negative block counts per stage such as 3,3,2");
    s.counts.push_back(std::size_t(x));
    start = end + 1;
  }
  return s;
}

/// Blocks split as evenly as possible (earlier stages take the remainder),
/// the embedding with the first stage and the head with the last. With more
/// stages than blocks, the units themselves (embedding, blocks, head) are
/// split as evenly as possible instead.
inline StagePartition equal_partition(std::size_t layers, std::size_t stages) {
  const std::size_t n = unit_count(layers);
  WEFT_REQUIRE(stages >= 1 && stages <= n, ConfigError, "pipeline stages: ", stages, " stages for ", layers,
               " blocks plus embedding and head; expected between 1 and ", n, " (each stage needs at least one layer)");
  StagePartition p;
  p.bounds.push_back(0);
  if (stages <= layers) {
    std::size_t u = 1;  // after the embedding
    for (std::size_t s = 0; s < stages; ++s) {
      u += layers / stages + (s < layers % stages ? 1 : 0);
      p.bounds.push_back(s + 1 == stages ? n : u);
    }
    return p;
  }
  std::size_t u = 0;
  for (std::size_t s = 0; s < stages; ++s) {
    u += n / stages + (s < n % stages ? 1 : 0);
    p.bounds.push_back(u);
  }
  return p;
}

/// The partition of explicit block counts per stage (sum = layers); the
/// embedding goes with the first stage and the head with the last. A stage
/// between them needs at least one block.
inline StagePartition partition_from_counts(std::size_t layers, const std::vector<std::size_t>& counts) {
  std::size_t sum = 0;
  for (auto c : counts) sum += c;
  std::ostringstream given;
  for (std::size_t i = 0; i < counts.size(); ++i) given << (i ? "," : "") << counts[i];
  WEFT_REQUIRE(sum == layers, ConfigError, "--stages ", given.str(), ": the block counts add up to ", sum, ", but the model has ",
               layers, " blocks (--layers); give counts that add up to ", layers);
  StagePartition p;
  p.bounds.push_back(0);
  std::size_t u = 1;
  for (std::size_t s = 0; s < counts.size(); ++s) {
    const bool first = s == 0, last = s + 1 == counts.size();
    WEFT_REQUIRE(counts[s] > 0 || first || last, ConfigError, "--stages ", given.str(), ": stage ", s,
                 " has no blocks; only the first stage (which holds the embedding) and the last (the head) may");
    u += counts[s];
    p.bounds.push_back(last ? unit_count(layers) : u);
  }
  return p;
}

/// Measured cost of one unit (see unit_count): the time of its forward and
/// backward on one microbatch, and the bytes a stage holding it needs
/// (parameters, gradients, optimizer state and in-flight activations).
struct UnitCost {
  double seconds = 0;
  double bytes = 0;
};

/// The partition of units into `stages` contiguous non-empty stages whose
/// slowest stage (sum of its units' seconds) is as fast as possible, among
/// those whose every stage needs at most `memory_limit` bytes (<= 0: no
/// limit). Exact (dynamic programming over cut points); among equally fast
/// partitions the one whose later stages are shorter wins. Throws ConfigError when no
/// partition fits the limit, naming the smallest limit that would.
inline StagePartition balanced_partition(const std::vector<UnitCost>& units, std::size_t stages, double memory_limit = 0) {
  const std::size_t n = units.size();
  WEFT_REQUIRE(stages >= 1 && stages <= n, ConfigError, "pipeline stages: ", stages, " stages for ", n,
               " layers (embedding, blocks, head); expected between 1 and ", n);
  std::vector<double> t(n + 1, 0), m(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    t[i + 1] = t[i] + units[i].seconds;
    m[i + 1] = m[i] + units[i].bytes;
  }
  const double inf = std::numeric_limits<double>::infinity();
  auto fits = [&](std::size_t a, std::size_t b) { return memory_limit <= 0 || m[b] - m[a] <= memory_limit; };
  // best[s][j]: the slowest stage of the best split of units [0, j) into s stages.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> cut(stages + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t s = 1; s <= stages; ++s)
    for (std::size_t j = s; j <= n; ++j)
      for (std::size_t i = j; i-- > s - 1;) {  // later cut points first: later stages shorter on ties
        if (best[s - 1][i] == inf || !fits(i, j)) continue;
        const double v = std::max(best[s - 1][i], t[j] - t[i]);
        if (v < best[s][j]) {
          best[s][j] = v;
          cut[s][j] = i;
        }
      }
  if (best[stages][n] == inf) {
    // The smallest limit that admits some partition: the best min-max of memory.
    std::vector<UnitCost> mem(units);
    for (auto& u : mem) u.seconds = u.bytes;
    const StagePartition q = balanced_partition(mem, stages, 0);
    double need = 0;
    for (std::size_t s = 0; s < stages; ++s) need = std::max(need, m[q.end(s)] - m[q.begin(s)]);
    detail::throw_error<ConfigError>("pipeline stages: no split of ", n, " layers into ", stages,
                                     " stages fits the memory limit of ", memory_limit / 1048576.0,
                                     " MiB per stage; the smallest limit that fits is ", need / 1048576.0,
                                     " MiB. Raise the limit or use more stages.");
  }
  StagePartition p;
  p.bounds.assign(stages + 1, 0);
  p.bounds[stages] = n;
  for (std::size_t s = stages, j = n; s > 0; --s) {
    j = cut[s][j];
    p.bounds[s - 1] = j;
  }
  return p;
}

/// The slowest stage's time under costs `units`.
inline double slowest_stage(const StagePartition& p, const std::vector<UnitCost>& units) {
  double worst = 0;
  for (std::size_t s = 0; s < p.stages(); ++s) {
    double t = 0;
    for (std::size_t u = p.begin(s); u < p.end(s); ++u) t += units.at(u).seconds;
    worst = std::max(worst, t);
  }
  return worst;
}

}  // namespace weft::pipeline
