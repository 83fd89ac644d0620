// weft/train_loop.hpp: the run loop of programs built on weft.
// - the loop runs steps first..steps-1, asks lr_of for each step's rate and
//   hands it to step, calls after once per recorded step in order, and
//   records losses, norms (NaN for a skipped step), scales and rates;
// - a non-finite loss, or a non-finite norm of a step that was not skipped,
//   ends the loop at that step with the message and the program's fixes;
//   the step is not recorded and after does not run for it;
// - the guard stops a loss that stays above factor x its best for window
//   steps, names its settings, and is off at factor 0;
// - warmup is min(5, max(1, n/10)) for n > 1 steps, and a run that stopped
//   before it was over excludes nothing from its steady figures;
// - the printing rank writes one "step ..." line per step with the extra
//   text, and the Kokkos events of the first steps.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <weft/train_loop.hpp>

#include "weft_test.hpp"

namespace {

using weft::optim::StepResult;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs `loop` over the losses `curve` (indexed by step); `skipped` marks
// steps whose update was skipped with an infinite norm.
weft::TrainLoopRun run_curve(const weft::TrainLoop& loop, const std::vector<double>& curve,
                             const std::vector<bool>& skipped = {}, std::vector<std::size_t>* after_steps = nullptr) {
  return loop.run([](std::size_t s) { return 0.1 * double(s + 1); },
                  [&](std::size_t s, double) {
                    StepResult r;
                    r.loss = curve.at(s);
                    const bool skip = s < skipped.size() && skipped[s];
                    r.grad_norm = skip ? std::numeric_limits<double>::infinity() : 1.0 + double(s);
                    r.skipped = skip;
                    r.loss_scale = skip ? 32768 : 65536;
                    return r;
                  },
                  [&](std::size_t s, const StepResult&) {
                    if (after_steps) after_steps->push_back(s);
                  },
                  [](std::size_t, const StepResult&) { return ""; });
}

}  // namespace

TEST_CASE("TrainLoop runs the steps in order, hands each its rate and records what they return") {
  std::vector<std::size_t> rates_asked, stepped, after;
  std::vector<double> rates_given;
  weft::TrainLoop loop({.program = "t", .first = 2, .steps = 6, .print = false});
  const auto run = loop.run([&](std::size_t s) { rates_asked.push_back(s); return 0.5 * double(s); },
                            [&](std::size_t s, double lr) {
                              stepped.push_back(s);
                              rates_given.push_back(lr);
                              StepResult r;
                              r.loss = 10.0 - double(s);
                              r.grad_norm = s == 4 ? std::numeric_limits<double>::infinity() : double(s);
                              r.skipped = s == 4;
                              r.loss_scale = 8;
                              return r;
                            },
                            [&](std::size_t s, const StepResult& r) {
                              after.push_back(s);
                              CHECK(r.loss == 10.0 - double(s));
                            },
                            [](std::size_t, const StepResult&) { return ""; });
  CHECK(rates_asked == std::vector<std::size_t>{2, 3, 4, 5});
  CHECK(stepped == std::vector<std::size_t>{2, 3, 4, 5});
  CHECK(after == std::vector<std::size_t>{2, 3, 4, 5});
  CHECK(rates_given == std::vector<double>{1.0, 1.5, 2.0, 2.5});
  CHECK(run.lrs == rates_given);
  CHECK(run.losses == std::vector<double>{8, 7, 6, 5});
  REQUIRE(run.norms.size() == 4);
  CHECK(run.norms[0] == 2);
  CHECK(std::isnan(run.norms[2]));  // the skipped step's norm is not a norm
  CHECK(run.skipped_steps == std::vector<std::size_t>{4});
  CHECK(run.scales == std::vector<double>{8, 8, 8, 8});
  CHECK(run.diverged.empty());  // a skipped step's infinite norm is by design
  CHECK(run.walls.size() == 4);
  CHECK(run.cpus.size() == 4);
  CHECK(run.counted_steps == 3);
  CHECK(run.later_counted == 2);
}

TEST_CASE("TrainLoop stops at the first non-finite loss or norm, before after runs for it") {
  std::vector<double> curve = {5, 4.5, 4, std::nan(""), 3};
  std::vector<std::size_t> after;
  weft::TrainLoop loop({.program = "t", .steps = 5, .print = false});
  int asked = 0;
  loop.set_fixes([&](double lr) { ++asked; return "try a smaller --lr (now " + weft::number_text(lr) + ")"; });
  const auto run = run_curve(loop, curve, {}, &after);
  CHECK(asked == 1);  // the fixes are worded for the stopping step only, not at every step
  CHECK(after == std::vector<std::size_t>{0, 1, 2});
  CHECK(run.losses == std::vector<double>{5, 4.5, 4});
  CHECK(run.stop_step == 3);
  CHECK(std::isnan(run.stop_loss));
  CHECK(contains(run.diverged, "training diverged at step 3: the loss is "));
  CHECK(contains(run.diverged, "(gradient norm 4); try a smaller --lr (now 0.4)"));
  // A non-finite norm of a step that was not skipped stops it too; a skipped one does not.
  curve = {5, 4.5, 4, 3.5};
  const auto skipped = run_curve(weft::TrainLoop({.steps = 4, .print = false}), curve, {false, true});
  CHECK(skipped.diverged.empty());
  CHECK(skipped.losses.size() == 4);
  weft::TrainLoop plain({.steps = 4, .print = false});
  const auto bad_norm = plain.run([](std::size_t) { return 1e-3; },
                                  [](std::size_t s, double) {
                                    StepResult r;
                                    r.loss = 2;
                                    r.grad_norm = s == 1 ? std::numeric_limits<double>::infinity() : 1;
                                    return r;
                                  },
                                  [](std::size_t, const StepResult&) {}, [](std::size_t, const StepResult&) { return ""; });
  CHECK(bad_norm.stop_step == 1);
  CHECK(contains(bad_norm.diverged, "training diverged at step 1: the gradient norm is inf (loss 2); "
                                    "try a smaller learning rate (now 0.001) or a warmup"));
}

TEST_CASE("the divergence guard stops a runaway loss after its window and is off at factor 0") {
  const std::vector<double> curve = {5, 4, 30, 17, 20, 1};
  weft::TrainLoop loop({.steps = 6, .print = false, .guard_settings = "--divergence-factor 4"});
  const auto run = run_curve(loop, curve);
  CHECK(run.stop_step == 4);  // 30, 17, 20: three steps above 4 x 4
  CHECK(run.losses.size() == 4);
  CHECK(contains(run.diverged, "training diverged at step 4: the loss is 20, above 4 x the best so far (4 at step 1) "
                               "for 3 consecutive steps; "));
  CHECK(contains(run.diverged, "(the guard: --divergence-factor 4)"));
  // A step back under the bound restarts the count.
  const auto back = run_curve(weft::TrainLoop({.steps = 6, .print = false}), {5, 4, 30, 17, 10, 20});
  CHECK(back.diverged.empty());
  const auto off = run_curve(weft::TrainLoop({.steps = 6, .print = false, .divergence_factor = 0}), curve);
  CHECK(off.diverged.empty());
  CHECK(off.losses.size() == 6);
}

TEST_CASE("the warm-up steps are left out of the steady figures, unless the run stopped before they were over") {
  CHECK(weft::TrainLoop({.steps = 1}).warmup() == 0);
  CHECK(weft::TrainLoop({.steps = 2}).warmup() == 1);
  CHECK(weft::TrainLoop({.steps = 30}).warmup() == 3);
  CHECK(weft::TrainLoop({.first = 10, .steps = 30}).warmup() == 2);
  CHECK(weft::TrainLoop({.steps = 1000}).warmup() == 5);
  const auto run = run_curve(weft::TrainLoop({.steps = 20, .print = false}), std::vector<double>(20, 1.0));
  CHECK(run.warmup == 2);
  CHECK(run.excluded() == 2);
  CHECK(run.steady_walls().size() == 18);
  CHECK(run.tokens_per_second(100) == 100 / weft::median_of(run.steady_walls()));
  CHECK(run.tokens_per_second(100) > 0);
  std::vector<double> short_curve(20, 1.0);
  short_curve[1] = std::nan("");
  const auto stopped = run_curve(weft::TrainLoop({.steps = 20, .print = false}), short_curve);
  CHECK(stopped.walls.size() == 1);
  CHECK(stopped.excluded() == 0);
  CHECK(stopped.steady_walls().size() == 1);
  CHECK(weft::median_of({3, 1, 2}) == 2);
  CHECK(weft::median_of({4, 1, 2, 3}) == 2.5);
  CHECK(weft::median_of({}) == 0);
}

TEST_CASE("the printing rank writes one line per step with the extra text, and the counted Kokkos events") {
  if (weft::test::world().rank() != 0) return;
  const std::string path = "/tmp/weft_test_train_loop_" + std::to_string(::getpid()) + ".txt";
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  REQUIRE(std::freopen(path.c_str(), "w", stdout) != nullptr);
  weft::TrainLoop loop({.program = "prog", .steps = 3, .tokens_per_step = 64, .print = true, .progress_bar = false});
  loop.run([](std::size_t) { return 0.01; },
           [](std::size_t s, double) {
             Kokkos::View<float*> v("v", 4);
             Kokkos::deep_copy(v, float(s));
             StepResult r;
             r.loss = 2.0 - 0.5 * double(s);
             r.grad_norm = 0.25;
             return r;
           },
           [](std::size_t, const StepResult&) {}, [](std::size_t s, const StepResult&) { return " extra " + std::to_string(s); });
  std::fflush(stdout);
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  CHECK_MESSAGE(contains(text, "step 0 loss 2.0000 tok/s "), text);
  CHECK_MESSAGE(contains(text, " grad_norm 0.2500 lr 0.01 ms "), text);
  CHECK_MESSAGE(contains(text, " extra 0\n"), text);
  CHECK_MESSAGE(contains(text, "step 2 loss 1.0000 tok/s "), text);
  CHECK_MESSAGE(contains(text, "prog: Kokkos events of rank 0's first step: "), text);
  CHECK_MESSAGE(contains(text, "prog: per step after the first (most of 2): "), text);
  CHECK_MESSAGE(!contains(text, "step 3 "), text);
}
