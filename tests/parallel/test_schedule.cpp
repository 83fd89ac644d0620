// Pipeline schedules checked by the simulator: every plan runs without
// deadlock, every backward follows its forward, the activation memory is what
// the schedule promises and the idle fraction equals the analytic bubble.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>

#include <weft/parallel/pipeline/send_cap.hpp>

#include "weft_test.hpp"

using namespace weft;

namespace {

constexpr int stage_counts[] = {2, 3, 4, 8};
constexpr int microbatch_counts[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
const PipeCosts cost_sets[] = {{1, 1, 1, 0}, {1, 2, 1, 0}, {2, 1, 1, 0}, {1, 1, 0.5, 0}};

template <class Schedule>
bool valid(int p, int m) {
  try {
    Schedule::check(p, m);
    return true;
  } catch (const ConfigError&) {
    return false;
  }
}

// Simulates every valid (p, m, costs) and checks the schedule's promises.
template <class Schedule>
int check_all_configurations() {
  int checked = 0;
  for (int p : stage_counts)
    for (int m : microbatch_counts) {
      if (!valid<Schedule>(p, m)) continue;
      const Pipeline<Schedule> pipe(p, m);
      for (const PipeCosts& c : cost_sets) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(c.backward_input);
        const PipeSimulation sim = simulate_pipeline(pipe, c);
        CHECK(sim.idle_fraction() == doctest::Approx(pipe.bubble_fraction(c)).epsilon(1e-12));
        for (int r = 0; r < p; ++r) {
          CAPTURE(r);
          CHECK(sim.peak_in_flight[r] == pipe.peak_in_flight(r));
          CHECK(sim.busy[r] == doctest::Approx(Schedule::chunks * m * (c.forward + c.backward_input + c.backward_weight)));
        }
        ++checked;
      }
    }
  return checked;
}

}  // namespace

TEST_CASE("schedule: GPipe matches its bubble and holds every microbatch") {
  CHECK(check_all_configurations<GPipe>() == 4 * 10 * 4);
  // GPipe runs with fewer microbatches than stages, at a large bubble.
  const Pipeline<GPipe> pipe(8, 2);
  CHECK(pipe.bubble_fraction() == doctest::Approx(7.0 / 9.0));
  CHECK(simulate_pipeline(pipe).peak_in_flight[0] == 2);
}

TEST_CASE("schedule: 1F1B matches GPipe's bubble with p - r activations on rank r") {
  CHECK(check_all_configurations<OneFOneB>() > 50);
  const Pipeline<OneFOneB> pipe(4, 8);
  const auto sim = simulate_pipeline(pipe);
  CHECK(sim.peak_in_flight == std::vector<int>{4, 3, 2, 1});
  CHECK(sim.idle_fraction() == doctest::Approx(3.0 / 11.0));
  // Same bubble as GPipe, less memory: the point of 1F1B.
  const auto gpipe = simulate_pipeline(Pipeline<GPipe>(4, 8));
  CHECK(gpipe.makespan == doctest::Approx(sim.makespan));
  CHECK(gpipe.peak_in_flight[0] == 8);
}

TEST_CASE("schedule: interleaved 1F1B divides the bubble by V") {
  CHECK(check_all_configurations<Interleaved1F1B<2>>() > 30);
  CHECK(check_all_configurations<Interleaved1F1B<4>>() > 30);
  const Pipeline<Interleaved1F1B<2>> pipe(4, 8);
  CHECK(pipe.bubble_fraction() == doctest::Approx(3.0 / 19.0));
  const auto sim = simulate_pipeline(pipe);
  CHECK(sim.idle_fraction() == doctest::Approx(3.0 / 19.0));
  CHECK(sim.idle_fraction() < simulate_pipeline(Pipeline<OneFOneB>(4, 8)).idle_fraction());
  // Megatron's warm-up: 2(p-r-1) + (V-1)p chunk forwards before the first backward.
  CHECK(sim.peak_in_flight == std::vector<int>{11, 9, 7, 5});
  // Chunk 1 of rank 0 receives from the last rank's chunk 0.
  const auto plan = pipe.plan(0);
  const auto first_chunk1 = std::find_if(plan.begin(), plan.end(), [](const PipeAction& a) { return a.chunk == 1; });
  REQUIRE(first_chunk1 != plan.end());
  CHECK(*first_chunk1 == PipeAction{PipeOp::recv_activation, 0, 1, 3});
}

TEST_CASE("schedule: zero-bubble ZB-H1 fills the bubble with weight gradients") {
  CHECK(check_all_configurations<ZeroBubble>() > 50);
  // Unit costs: bubble (p-1)/(3m+p-1), a third of 1F1B's idle time.
  const Pipeline<ZeroBubble> zb(4, 8);
  const auto sim = simulate_pipeline(zb);
  CHECK(sim.idle_fraction() == doctest::Approx(3.0 / 27.0));
  const auto ofob = simulate_pipeline(Pipeline<OneFOneB>(4, 8));
  CHECK((sim.makespan * 4 - 4 * 8 * 3) * 3 == doctest::Approx(ofob.makespan * 4 - 4 * 8 * 3));
  // Every rank holds p microbatches: 1F1B's peak, on every rank.
  CHECK(sim.peak_in_flight == std::vector<int>{4, 4, 4, 4});
  // Each weight gradient comes after its input gradient, none before the last rank's warm-up.
  const auto plan = zb.plan(3);
  CHECK(plan[0] == PipeAction{PipeOp::recv_activation, 0, 0, 2});
  CHECK(plan[1] == PipeAction{PipeOp::forward, 0, 0, -1});
  CHECK(plan[2] == PipeAction{PipeOp::backward_input, 0, 0, -1});
  CHECK(plan.back() == PipeAction{PipeOp::backward_weight, 7, 0, -1});
  // The formula needs W <= min(F, B): a longer W no longer fits its gap.
  for (const PipeCosts c : {PipeCosts{1, 1, 1.5, 0}, PipeCosts{1, 0.5, 1, 0}})
    CHECK(simulate_pipeline(zb, c).idle_fraction() > zb.bubble_fraction(c) + 1e-3);
}

TEST_CASE("schedule: plans are pure functions with matched sends and receives") {
  const Pipeline<OneFOneB> pipe(3, 5);
  CHECK(pipe.plan(1) == pipe.plan(1));
  for (int r = 0; r < 3; ++r) {
    std::multiset<std::tuple<int, int, int>> sends, recvs;
    for (int q = 0; q < 3; ++q)
      for (const PipeAction& a : pipe.plan(q)) {
        if (a.op == PipeOp::send_activation && a.peer == r) sends.insert({q, a.microbatch, 0});
        if (a.op == PipeOp::send_gradient && a.peer == r) sends.insert({q, a.microbatch, 1});
      }
    for (const PipeAction& a : pipe.plan(r)) {
      if (a.op == PipeOp::recv_activation) recvs.insert({a.peer, a.microbatch, 0});
      if (a.op == PipeOp::recv_gradient) recvs.insert({a.peer, a.microbatch, 1});
    }
    CHECK(sends == recvs);
  }
  // First and last stage: no receive of activations, no send of gradients.
  for (const PipeAction& a : pipe.plan(0)) CHECK((a.op != PipeOp::recv_activation && a.op != PipeOp::send_gradient));
  for (const PipeAction& a : pipe.plan(2)) CHECK((a.op != PipeOp::send_activation && a.op != PipeOp::recv_gradient));
  CHECK_THROWS_WITH_AS(pipe.plan(3), doctest::Contains("rank 3 is outside the pipeline of 3 stages"), ConfigError);
}

TEST_CASE("schedule: invalid configurations name the values and a fix") {
  CHECK(test::error_text<Error>([] { Pipeline<OneFOneB>(4, 3); }) ==
        "Pipeline<OneFOneB>: 3 microbatches on 4 stages; OneFOneB needs microbatches >= stages (m >= p) so that "
        "every stage reaches its steady state. Use at least 4 microbatches, or fewer stages, or GPipe.");
  CHECK(test::error_text<Error>([] { Pipeline<ZeroBubble>(8, 6); }).find("6 microbatches on 8 stages; ZeroBubble needs microbatches >= "
                                                       "stages (m >= p)") != std::string::npos);
  CHECK(test::error_text<Error>([] { Pipeline<Interleaved1F1B<2>>(4, 6); }) ==
        "Pipeline<Interleaved1F1B<2>>: 6 microbatches on 4 stages; interleaved 1F1B needs the microbatch count to be "
        "a multiple of the stage count (m % p == 0, here 2). Use 4 or 8 microbatches.");
  CHECK(test::error_text<Error>([] { Pipeline<Interleaved1F1B<2>>(3, 2); }).find("(m % p == 0, here 2). Use 3 microbatches.") != std::string::npos);
  CHECK(test::error_text<Error>([] { Pipeline<Interleaved1F1B<3>>(1, 4); }).find("1 stage; interleaving needs at least 2 stages") !=
        std::string::npos);
  CHECK(test::error_text<Error>([] { Pipeline<GPipe>(0, 4); }).find("0 stages; a pipeline needs at least 1 stage") != std::string::npos);
  CHECK(test::error_text<Error>([] { Pipeline<GPipe>(2, 0); }).find("0 microbatches; a pipeline needs at least 1 microbatch") !=
        std::string::npos);
  CHECK(test::error_text<Error>([] { Pipeline<OneFOneB, 4>(2, 8); }) ==
        "Pipeline<OneFOneB>: 2 stages given but the type fixes 4. Pass 4 or make the stage count dynamic.");
  // Valid edges: m == p for 1F1B and zero-bubble, a single stage for GPipe.
  CHECK_NOTHROW(Pipeline<OneFOneB>(4, 4));
  CHECK_NOTHROW(Pipeline<ZeroBubble>(8, 8));
  CHECK(simulate_pipeline(Pipeline<GPipe>(1, 3)).idle_fraction() == doctest::Approx(0.0));
}

TEST_CASE("schedule: the simulator rejects broken plans") {
  const Pipeline<OneFOneB> pipe(2, 2);
  auto plans = pipe.plans();

  SUBCASE("receives in the wrong order") {
    // Rank 1 receives microbatch 1 before microbatch 0.
    auto& p1 = plans[1];
    auto first = std::find(p1.begin(), p1.end(), PipeAction{PipeOp::recv_activation, 0, 0, 0});
    auto second = std::find(p1.begin(), p1.end(), PipeAction{PipeOp::recv_activation, 1, 0, 0});
    std::iter_swap(first, second);
    CHECK_THROWS_WITH_AS(simulate_pipeline(plans, 2), doctest::Contains("is for microbatch 0 chunk 0; sends and receives"),
                         PlanError);
  }
  SUBCASE("deadlock") {
    // Rank 0 waits for a gradient before it sends the activation that produces it.
    auto& p0 = plans[0];
    p0.insert(p0.begin(), PipeAction{PipeOp::recv_gradient, 0, 0, 1});
    p0.erase(std::find(p0.begin() + 1, p0.end(), PipeAction{PipeOp::recv_gradient, 0, 0, 1}));
    CHECK_THROWS_WITH_AS(simulate_pipeline(plans, 2),
                         doctest::Contains("deadlocks: every unfinished rank waits for a message that is never sent. "
                                           "Rank 0 waits at step 0 (recv_gradient of microbatch 0 chunk 0 from rank 1)"),
                         PlanError);
  }
  SUBCASE("backward before forward") {
    plans[1] = {PipeAction{PipeOp::backward, 0, 0, -1}};
    CHECK_THROWS_WITH_AS(simulate_pipeline(plans, 2), doctest::Contains("runs a backward before its forward"), PlanError);
  }
  SUBCASE("missing work") {
    plans[0].pop_back();  // the last backward (rank 0 sends nothing after it)
    CHECK_THROWS_WITH_AS(simulate_pipeline(plans, 2),
                         doctest::Contains("rank 0 never completes the backward of microbatch 1"), PlanError);
  }
  SUBCASE("duplicate send") {
    plans[0].push_back(PipeAction{PipeOp::send_activation, 1, 0, 1});
    CHECK_THROWS_WITH_AS(simulate_pipeline(plans, 2), doctest::Contains("sends the same message twice"), PlanError);
  }
  SUBCASE("wrong peer") {
    plans[0][1].peer = 0;  // rank 0's first send_activation
    REQUIRE(plans[0][1].op == PipeOp::send_activation);
    CHECK_THROWS_WITH_AS(simulate_pipeline(plans, 2), doctest::Contains("lives on rank 1, not rank 0"), PlanError);
  }
}

// The caps of detached gradient sends (send_cap.hpp) for every valid size of
// one schedule: the default is one, and the smallest safe cap is `smallest`.
template <class Schedule>
void check_send_caps(std::size_t smallest_expected, int& with_cap_one) {
  for (int p : stage_counts)
    for (int m : microbatch_counts) {
      if (!valid<Schedule>(p, m)) continue;
      CAPTURE(p);
      CAPTURE(m);
      const auto plans = Pipeline<Schedule>(p, m).plans();
      CHECK(pipeline::default_send_cap(plans) == 1);
      const std::size_t smallest = pipeline::smallest_send_cap(plans);
      CHECK(smallest <= smallest_expected);
      CHECK(pipeline::send_cap_is_deadlock_free(plans, smallest));
      if (smallest > 0) {
        CHECK_FALSE(pipeline::send_cap_is_deadlock_free(plans, smallest - 1));
        ++with_cap_one;
      }
    }
}

TEST_CASE("schedule: the cap of in-flight gradient sends cannot deadlock, and one is safe for every schedule") {
  int needs_one = 0;
  check_send_caps<GPipe>(0, needs_one);
  check_send_caps<OneFOneB>(0, needs_one);
  check_send_caps<ZeroBubble>(0, needs_one);
  CHECK(needs_one == 0);  // these never need a buffer: the receiver posts ahead of the wait
  // Every V that --schedule interleaved:V accepts.
  check_send_caps<Interleaved1F1B<2>>(1, needs_one);
  check_send_caps<Interleaved1F1B<3>>(1, needs_one);
  check_send_caps<Interleaved1F1B<4>>(1, needs_one);
  check_send_caps<Interleaved1F1B<5>>(1, needs_one);
  check_send_caps<Interleaved1F1B<6>>(1, needs_one);
  check_send_caps<Interleaved1F1B<7>>(1, needs_one);
  check_send_caps<Interleaved1F1B<8>>(1, needs_one);
  CHECK(needs_one > 0);  // interleaving does: waiting on each send in place can deadlock
  // The smallest case: interleaved:2 on 2 ranks with 4 microbatches.
  const auto plans = Pipeline<Interleaved1F1B<2>>(2, 4).plans();
  CHECK_FALSE(pipeline::send_cap_is_deadlock_free(plans, 0));
  CHECK(pipeline::smallest_send_cap(plans) == 1);
  CHECK(pipeline::smallest_send_cap(plans, 3) == 3);
  // Plans that deadlock whatever the cap are an error, not a cap.
  auto broken = Pipeline<OneFOneB>(2, 2).plans();
  broken[0].insert(broken[0].begin(), PipeAction{PipeOp::recv_gradient, 0, 0, 1});
  broken[0].erase(std::find(broken[0].begin() + 1, broken[0].end(), PipeAction{PipeOp::recv_gradient, 0, 0, 1}));
  CHECK_FALSE(pipeline::send_cap_is_deadlock_free(broken, 100));
  CHECK_THROWS_WITH_AS(pipeline::smallest_send_cap(broken), doctest::Contains("deadlock even with every send buffered"),
                       Error);
}

TEST_CASE("schedule: transfer latency adds idle time but keeps the order") {
  const Pipeline<OneFOneB> pipe(4, 8);
  const auto fast = simulate_pipeline(pipe);
  const auto slow = simulate_pipeline(pipe, PipeCosts{1, 1, 1, 0.25});
  CHECK(slow.makespan > fast.makespan);
  CHECK(slow.idle_fraction() > pipe.bubble_fraction());
  CHECK(slow.peak_in_flight == fast.peak_in_flight);
}

TEST_CASE("schedule: timeline text and Chrome trace") {
  const auto sim = simulate_pipeline(Pipeline<OneFOneB>(2, 2));
  // Unit costs, width 3: F=3 columns, full backward (B+W) = 6 columns.
  const std::string text = pipeline_timeline_text(sim, 3);
  CHECK(text ==
        "rank 0 |F0|F1|......B0   |...B1   ||\n"
        "rank 1 |...F0|B0   |F1|B1   |......|\n"
        "idle fraction 0.333333, makespan 9\n");
  CHECK(sim.idle_fraction() == doctest::Approx(1.0 / 3.0));

  const std::string json = pipeline_chrome_trace(sim, 1000.0);
  CHECK(json.find("\"traceEvents\": [") != std::string::npos);
  CHECK(json.find("{\"name\": \"F1\", \"cat\": \"forward\", \"ph\": \"X\", \"ts\": 1000, \"dur\": 1000, \"pid\": 0, "
                  "\"tid\": 0, \"args\": {\"microbatch\": 1, \"chunk\": 0}}") != std::string::npos);
  CHECK(json.find("{\"name\": \"B1\", \"cat\": \"backward\", \"ph\": \"X\", \"ts\": 5000, \"dur\": 2000, \"pid\": 0, "
                  "\"tid\": 1,") != std::string::npos);
  std::size_t events = 0;
  for (std::size_t at = json.find("\"ph\": \"X\""); at != std::string::npos; at = json.find("\"ph\": \"X\"", at + 1))
    ++events;
  CHECK(events == 8);  // 2 ranks x 2 microbatches x (forward, backward)

  const std::string path = "test_schedule_trace.json";
  write_pipeline_chrome_trace(sim, path);
  std::ifstream in(path);
  const std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(back == json);
  std::remove(path.c_str());
  CHECK_THROWS_AS(write_pipeline_chrome_trace(sim, "/nonexistent-dir/x.json"), ConfigError);

  // Long timelines keep every digit of their timestamps.
  const std::string long_json = pipeline_chrome_trace(simulate_pipeline(Pipeline<GPipe>(8, 32)), 1e6);
  CHECK(long_json.find("e+") == std::string::npos);
  CHECK(long_json.find("\"ts\": 115000000") != std::string::npos);  // rank 0 starts its last backward (2 units) at 117 - 2

  // Interleaved labels carry the chunk.
  const auto inter = simulate_pipeline(Pipeline<Interleaved1F1B<2>>(2, 2));
  CHECK(pipeline_timeline_text(inter, 5).find("|F0.1|") != std::string::npos);
}

TEST_CASE("schedule: static sizes give compile-time plans") {
  using P = Pipeline<OneFOneB, 4, 8>;
  constexpr auto plan = P::static_plan<0>();
  static_assert(plan.size() == 4 * 8);  // rank 0: forward + send, recv + backward per microbatch
  const P pipe;
  const auto dynamic_plan = pipe.plan(0);
  CHECK(std::equal(plan.begin(), plan.end(), dynamic_plan.begin(), dynamic_plan.end()));
  CHECK(simulate_pipeline(pipe).idle_fraction() == doctest::Approx(3.0 / 11.0));
}
