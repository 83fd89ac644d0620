// The run loop of a training program built on weft: steps [first, steps)
// of any model, each timed (wall and process CPU), its Kokkos events counted
// over the first steps, one line printed per step (with a progress bar on a
// terminal), and the run stopped, with a message that says what to try, at
// the first non-finite loss or gradient norm or when the loss runs away.
// train_gpt and custom_model run their steps through it.
//
//   weft::TrainLoop loop({.program = "my_train", .steps = 100, .tokens_per_step = batch * seq,
//                         .print = rank == 0});
//   loop.set_fixes([&](double lr) { return "try a smaller --lr (now " + weft::number_text(lr) + ")"; });
//   const weft::TrainLoopRun run = loop.run(
//       [&](std::size_t s) { return s < warmup ? lr * double(s + 1) / double(warmup) : lr; },  // the lr of step s
//       [&](std::size_t s, double lr) { return weft::optim::train_step(...); },              // one optimizer step
//       [&](std::size_t s, const weft::optim::StepResult& r) { /* checkpoint, statistics */ });
//   if (!run.diverged.empty()) { std::fprintf(stderr, "my_train: error: %s\n", run.diverged.c_str()); return 4; }
//   std::printf("%.0f tok/s\n", run.tokens_per_second(batch * seq));
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include <weft/core/measure.hpp>
#include <weft/metrics/counters.hpp>
#include <weft/metrics/peak.hpp>
#include <weft/optim/train_step.hpp>

namespace weft {

/// A number as the loop's messages print it: "%.6g" ("0.001", "1e+30",
/// "nan", "-nan", "inf").
inline std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

/// The message of step `step` when its loss or gradient norm is not finite
/// (empty otherwise): "training diverged at step S: the loss is L (gradient
/// norm G)", "... the gradient norm is G (loss L)" or "... the loss is L and
/// the gradient norm G", then "; " and `fixes` (what the user may change).
inline std::string divergence_message(std::size_t step, double loss, double grad_norm, const std::string& fixes) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) return {};
  const bool bad_loss = !std::isfinite(loss), bad_norm = !std::isfinite(grad_norm);
  const std::string what = bad_loss && bad_norm ? "the loss is " + number_text(loss) + " and the gradient norm " + number_text(grad_norm)
                           : bad_loss ? "the loss is " + number_text(loss) + " (gradient norm " + number_text(grad_norm) + ")"
                                      : "the gradient norm is " + number_text(grad_norm) + " (loss " + number_text(loss) + ")";
  return "training diverged at step " + std::to_string(step) + ": " + what + "; " + fixes;
}

/// The divergence guard: stops a run whose loss, still finite, stays above
/// `factor` x its best so far for `window` consecutive steps (a loss of
/// 341535 three steps after 5.5 is no training). factor 0: off. A loss of 0
/// or below never counts as above (there is no ratio to a best of 0).
struct DivergenceGuard {
  double factor = 4.0;
  std::size_t window = 3;
  double best = 0;
  std::size_t best_step = 0, above = 0;
  bool any = false;

  /// Takes step `step`'s loss; returns true when the guard stops the run
  /// here (the loss has been above factor x best for `window` steps).
  bool observe(std::size_t step, double loss) {
    if (factor <= 0 || !std::isfinite(loss)) return false;
    if (!any || loss < best) {
      any = true, best = loss, best_step = step;
    }
    above = loss > factor * best && best > 0 ? above + 1 : 0;
    return above >= window;
  }
  /// The message of a stop at step `step` with loss `loss` (after observe
  /// returned true): "training diverged at step S: the loss is L, above F x
  /// the best so far (B at step T) for N consecutive steps; " `fixes` "
  /// (the guard: " `settings` ")" (the last part only with settings). Built
  /// only when the run stops, not at every step.
  std::string message(std::size_t step, double loss, const std::string& fixes, const std::string& settings = {}) const {
    return "training diverged at step " + std::to_string(step) + ": the loss is " + number_text(loss) + ", above " +
           number_text(factor) + " x the best so far (" + number_text(best) + " at step " + std::to_string(best_step) +
           ") for " + std::to_string(above) + " consecutive steps; " + fixes +
           (settings.empty() ? std::string() : " (the guard: " + settings + ")");
  }
};

/// How a TrainLoop runs and prints.
struct TrainLoopSettings {
  std::string program = "train";   ///< the prefix of the loop's own lines ("<program>: Kokkos events ...")
  std::size_t first = 0;           ///< the first step to run (a resumed run's step)
  std::size_t steps = 0;           ///< run steps first .. steps-1 (none when steps <= first)
  std::size_t tokens_per_step = 0; ///< tokens an optimizer step trains on: the line's tok/s (0: not printed)
  bool print = true;               ///< this rank prints the step lines (one rank of a job)
  double divergence_factor = 4.0;  ///< DivergenceGuard::factor (0: the guard is off)
  std::size_t divergence_window = 3;  ///< DivergenceGuard::window
  /// How the guard is set, as the user sets it, appended to its message
  /// ("--divergence-factor 4 --divergence-window 3; ..."; empty: nothing).
  std::string guard_settings = {};
  /// Kokkos events are counted over this many first steps (the first, and
  /// the most of each count over the next ones); the callbacks are removed
  /// after them, so the steps behind the throughput run without them.
  std::size_t counted_steps = 3;
  /// The progress bar on a terminal: rank `print` only, stdout a terminal,
  /// and no MPI launcher (Open MPI hands every rank a pseudo-terminal even
  /// when mpirun's own output goes to a file). false: never.
  bool progress_bar = true;
};

/// What a TrainLoop run measured: one entry per step that completed (a step
/// that diverged is not one; its figures are in stop_*).
struct TrainLoopRun {
  std::vector<double> losses;   ///< StepResult::loss of each step
  std::vector<double> norms;    ///< StepResult::grad_norm; NaN for a skipped (overflowed, loss-scaled) step
  std::vector<double> walls;    ///< wall seconds of each step (Kokkos::fence before and after)
  std::vector<double> cpus;     ///< process CPU seconds of each step (all threads)
  std::vector<double> scales;   ///< StepResult::loss_scale of each step
  std::vector<double> lrs;      ///< the learning rate of each step
  std::vector<std::size_t> skipped_steps;  ///< the steps whose update was skipped (StepResult::skipped)
  std::string diverged;         ///< the divergence message (empty: the run did not diverge)
  std::size_t stop_step = 0;    ///< the step that diverged
  double stop_loss = 0, stop_norm = 0, stop_wall = 0;  ///< its loss, gradient norm and wall seconds
  metrics::KernelCounts first_counts;  ///< Kokkos events of the first step run
  metrics::KernelCounts later_counts;  ///< the most of each count over the counted steps after it
  std::size_t later_counted = 0;       ///< how many steps later_counts covers
  std::size_t counted_steps = 0;       ///< min(settings.counted_steps, steps run)
  /// Steps at the start excluded from the steady figures (first-touch, BLAS
  /// buffers): min(5, max(1, steps/10)) of the steps to run when more than
  /// one, else 0. A run that stopped before they were over excludes none.
  std::size_t warmup = 0;

  /// The steps excluded from the steady figures in this run: warmup when
  /// more steps completed than that, else 0.
  std::size_t excluded() const { return walls.size() > warmup ? warmup : 0; }
  /// The wall seconds of the steps after the excluded ones.
  std::vector<double> steady_walls() const { return {walls.begin() + long(excluded()), walls.end()}; }
  /// The CPU seconds of the steps after the excluded ones.
  std::vector<double> steady_cpus() const { return {cpus.begin() + long(excluded()), cpus.end()}; }
  /// tokens / the median steady wall time (0 when no step completed).
  double tokens_per_second(std::size_t tokens_per_step) const {
    const auto s = steady_walls();
    return s.empty() ? 0.0 : double(tokens_per_step) / median_of(s);
  }
  /// tokens / the median steady CPU time (0 when no step completed).
  double tokens_per_cpu_second(std::size_t tokens_per_step) const {
    const auto s = steady_cpus();
    return s.empty() ? 0.0 : double(tokens_per_step) / median_of(s);
  }
};

/// The loop (see the file comment). Every rank of a job runs it with the
/// same settings; a model whose step reduces its loss and gradient norm over
/// every axis gives every rank the same values, so every rank stops at the
/// same step.
class TrainLoop {
 public:
  /// What the guard's and the non-finite message add after "; ": what the
  /// user can change, given the step's learning rate.
  using Fixes = std::function<std::string(double lr)>;

  explicit TrainLoop(TrainLoopSettings settings) : s_(std::move(settings)) {
    const std::size_t n = s_.steps > s_.first ? s_.steps - s_.first : 0;
    warmup_ = n > 1 ? std::min<std::size_t>(5, std::max<std::size_t>(1, n / 10)) : 0;
  }

  /// Sets what the divergence messages suggest (default: "try a smaller
  /// learning rate (now LR) or a warmup").
  TrainLoop& set_fixes(Fixes fixes) {
    fixes_ = std::move(fixes);
    return *this;
  }

  /// The steps excluded from the steady figures (TrainLoopRun::warmup),
  /// known before the run: a caller that snapshots statistics when they are
  /// over does it after step first + warmup() - 1.
  std::size_t warmup() const { return warmup_; }

  /// Runs the steps. For each step s: lr = lr_of(s); r = step(s, lr) between
  /// two Kokkos::fence calls (timed); the divergence checks (a non-finite
  /// loss, or a non-finite norm of a step that was not skipped; then the
  /// guard) stop the loop before `after` runs; otherwise the step is
  /// recorded, after(s, r) runs (checkpoints, statistics), and the printing
  /// rank writes "step S loss L[ tok/s T] grad_norm G lr R ms M" and
  /// extra(s, r) (text appended to the line; may be empty) with a newline.
  template <class LrOf, class Step, class After, class Extra>
  TrainLoopRun run(LrOf&& lr_of, Step&& step, After&& after, Extra&& extra) const {
    TrainLoopRun out;
    out.warmup = warmup_;
    const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
    const bool tty = s_.progress_bar && s_.print && isatty(STDOUT_FILENO) && !launched;
    const std::size_t n = s_.steps > s_.first ? s_.steps - s_.first : 0;
    out.counted_steps = std::min(s_.counted_steps, n);
    DivergenceGuard guard{.factor = s_.divergence_factor, .window = s_.divergence_window};
    if (out.counted_steps > 0) metrics::KernelCounters::install();
    for (std::size_t s = s_.first; s < s_.steps; ++s) {
      const double lr = lr_of(s);
      Kokkos::fence();
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = metrics::process_cpu_seconds();
      const auto k0 = metrics::KernelCounters::snapshot();
      const optim::StepResult r = step(s, lr);
      const auto counts = metrics::KernelCounters::snapshot() - k0;
      Kokkos::fence();
      if (s - s_.first < out.counted_steps) {
        if (s == s_.first) out.first_counts = counts;
        else out.later_counts = metrics::max_of(out.later_counts, counts), ++out.later_counted;
        if (s - s_.first + 1 == out.counted_steps) metrics::KernelCounters::uninstall();
      }
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // A loss-scaled step that overflowed was skipped (its norm is not finite by design): only its loss can diverge.
      // The fixes text is built only for a step that stops the run.
      const double norm = r.skipped ? 0.0 : r.grad_norm;
      std::string diverged;
      if (!std::isfinite(r.loss) || !std::isfinite(norm)) diverged = divergence_message(s, r.loss, norm, fixes(lr));
      else if (guard.observe(s, r.loss)) diverged = guard.message(s, r.loss, fixes(lr), s_.guard_settings);
      if (!diverged.empty()) {
        out.diverged = std::move(diverged);
        out.stop_step = s, out.stop_loss = r.loss, out.stop_norm = r.grad_norm, out.stop_wall = wall;
        break;
      }
      out.cpus.push_back(metrics::process_cpu_seconds() - c0);
      out.walls.push_back(wall);
      out.losses.push_back(r.loss);
      out.norms.push_back(r.skipped ? std::numeric_limits<double>::quiet_NaN() : r.grad_norm);
      out.scales.push_back(r.loss_scale);
      out.lrs.push_back(lr);
      if (r.skipped) out.skipped_steps.push_back(s);
      after(s, r);
      if (!s_.print) continue;
      if (tty) std::printf("\r\033[K");
      std::printf("step %zu loss %.4f", s, r.loss);
      if (s_.tokens_per_step) std::printf(" tok/s %.0f", double(s_.tokens_per_step) / wall);
      std::printf(" grad_norm %.4f lr %.3g ms %.1f%s\n", r.grad_norm, lr, wall * 1e3, std::string(extra(s, r)).c_str());
      if (tty) {
        const int width = 30, done = int(double(width) * double(s + 1) / double(s_.steps));
        std::printf("[%s%s] %zu/%zu loss %.3f", std::string(std::size_t(done), '#').c_str(),
                    std::string(std::size_t(width - done), '.').c_str(), s + 1, s_.steps, r.loss);
      }
      std::fflush(stdout);
    }
    if (tty) std::printf("\r\033[K");
    metrics::KernelCounters::uninstall();  // a run that stopped inside the counted steps
    if (s_.print && out.counted_steps > 0) {
      std::printf("%s: Kokkos events of rank 0's first step: %s\n", s_.program.c_str(), out.first_counts.summary().c_str());
      if (out.later_counted)
        std::printf("%s: per step after the first (most of %zu): %s\n", s_.program.c_str(), out.later_counted,
                    out.later_counts.summary().c_str());
    }
    std::fflush(stdout);
    return out;
  }

 private:
  std::string fixes(double lr) const {
    return fixes_ ? fixes_(lr) : "try a smaller learning rate (now " + number_text(lr) + ") or a warmup";
  }
  TrainLoopSettings s_;
  Fixes fixes_;
  std::size_t warmup_ = 0;
};

}  // namespace weft
