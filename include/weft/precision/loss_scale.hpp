// Dynamic loss scaling for fp16 training (the DynamicLossScale policy's state
// machine): when to skip a step whose gradients overflowed, and how the scale
// shrinks after overflows and grows after a window of clean steps.
#pragma once

#include <cmath>
#include <cstdint>

#include <weft/core/error.hpp>

namespace weft {

/// The settings of a DynamicLossScaler; the defaults are Megatron-LM's
/// (`--initial-loss-scale 2^32 --min-loss-scale 1 --loss-scale-window 1000
/// --hysteresis 2`, growth factor 2, backoff factor 0.5).
struct DynamicLossScalerOptions {
  double initial_scale = 4294967296.0;  ///< 2^32: the scale of the first step
  double min_scale = 1.0;               ///< the scale never backs off below this
  std::int64_t growth_interval = 1000;  ///< clean steps in a row after which the scale grows
  std::int64_t hysteresis = 2;          ///< overflows it takes to back off (see DynamicLossScaler::update)
  double growth_factor = 2.0;           ///< the scale's factor on growth (> 1)
  double backoff_factor = 0.5;          ///< the scale's factor on back-off (in (0, 1))
};

/// Everything a DynamicLossScaler carries from step to step: saving it with a
/// checkpoint and restoring it makes a resumed run continue the same scale
/// sequence.
struct LossScaleState {
  double scale = 0;                     ///< the current loss scale
  std::int64_t growth_tracker = 0;      ///< clean steps since the last overflow or growth
  std::int64_t hysteresis_tracker = 0;  ///< overflows still tolerated before the next back-off
  std::int64_t skipped_steps = 0;       ///< steps skipped for overflow, in total
  friend bool operator==(const LossScaleState&, const LossScaleState&) = default;
};

/// Megatron-LM's DynamicGradScaler as a plain class. Each step, the caller
/// multiplies the loss by scale() before the backward pass, finds out whether
/// any gradient is infinite or NaN (on every rank alike: the flag must be
/// reduced over every rank that holds gradients first), calls
/// update(found_overflow), and skips the optimizer step when it returns true,
/// dividing the gradients by the scale (before update) otherwise.
///
/// update(true): the step is skipped (always); the growth tracker restarts;
/// the hysteresis tracker drops by one, and once it reaches 0 the scale is
/// multiplied by backoff_factor, but never below min_scale -- with hysteresis
/// 2, the first overflow after a growth only skips, and every later one
/// before the next growth also halves. update(false): the growth tracker
/// counts the clean step; after growth_interval of them in a row the scale is
/// multiplied by growth_factor, the tracker restarts and the hysteresis
/// tracker is refilled. A clean step does not refill the hysteresis tracker
/// on its own (as in Megatron-LM). There is no upper bound on the scale: an
/// overflowing scale makes its own gradients overflow and backs off.
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const DynamicLossScalerOptions& options = {}) : options_(options) {
    WEFT_REQUIRE(std::isfinite(options.min_scale) && options.min_scale > 0, ConfigError,
                 "DynamicLossScaler: min_scale is ", options.min_scale, "; it must be finite and > 0 (Megatron: 1)");
    WEFT_REQUIRE(std::isfinite(options.initial_scale) && options.initial_scale >= options.min_scale, ConfigError,
                 "DynamicLossScaler: initial_scale is ", options.initial_scale,
                 "; it must be finite and >= min_scale (", options.min_scale, "); Megatron starts at 2^32");
    WEFT_REQUIRE(options.growth_interval >= 1, ConfigError, "DynamicLossScaler: growth_interval is ",
                 options.growth_interval, "; it must be >= 1 clean step (Megatron: 1000)");
    WEFT_REQUIRE(options.hysteresis >= 1, ConfigError, "DynamicLossScaler: hysteresis is ", options.hysteresis,
                 "; it must be >= 1 overflow (1 backs off at every overflow; Megatron: 2)");
    WEFT_REQUIRE(std::isfinite(options.growth_factor) && options.growth_factor > 1, ConfigError,
                 "DynamicLossScaler: growth_factor is ", options.growth_factor, "; it must be > 1 (Megatron: 2)");
    WEFT_REQUIRE(options.backoff_factor > 0 && options.backoff_factor < 1, ConfigError,
                 "DynamicLossScaler: backoff_factor is ", options.backoff_factor,
                 "; it must lie in (0, 1) (Megatron: 0.5)");
    state_.scale = options.initial_scale;
    state_.hysteresis_tracker = options.hysteresis;
  }

  /// The factor to multiply the loss by in this step.
  double scale() const noexcept { return state_.scale; }
  /// 1 / scale(): what the gradients are multiplied by before the optimizer step.
  double inverse_scale() const noexcept { return 1.0 / state_.scale; }
  /// Steps skipped for overflow so far (restored state included).
  std::int64_t skipped_steps() const noexcept { return state_.skipped_steps; }
  /// The settings the scaler was built with.
  const DynamicLossScalerOptions& options() const noexcept { return options_; }

  /// Records one step's outcome and returns whether the step is skipped
  /// (exactly when found_overflow is true); see the class comment for how
  /// the scale moves. found_overflow must be the same on every rank.
  bool update(bool found_overflow) {
    if (found_overflow) {
      ++state_.skipped_steps;
      state_.growth_tracker = 0;
      if (--state_.hysteresis_tracker <= 0) {
        state_.hysteresis_tracker = 0;  // stays at 0: every further overflow backs off until the next growth
        state_.scale = std::fmax(state_.scale * options_.backoff_factor, options_.min_scale);
      }
      return true;
    }
    if (++state_.growth_tracker == options_.growth_interval) {
      state_.growth_tracker = 0;
      state_.hysteresis_tracker = options_.hysteresis;
      state_.scale *= options_.growth_factor;
    }
    return false;
  }

  /// The state to save (with the checkpoint, beside the options it was made with).
  const LossScaleState& state() const noexcept { return state_; }
  /// Restores a saved state. ConfigError when it cannot come from a scaler
  /// with these options (a scale below min_scale or not finite, trackers out
  /// of range), which means it was saved with other settings or damaged.
  void set_state(const LossScaleState& s) {
    WEFT_REQUIRE(std::isfinite(s.scale) && s.scale >= options_.min_scale, ConfigError,
                 "DynamicLossScaler::set_state: the saved scale is ", s.scale, "; it must be finite and >= min_scale (",
                 options_.min_scale, "); was the state saved with other scaler settings?");
    WEFT_REQUIRE(s.growth_tracker >= 0 && s.growth_tracker < options_.growth_interval, ConfigError,
                 "DynamicLossScaler::set_state: the saved growth tracker is ", s.growth_tracker,
                 "; it must lie in [0, growth_interval = ", options_.growth_interval,
                 "); was the state saved with another growth interval?");
    WEFT_REQUIRE(s.hysteresis_tracker >= 0 && s.hysteresis_tracker <= options_.hysteresis, ConfigError,
                 "DynamicLossScaler::set_state: the saved hysteresis tracker is ", s.hysteresis_tracker,
                 "; it must lie in [0, hysteresis = ", options_.hysteresis, "]; was the state saved with another hysteresis?");
    WEFT_REQUIRE(s.skipped_steps >= 0, ConfigError, "DynamicLossScaler::set_state: the saved skipped-step count is ",
                 s.skipped_steps, "; it must be >= 0");
    state_ = s;
  }

 private:
  DynamicLossScalerOptions options_;
  LossScaleState state_;
};

}  // namespace weft
