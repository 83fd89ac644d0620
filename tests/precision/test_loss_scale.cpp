// DynamicLossScaler against Megatron-LM's DynamicGradScaler: an overflow
// skips its step and halves the scale once the hysteresis is used up, the
// scale doubles after the growth window, never drops below the minimum, and
// a saved state restored into a new scaler continues the same sequence.
// Single-rank: the class has no communication.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "weft_test.hpp"

namespace {

using weft::DynamicLossScaler;
using weft::DynamicLossScalerOptions;
using weft::LossScaleState;

// Megatron-LM's DynamicGradScaler.update, transcribed (megatron/core/optimizer/grad_scaler.py):
// the reference the class is compared with step by step.
struct MegatronReference {
  double scale, min_scale, growth_factor, backoff_factor;
  std::int64_t growth_interval, hysteresis, growth_tracker = 0, hysteresis_tracker;
  explicit MegatronReference(const DynamicLossScalerOptions& o)
      : scale(o.initial_scale), min_scale(o.min_scale), growth_factor(o.growth_factor),
        backoff_factor(o.backoff_factor), growth_interval(o.growth_interval), hysteresis(o.hysteresis),
        hysteresis_tracker(o.hysteresis) {}
  void update(bool found_inf) {
    if (found_inf) {
      growth_tracker = 0;
      hysteresis_tracker -= 1;
      if (hysteresis_tracker <= 0) scale = std::max(scale * backoff_factor, min_scale);
    } else {
      growth_tracker += 1;
      if (growth_tracker == growth_interval) {
        growth_tracker = 0;
        hysteresis_tracker = hysteresis;
        scale = scale * growth_factor;
      }
    }
  }
};

TEST_CASE("the defaults are Megatron-LM's") {
  const DynamicLossScaler s;
  CHECK(s.scale() == std::ldexp(1.0, 32));
  CHECK(s.inverse_scale() == std::ldexp(1.0, -32));
  CHECK(s.options().min_scale == 1.0);
  CHECK(s.options().growth_interval == 1000);
  CHECK(s.options().hysteresis == 2);
  CHECK(s.options().growth_factor == 2.0);
  CHECK(s.options().backoff_factor == 0.5);
  CHECK(s.skipped_steps() == 0);
  CHECK(s.state().growth_tracker == 0);
  CHECK(s.state().hysteresis_tracker == 2);
}

TEST_CASE("an overflow skips its step; the scale halves once the hysteresis is used up") {
  DynamicLossScaler s;
  const double initial = s.scale();
  CHECK(s.update(true));  // first overflow: skipped, hysteresis 2 -> 1, scale kept
  CHECK(s.scale() == initial);
  CHECK(s.skipped_steps() == 1);
  CHECK(s.update(true));  // second: skipped and halved
  CHECK(s.scale() == initial / 2);
  CHECK(s.update(true));  // every further overflow halves again (until the next growth)
  CHECK(s.scale() == initial / 4);
  CHECK(s.skipped_steps() == 3);
  CHECK_FALSE(s.update(false));  // a clean step is not skipped and keeps the scale
  CHECK(s.scale() == initial / 4);
  CHECK(s.update(true));  // a clean step alone does not refill the hysteresis: this one halves too
  CHECK(s.scale() == initial / 8);
  CHECK(s.skipped_steps() == 4);

  // Hysteresis 1 halves at every overflow.
  DynamicLossScaler h1({.hysteresis = 1});
  CHECK(h1.update(true));
  CHECK(h1.scale() == initial / 2);
}

TEST_CASE("the scale doubles after the growth window of clean steps, and an overflow restarts the window") {
  DynamicLossScaler s({.initial_scale = 1024, .growth_interval = 1000});
  for (int i = 0; i < 999; ++i) CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 1024);
  CHECK_FALSE(s.update(false));  // the 1000th clean step
  CHECK(s.scale() == 2048);
  CHECK(s.state().growth_tracker == 0);

  // An overflow in the window restarts it: 999 clean, overflow, then 1000 more.
  for (int i = 0; i < 999; ++i) s.update(false);
  CHECK(s.update(true));
  CHECK(s.scale() == 2048);  // hysteresis was refilled by the growth: the first overflow only skips
  for (int i = 0; i < 999; ++i) s.update(false);
  CHECK(s.scale() == 2048);
  s.update(false);
  CHECK(s.scale() == 4096);
  // The growth refilled the hysteresis: one overflow only skips again.
  CHECK(s.update(true));
  CHECK(s.scale() == 4096);
}

TEST_CASE("the scale never backs off below the minimum") {
  DynamicLossScaler s({.initial_scale = 8, .min_scale = 2, .hysteresis = 1});
  s.update(true);
  CHECK(s.scale() == 4);
  s.update(true);
  CHECK(s.scale() == 2);
  for (int i = 0; i < 10; ++i) CHECK(s.update(true));
  CHECK(s.scale() == 2);
  CHECK(s.skipped_steps() == 12);
  // A back-off factor that would step over the minimum lands on it.
  DynamicLossScaler t({.initial_scale = 3, .min_scale = 1, .hysteresis = 1});
  t.update(true);
  CHECK(t.scale() == 1.5);
  t.update(true);
  CHECK(t.scale() == 1);
}

TEST_CASE("step by step, the scaler follows Megatron-LM's update on random overflow sequences") {
  for (std::int64_t hysteresis : {1, 2, 3})
    for (double p_overflow : {0.002, 0.05, 0.5}) {
      const DynamicLossScalerOptions o{.initial_scale = 65536, .min_scale = 1, .growth_interval = 50,
                                       .hysteresis = hysteresis};
      DynamicLossScaler s(o);
      MegatronReference ref(o);
      std::mt19937 rng(static_cast<unsigned>(hysteresis * 1000 + p_overflow * 1000));
      std::bernoulli_distribution overflow(p_overflow);
      std::int64_t skipped = 0;
      bool same = true;
      for (int step = 0; step < 5000 && same; ++step) {
        const bool f = overflow(rng);
        same = s.update(f) == f;
        ref.update(f);
        skipped += f;
        same = same && s.scale() == ref.scale && s.state().growth_tracker == ref.growth_tracker &&
               s.skipped_steps() == skipped &&
               // weft keeps the hysteresis tracker at 0 where Megatron lets it go negative: the same decisions.
               s.state().hysteresis_tracker == std::max<std::int64_t>(ref.hysteresis_tracker, 0);
      }
      INFO("hysteresis " << hysteresis << ", overflow probability " << p_overflow);
      CHECK(same);
    }
}

TEST_CASE("a saved state restored into a new scaler continues the same sequence") {
  const DynamicLossScalerOptions o{.initial_scale = 4096, .min_scale = 1, .growth_interval = 20, .hysteresis = 2};
  std::mt19937 rng(11);
  std::bernoulli_distribution overflow(0.1);
  std::vector<bool> flags(400);
  for (std::size_t i = 0; i < flags.size(); ++i) flags[i] = overflow(rng);

  DynamicLossScaler whole(o);
  std::vector<LossScaleState> states;
  for (bool f : flags) {
    whole.update(f);
    states.push_back(whole.state());
  }
  // Interrupted at every 37th step: a new scaler with the saved state takes over.
  DynamicLossScaler resumed(o);
  for (std::size_t i = 0; i < flags.size(); ++i) {
    if (i % 37 == 0 && i > 0) {
      const LossScaleState saved = resumed.state();
      DynamicLossScaler fresh(o);
      fresh.set_state(saved);
      CHECK(fresh.state() == saved);
      resumed = fresh;
    }
    resumed.update(flags[i]);
    CHECK(resumed.state() == states[i]);
  }
  CHECK(resumed.skipped_steps() == whole.skipped_steps());
  CHECK(resumed.skipped_steps() > 0);
}

TEST_CASE("bad settings and states that no scaler with these settings could have are refused") {
  using weft::ConfigError;
  using weft::test::contains;
  using weft::test::error_text;
  CHECK(contains(error_text<ConfigError>([] { DynamicLossScaler s({.initial_scale = 0.5}); }),
                 "initial_scale is 0.5; it must be finite and >= min_scale"));
  CHECK(contains(error_text<ConfigError>([] { DynamicLossScaler s({.min_scale = 0}); }), "min_scale is 0"));
  CHECK(contains(error_text<ConfigError>([] { DynamicLossScaler s({.growth_interval = 0}); }), "growth_interval is 0"));
  CHECK(contains(error_text<ConfigError>([] { DynamicLossScaler s({.hysteresis = 0}); }), "hysteresis is 0"));
  CHECK(contains(error_text<ConfigError>([] { DynamicLossScaler s({.growth_factor = 1}); }), "growth_factor is 1"));
  CHECK(contains(error_text<ConfigError>([] { DynamicLossScaler s({.backoff_factor = 1}); }), "backoff_factor is 1"));

  DynamicLossScaler s;
  CHECK(contains(error_text<ConfigError>([&] { s.set_state({.scale = 0.25}); }), "the saved scale is 0.25"));
  CHECK(contains(error_text<ConfigError>([&] { s.set_state({.scale = 8, .growth_tracker = 1000}); }),
                 "the saved growth tracker is 1000"));
  CHECK(contains(error_text<ConfigError>([&] { s.set_state({.scale = 8, .hysteresis_tracker = 3}); }),
                 "the saved hysteresis tracker is 3"));
  CHECK(contains(error_text<ConfigError>([&] { s.set_state({.scale = 8, .skipped_steps = -1}); }),
                 "skipped-step count is -1"));
  CHECK(s.scale() == std::ldexp(1.0, 32));  // a refused state changes nothing
}

}  // namespace
