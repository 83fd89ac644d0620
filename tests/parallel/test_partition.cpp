// Pipeline stage boundaries on given costs: the balanced partition is the
// exact min-max (checked against every partition by enumeration), respects
// the memory limit, and names the limit that would fit when none does;
// `--stages` specifications parse and are checked.
#include <algorithm>
#include <functional>
#include <limits>
#include <vector>

#include <weft/parallel/pipeline/partition.hpp>

#include "weft_test.hpp"

using weft::pipeline::StagePartition;
using weft::pipeline::UnitCost;

namespace {

// Every partition of n units into s non-empty stages.
void each_partition(std::size_t n, std::size_t s, const std::function<void(const StagePartition&)>& f) {
  StagePartition p;
  p.bounds = {0};
  std::function<void(std::size_t)> rec = [&](std::size_t left) {
    const std::size_t at = p.bounds.back();
    if (left == 1) {
      p.bounds.push_back(n);
      f(p);
      p.bounds.pop_back();
      return;
    }
    for (std::size_t e = at + 1; e + left - 1 <= n; ++e) {
      p.bounds.push_back(e);
      rec(left - 1);
      p.bounds.pop_back();
    }
  };
  rec(s);
}

double stage_sum(const StagePartition& p, const std::vector<UnitCost>& u, std::size_t s, bool bytes) {
  double t = 0;
  for (std::size_t i = p.begin(s); i < p.end(s); ++i) t += bytes ? u[i].bytes : u[i].seconds;
  return t;
}

}  // namespace

TEST_CASE("partition: a heavy embedding and head move blocks to the middle stages") {
  // Embedding and head each cost as much as three blocks.
  std::vector<UnitCost> u = {{3, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {3, 1}};
  const auto p = weft::pipeline::balanced_partition(u, 2);
  CHECK(weft::pipeline::slowest_stage(p, u) == doctest::Approx(6));
  const auto e = weft::pipeline::equal_partition(6, 4);
  const auto b = weft::pipeline::balanced_partition(u, 4);
  CHECK(weft::pipeline::slowest_stage(b, u) == doctest::Approx(3));  // emb | 3 blocks | 3 blocks | head
  CHECK(weft::pipeline::slowest_stage(e, u) == doctest::Approx(5));  // emb + 2 blocks first
  CHECK(b.to_string(6) == "0,3,3,0");
}

TEST_CASE("partition: the balanced partition is the exact min-max under the memory limit") {
  std::vector<std::vector<UnitCost>> cases = {
      {{0.5, 4}, {2, 1}, {1, 3}, {1, 1}, {4, 1}, {0.25, 2}, {1, 1}, {2, 5}, {1.5, 1}},
      {{1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}},
      {{9, 1}, {1, 9}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {9, 9}},
  };
  for (const auto& u : cases)
    for (std::size_t s = 1; s <= u.size(); ++s)
      for (double limit : {0.0, 6.0, 10.0}) {
        double best = std::numeric_limits<double>::infinity();
        each_partition(u.size(), s, [&](const StagePartition& p) {
          for (std::size_t k = 0; k < s; ++k)
            if (limit > 0 && stage_sum(p, u, k, true) > limit) return;
          best = std::min(best, weft::pipeline::slowest_stage(p, u));
        });
        CAPTURE(s);
        CAPTURE(limit);
        if (best == std::numeric_limits<double>::infinity()) {
          CHECK_THROWS_WITH_AS(weft::pipeline::balanced_partition(u, s, limit),
                               doctest::Contains("the smallest limit that fits is"), weft::ConfigError);
          continue;
        }
        const auto p = weft::pipeline::balanced_partition(u, s, limit);
        REQUIRE(p.stages() == s);
        CHECK(p.bounds.front() == 0);
        CHECK(p.bounds.back() == u.size());
        for (std::size_t k = 0; k < s; ++k) {
          CHECK(p.end(k) > p.begin(k));
          if (limit > 0) CHECK(stage_sum(p, u, k, true) <= limit);
        }
        CHECK(weft::pipeline::slowest_stage(p, u) == doctest::Approx(best));
      }
}

TEST_CASE("partition: equal and explicit partitions, and --stages parsing") {
  using weft::pipeline::partition_from_counts;
  const auto e = weft::pipeline::equal_partition(8, 3);
  CHECK(e.bounds == std::vector<std::size_t>{0, 4, 7, 10});
  CHECK(e.to_string(8) == "3,3,2");
  // More stages than blocks: the units themselves are split.
  const auto u = weft::pipeline::equal_partition(2, 4);
  CHECK(u.bounds == std::vector<std::size_t>{0, 1, 2, 3, 4});
  CHECK(partition_from_counts(8, {2, 4, 2}).bounds == std::vector<std::size_t>{0, 3, 7, 10});
  CHECK(partition_from_counts(4, {0, 4, 0}).bounds == std::vector<std::size_t>{0, 1, 5, 6});
  CHECK_THROWS_WITH_AS(partition_from_counts(8, {3, 3}), doctest::Contains("add up to 6, but the model has 8 blocks"),
                       weft::ConfigError);
  CHECK_THROWS_WITH_AS(partition_from_counts(4, {2, 0, 2}), doctest::Contains("stage 1 has no blocks"), weft::ConfigError);
  CHECK(weft::pipeline::parse_stage_spec("auto").kind == weft::pipeline::StageSpec::Kind::automatic);
  CHECK(weft::pipeline::parse_stage_spec("equal").kind == weft::pipeline::StageSpec::Kind::equal);
  const auto s = weft::pipeline::parse_stage_spec("3,0,5");
  CHECK(s.kind == weft::pipeline::StageSpec::Kind::explicit_counts);
  CHECK(s.counts == std::vector<std::size_t>{3, 0, 5});
  CHECK_THROWS_WITH_AS(weft::pipeline::parse_stage_spec("3,x"), doctest::Contains("'x' is not a block count"),
                       weft::ConfigError);
  CHECK_THROWS_WITH_AS(weft::pipeline::equal_partition(2, 5), doctest::Contains("expected between 1 and 4"),
                       weft::ConfigError);
}
