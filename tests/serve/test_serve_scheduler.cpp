// The serving scheduler as a pure function, with no model: decodes go before
// prompt chunks, the token budget and the sequence limit hold, the youngest
// sequence is preempted when blocks run out, arrival order is kept, static
// batching admits only into an empty batch; and a simulation of many
// requests through the scheduler alone completes every one of them without
// ever allocating a block that is not free. Also the block allocator and the
// sampler.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "weft_test.hpp"

namespace {

using namespace weft::serve;

StepLimits limits(std::size_t budget, std::size_t seqs, std::size_t bs = 4) {
  StepLimits l;
  l.token_budget = budget;
  l.max_seqs = seqs;
  l.block_size = bs;
  return l;
}

// splitmix64: independent 64-bit draws from a seed, for the length distributions' draw().
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t operator()() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

}  // namespace

TEST_CASE("scheduler: decodes first, then a prompt chunked into the rest of the budget") {
  QueueState q;
  q.running = {{0, 9, 8, 2}, {1, 5, 4, 1}};  // two decodes (one needs a new block: 4 -> 5 tokens at bs 4)
  q.waiting = {{2, 30, 0, 0}};
  q.free_blocks = 20;
  const StepPlan p = schedule(q, limits(10, 8));
  REQUIRE(p.batch.size() == 3);
  CHECK(p.batch[0].id == 0);
  CHECK(p.batch[0].count == 1);
  CHECK(p.batch[0].new_blocks == 1);  // 9 tokens need 3 blocks, it holds 2
  CHECK(p.batch[0].samples);
  CHECK(p.batch[1].id == 1);
  CHECK(p.batch[1].new_blocks == 1);
  CHECK(p.batch[2].id == 2);
  CHECK(p.batch[2].count == 8);  // 10 - 2 decodes
  CHECK(p.batch[2].first == 0);
  CHECK(!p.batch[2].samples);     // 22 prompt tokens still to go
  CHECK(p.batch[2].new_blocks == 2);
  CHECK(p.admitted == std::vector<std::uint64_t>{2});
  CHECK(p.tokens == 10);
  CHECK(p.blocks_after == 16);
  // A pure function: the same state gives the same plan.
  const StepPlan again = schedule(q, limits(10, 8));
  CHECK(again.tokens == p.tokens);
  CHECK(again.batch.size() == p.batch.size());
}

TEST_CASE("scheduler: the sequence limit and first come, first served") {
  QueueState q;
  q.running = {{0, 3, 2, 1}};
  q.waiting = {{1, 100, 0, 0}, {2, 2, 0, 0}, {3, 2, 0, 0}};
  q.free_blocks = 3;  // request 1's prompt chunk takes them all
  const StepPlan p = schedule(q, limits(64, 3));
  // Request 1 gets 12 tokens (3 free blocks of 4); 2 and 3 must not overtake it.
  REQUIRE(p.batch.size() == 2);
  CHECK(p.batch[1].id == 1);
  CHECK(p.batch[1].count == 12);
  CHECK(p.admitted == std::vector<std::uint64_t>{1});
  q.free_blocks = 100;
  const StepPlan r = schedule(q, limits(64, 2));
  CHECK(r.admitted == std::vector<std::uint64_t>{1});  // max_seqs 2: one running + one admitted
}

TEST_CASE("scheduler: when blocks run out the youngest is preempted, the oldest never") {
  QueueState q;
  // Three decodes at a block boundary (8 tokens in 2 full blocks each), no free block.
  q.running = {{5, 9, 8, 2}, {7, 9, 8, 2}, {6, 9, 8, 2}};
  q.waiting = {{9, 4, 0, 0}};
  q.free_blocks = 0;
  const StepPlan p = schedule(q, limits(16, 8));
  // 5 needs a block: 7 (youngest) is preempted, freeing 2; 5 takes one, 6 takes the other.
  CHECK(p.preempted == std::vector<std::uint64_t>{7});
  REQUIRE(p.batch.size() == 2);
  CHECK(p.batch[0].id == 5);
  CHECK(p.batch[1].id == 6);
  CHECK(p.admitted.empty());  // no admission while preempting
  CHECK(p.blocks_after == 0);
  // A lone sequence that cannot grow is preempted itself rather than overrunning the pool.
  QueueState one;
  one.running = {{3, 5, 4, 1}};
  one.free_blocks = 0;
  const StepPlan s = schedule(one, limits(16, 8));
  CHECK(s.preempted == std::vector<std::uint64_t>{3});
  CHECK(s.batch.empty());
}

TEST_CASE("scheduler: a running prompt shrinks its chunk to the free blocks before anyone is preempted") {
  QueueState q;
  q.running = {{0, 9, 8, 2}, {1, 40, 8, 2}};  // a decode at a block boundary, then a prompt 8 tokens in
  q.free_blocks = 3;
  const StepPlan p = schedule(q, limits(64, 8));
  CHECK(p.preempted.empty());
  REQUIRE(p.batch.size() == 2);
  CHECK(p.batch[0].new_blocks == 1);
  CHECK(p.batch[1].count == 8);  // 2 blocks left: 8 of its 32 remaining prompt tokens
  CHECK(p.batch[1].new_blocks == 2);
  CHECK(!p.batch[1].samples);
  CHECK(p.blocks_after == 0);
  // With no block at all the younger one gives its blocks back instead.
  q.free_blocks = 0;
  q.running = {{0, 9, 8, 2}, {1, 12, 8, 2}};
  const StepPlan r = schedule(q, limits(64, 8));
  CHECK(r.preempted == std::vector<std::uint64_t>{1});
  REQUIRE(r.batch.size() == 1);
  CHECK(r.batch[0].id == 0);
}

TEST_CASE("scheduler: static batching admits only into an empty batch") {
  QueueState q;
  q.running = {{0, 9, 8, 2}};
  q.waiting = {{1, 4, 0, 0}};
  q.free_blocks = 10;
  StepLimits l = limits(64, 8);
  l.batching = Batching::static_batch;
  CHECK(schedule(q, l).admitted.empty());
  q.running.clear();
  q.waiting = {{1, 40, 0, 0}, {2, 40, 0, 0}, {3, 4, 0, 0}};
  q.free_blocks = 20;
  l.token_budget = 48;
  const StepPlan p = schedule(q, l);
  // The whole batch is formed now; 2 gets the 8 tokens left, 3 none yet.
  CHECK(p.admitted == std::vector<std::uint64_t>{1, 2, 3});
  REQUIRE(p.batch.size() == 2);
  CHECK(p.batch[1].count == 8);
}

TEST_CASE("scheduler: a simulation of 60 requests through the scheduler alone completes all of them") {
  for (Batching mode : {Batching::continuous, Batching::static_batch}) {
    const StepLimits l{24, 5, 4, mode};
    const std::size_t pool = 20;  // 80 tokens: requests of up to 40 tokens contend
    struct Sim {
      SeqState s;
      std::size_t target;
      bool running = false;
    };
    std::vector<Sim> all;
    std::uint64_t x = 99;
    for (std::uint64_t i = 0; i < 60; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const std::size_t prompt = 1 + (x >> 33) % 30, gen = 1 + (x >> 45) % 10;
      all.push_back({{i, prompt, 0, 0}, prompt + gen});
    }
    std::size_t free = pool, steps = 0, done = 0, preempted = 0;
    std::vector<bool> finished(all.size(), false);
    while (done < all.size()) {
      REQUIRE(++steps < 5000);
      QueueState q;
      q.free_blocks = free;
      for (auto& a : all) {
        if (finished[a.s.id]) continue;
        (a.running ? q.running : q.waiting).push_back(a.s);
      }
      const StepPlan p = schedule(q, l);
      REQUIRE(p.tokens <= l.token_budget);
      for (auto id : p.preempted) {
        free += all[id].s.blocks;
        all[id].s.blocks = 0;
        all[id].s.computed = 0;
        all[id].running = false;
        ++preempted;
      }
      for (auto id : p.admitted) all[id].running = true;
      std::size_t running = 0;
      for (auto& a : all) running += a.running && !finished[a.s.id];
      REQUIRE(running <= l.max_seqs);
      for (const auto& e : p.batch) {
        auto& a = all[e.id];
        REQUIRE(a.running);
        REQUIRE(e.first == a.s.computed);
        REQUIRE(e.new_blocks <= free);  // never more blocks than are free
        free -= e.new_blocks;
        a.s.blocks += e.new_blocks;
        a.s.computed += e.count;
        REQUIRE(a.s.blocks * l.block_size >= a.s.computed);
      }
      REQUIRE(free == p.blocks_after);
      for (const auto& e : p.batch) {
        auto& a = all[e.id];
        if (!e.samples) continue;
        ++a.s.known;  // the sampled token
        if (a.s.known == a.target) {
          finished[e.id] = true;
          a.running = false;
          free += a.s.blocks;
          a.s.blocks = 0;
          ++done;
        }
      }
    }
    CHECK(free == pool);
    if (mode == Batching::continuous) CHECK(preempted > 0);  // the pool is small enough to force some
  }
}

TEST_CASE("block allocator: never hands out a block that is not free") {
  BlockAllocator a(3);
  std::vector<int> t1, t2;
  a.allocate(2, t1);
  CHECK(a.free() == 1);
  CHECK(weft::test::contains(weft::test::error_text([&] { a.allocate(2, t2); }), "2 blocks requested but only 1 of 3"));
  CHECK(t2.empty());
  a.release(t1);
  CHECK(a.free() == 3);
  std::vector<int> bogus{1};
  CHECK(weft::test::contains(weft::test::error_text([&] { a.release(bogus); }), "released but not held"));
}

TEST_CASE("sampler: greedy, top-k and seeded sampling") {
  const std::vector<float> l{0.5f, 2.0f, 2.0f, -1.0f, 1.9f};
  CHECK(greedy_token(l.data(), l.size()) == 1);  // the lowest id of a tie
  SamplingParams k1{1.0, 1, 7};
  for (std::size_t i = 0; i < 20; ++i) CHECK(sample_token(l.data(), l.size(), k1, 3, i) == 1);
  SamplingParams k3{1.0, 3, 7};
  std::map<int, int> seen;
  for (std::size_t i = 0; i < 300; ++i) {
    const int t = sample_token(l.data(), l.size(), k3, 3, i);
    ++seen[t];
    CHECK(t == sample_token(l.data(), l.size(), k3, 3, i));  // the same (seed, request, index): the same token
  }
  CHECK(seen.size() == 3);  // ids 1, 2 and 4, never 0 or 3
  CHECK(seen.count(0) == 0);
  CHECK(seen.count(3) == 0);
  CHECK(seen[1] > 60);
  CHECK(seen[4] > 60);
  SamplingParams other{1.0, 3, 8};
  int differ = 0;
  for (std::size_t i = 0; i < 50; ++i)
    differ += sample_token(l.data(), l.size(), k3, 3, i) != sample_token(l.data(), l.size(), other, 3, i);
  CHECK(differ > 5);  // another seed, another stream
}

TEST_CASE("traffic lengths: uniform and exponential stay in range and have the stated mean") {
  SplitMix64 next{0x9e3779b97f4a7c15ull};
  const LengthDist uni{8, 160, LengthShape::uniform, 0};
  const LengthDist tail{8, 400, LengthShape::exponential, 48};
  CHECK(uni.mean() == doctest::Approx(84.0));
  CHECK(uni.draw(0) == 8);
  CHECK(uni.draw(152) == 160);
  CHECK(uni.draw(153) == 8);
  CHECK(LengthDist{5, 5, LengthShape::exponential, 3}.draw(next()) == 5);
  // The exponential's extremes: u near 0 gives lo, u near 1 gives hi.
  CHECK(tail.draw(0) == 8);
  CHECK(tail.draw(~std::uint64_t(0)) == 400);
  const int n = 200000;
  double su = 0, st = 0;
  std::size_t lo_u = 1000, hi_u = 0, lo_t = 1000, hi_t = 0, short_t = 0;
  for (int i = 0; i < n; ++i) {
    const std::size_t a = uni.draw(next()), b = tail.draw(next());
    su += double(a);
    st += double(b);
    lo_u = std::min(lo_u, a), hi_u = std::max(hi_u, a), lo_t = std::min(lo_t, b), hi_t = std::max(hi_t, b);
    short_t += b < 8 + 48;
  }
  CHECK(lo_u == 8);
  CHECK(hi_u == 160);
  CHECK(lo_t == 8);
  CHECK(hi_t <= 400);
  CHECK(hi_t > 300);  // the tail is there
  CHECK(su / n == doctest::Approx(uni.mean()).epsilon(0.01));
  CHECK(st / n == doctest::Approx(tail.mean()).epsilon(0.01));
  // Mean of the floored excess of Exp(48): 1 / (e^(1/48) - 1) = 47.5, barely truncated at 392.
  CHECK(tail.mean() == doctest::Approx(8 + 47.5).epsilon(0.002));
  // P(excess < scale) = 1 - 1/e under (almost) no truncation.
  CHECK(double(short_t) / n == doctest::Approx(1 - std::exp(-1.0)).epsilon(0.01));
  CHECK(tail.effective_scale() == 48);
  CHECK(LengthDist{0, 100, LengthShape::exponential, 0}.effective_scale() == 25);
}

TEST_CASE("traffic lengths: the log-normal stays in range, has its median and the stated mean") {
  SplitMix64 next{0x2545f4914f6cdd1dull};
  const LengthDist ln{4, 516, LengthShape::lognormal, 16, 1.5};
  CHECK(std::string(ln.shape_name()) == "lognormal");
  CHECK(ln.draw(0) == 4);
  CHECK(ln.draw(~std::uint64_t(0)) == 516);
  const int n = 200000;
  double sum = 0;
  std::size_t lo = 1000, hi = 0, below_median = 0, over_8x = 0;
  for (int i = 0; i < n; ++i) {
    const std::size_t b = ln.draw(next());
    sum += double(b);
    lo = std::min(lo, b), hi = std::max(hi, b);
    below_median += b < 4 + 16;
    over_8x += b >= 4 + 128;
  }
  CHECK(lo == 4);
  CHECK(hi <= 516);
  CHECK(hi > 450);
  CHECK(sum / n == doctest::Approx(ln.mean()).epsilon(0.01));
  // P(X < 16) = 1/2 before truncation; the truncation at 513 removes
  // P(X > 513) = P(Z > ln(513/16)/1.5) = 0.0104 of the mass.
  CHECK(double(below_median) / n == doctest::Approx(0.5 / (1 - 0.0104)).epsilon(0.01));
  // The heavy tail: P(X >= 8 x median) = P(Z >= ln 8 / 1.5) = 0.0828 before
  // truncation (an exponential of the same mean would give 2e-4).
  CHECK(double(over_8x) / n == doctest::Approx((0.0828 - 0.0104) / (1 - 0.0104)).epsilon(0.03));
  // Barely truncated, the mean is the log-normal's, median x e^(sigma^2 / 2):
  // 16 e^0.5 = 26.38 for sigma 1, less about half a token for the floor.
  CHECK(LengthDist{0, 200000, LengthShape::lognormal, 16, 1.0}.mean() == doctest::Approx(26.38 - 0.5).epsilon(0.003));
  CHECK(LengthDist{0, 800, LengthShape::lognormal, 0}.effective_scale() == 100);
  CHECK_THROWS_AS(LengthDist({1, 8, LengthShape::lognormal, 2, 0.0}).validate("--output-sigma"), weft::ConfigError);
}

TEST_CASE("traffic lengths: bad ranges and shapes are refused") {
  CHECK_THROWS_AS(LengthDist({9, 8, LengthShape::uniform, 0}).validate("--output-len"), weft::ConfigError);
  CHECK_THROWS_AS(LengthDist({1, 8, LengthShape::exponential, -1}).validate("--output-scale"), weft::ConfigError);
  CHECK_THROWS_WITH_AS(parse_length_shape("--output-dist", "gaussian"), doctest::Contains("uniform, exponential or lognormal"),
                       weft::ConfigError);
  CHECK(parse_length_shape("--output-dist", "exponential") == LengthShape::exponential);
  CHECK(parse_length_shape("--output-dist", "lognormal") == LengthShape::lognormal);
}
