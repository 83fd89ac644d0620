// Pipeline parallelism at run time: stages hold the single-process model's
// parameters; every schedule on pp = world size follows the single-process
// loss curve for 20 steps; dp x pp composes with data parallelism; the
// activations held stay within what each schedule promises; and a rank that
// throws in the middle of a schedule ends the step with an error on every
// rank (the case that fails on purpose, run by CTest as an expected failure).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/parallel/pipeline/executor.hpp>

#include "tiny_gpt.hpp"
#include "weft_test.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;
constexpr std::size_t kGlobalBatch = 8;
constexpr std::size_t kSteps = 20;
constexpr double kLr = 3e-3, kClip = 1.0;

weft::nn::GPTConfig tiny(std::size_t microbatch) { return weft::test::tiny_gpt(6, microbatch); }

using weft::test::successor_stream;

// The single-process loss curve: the whole global batch as one microbatch.
const std::vector<double>& reference_losses() {
  static const std::vector<double> losses = weft::test::single_process_losses(tiny(kGlobalBatch), kSteps, kLr, kClip);
  return losses;
}

using weft::test::rel;

struct PipeRun {
  std::vector<double> loss;
  std::size_t peak_slots = 0;
  int promised_peak = 0;
  std::size_t activation_bytes = 0;        // the stage's ledger after the last step
  std::vector<std::vector<float>> grads;   // every local gradient after the last step (recompute_steps only)
};

// Trains on a pipeline of the PP communicator (and DP with Policy, when given) with schedule Sched.
template <class Sched, class Policy, class StageStrategy = weft::SingleProcess>
PipeRun run_pipeline_with(weft::Comm& pp, weft::Comm* dpc, std::size_t microbatches, std::size_t steps,
                          weft::pipeline::ExecutorOptions eo, bool recompute = false) {
  const std::size_t ndp = dpc ? std::size_t(dpc->size()) : 1;
  const std::size_t mb = weft::parallel::local_microbatch(kGlobalBatch, ndp, microbatches);
  auto cfg = tiny(mb);
  cfg.recompute = recompute;
  const auto part = weft::pipeline::equal_partition(cfg.layers, std::size_t(pp.size() * Sched::chunks));
  weft::pipeline::Stage<float, StageStrategy> stage(cfg, part, pp.size(), pp.rank(), Sched::chunks);
  std::unique_ptr<weft::parallel::DataParallel<float, Policy>> dp;
  if (dpc) {
    weft::parallel::DPOptions o;
    o.bucket_mb = 0.004;
    dp = std::make_unique<weft::parallel::DataParallel<float, Policy>>(*dpc, stage.parameter_groups(), o);
    stage.set_hooks(dp.get());
  }
  weft::optim::AdamW<float, Space> opt(dp ? dp->optimizer_parameters() : stage.parameters());
  weft::pipeline::Executor ex(stage, pp, weft::Pipeline<Sched>(pp.size(), int(microbatches)), eo);
  auto data = successor_stream();
  PipeRun r;
  for (std::size_t s = 0; s < steps; ++s)
    r.loss.push_back(weft::pipeline::train_step(ex, dp.get(), opt, data, s, kGlobalBatch, kLr, kClip).loss);
  r.peak_slots = stage.peak_slots();
  r.promised_peak = Sched::peak_in_flight(pp.size(), int(microbatches), pp.rank());
  r.activation_bytes = stage.memory().bytes(weft::metrics::MemoryCategory::activations);
  if (!dp)  // train_step leaves the last step's gradients in place (the optimizer reads, never clears them)
    for (auto* p : stage.parameters()) {
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p->grad);
      r.grads.emplace_back(h.data(), h.data() + h.size());
    }
  return r;
}

// The same, with the schedule named as on the command line.
template <class Policy = weft::Replicated>
PipeRun run_pipeline(weft::Comm& pp, weft::Comm* dpc, const std::string& schedule, std::size_t microbatches,
                     std::size_t steps = kSteps, weft::pipeline::ExecutorOptions eo = {}, bool recompute = false) {
  return weft::pipeline::visit_schedule(schedule, [&]<class S>(std::type_identity<S>) {
    return run_pipeline_with<S, Policy>(pp, dpc, microbatches, steps, eo, recompute);
  });
}

}  // namespace

TEST_CASE("pipeline: a stage's parameters equal the single-process model's") {
  auto& w = weft::test::world();
  const auto cfg = tiny(2);
  weft::nn::GPT<float> gpt(cfg);
  std::map<std::string, weft::nn::Parameter<float, Space>*> by_name;
  for (auto* p : gpt.parameters()) by_name[p->name()] = p;
  for (int chunks : {1, 2}) {
    if (std::size_t(w.size() * chunks) > weft::pipeline::unit_count(cfg.layers)) continue;
    const auto part = weft::pipeline::equal_partition(cfg.layers, std::size_t(w.size() * chunks));
    weft::pipeline::Stage<float> stage(cfg, part, w.size(), w.rank(), chunks);
    std::size_t local = 0;
    for (auto* p : stage.parameters()) {
      REQUIRE(by_name.count(p->name()) == 1);
      auto* q = by_name[p->name()];
      REQUIRE(p->size() == q->size());
      auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p->value);
      auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), q->value);
      bool same = true;
      for (std::size_t i = 0; i < a.extent(0); ++i) same = same && a(i) == b(i);
      CHECK_MESSAGE(same, p->name());
      local += p->size();
    }
    // Every parameter lives on exactly one rank.
    Kokkos::View<std::size_t*, Kokkos::HostSpace> v("n", 1);
    v(0) = local;
    w.all_reduce(v);
    CHECK(v(0) == gpt.num_parameters());
  }
}

TEST_CASE("pipeline: every schedule on pp = world follows the single-process loss curve") {
  auto& w = weft::test::world();
  const auto& ref = reference_losses();
  std::vector<std::string> schedules = {"gpipe", "1f1b", "zb"};
  if (w.size() >= 2) schedules.push_back("interleaved:2");
  for (const auto& s : schedules) {
    CAPTURE(s);
    const std::size_t m = std::size_t(std::max(4, w.size()));
    const auto r = run_pipeline(w, nullptr, s, m);
    double worst = 0;
    for (std::size_t i = 0; i < kSteps; ++i) worst = std::max(worst, rel(r.loss[i], ref[i]));
    CAPTURE(worst);
    CHECK(worst <= 1e-5);
    CHECK(r.loss.back() < r.loss.front());
    // The activations held: what the schedule promises, plus the slot of the
    // receive posted ahead of the compute that needs it.
    CHECK(r.peak_slots <= std::size_t(r.promised_peak) + 1);
  }
}

TEST_CASE("pipeline: recompute in every schedule gives the same losses and gradients, with fewer saved activations") {
  auto& w = weft::test::world();
  std::vector<std::string> schedules = {"gpipe", "1f1b", "zb"};
  if (w.size() >= 2) schedules.push_back("interleaved:2");
  constexpr std::size_t steps = 4;
  for (const auto& s : schedules) {
    CAPTURE(s);
    const std::size_t m = std::size_t(std::max(4, w.size()));
    const auto plain = run_pipeline(w, nullptr, s, m, steps);
    const auto rc = run_pipeline(w, nullptr, s, m, steps, {}, true);
    // Recomputing a block's forward from its input repeats the same kernels on
    // the same values, so losses and gradients are bit-identical. A stage that
    // reused the shared set for another microbatch's activations (it holds the
    // last forward's, whichever microbatch that was) is off from the first
    // step; one whose zero-bubble weight halves read overwritten inputs is off
    // in its gradients.
    double loss_gap = 0;
    for (std::size_t i = 0; i < steps; ++i) loss_gap = std::max(loss_gap, rel(rc.loss[i], plain.loss[i]));
    CAPTURE(loss_gap);
    CHECK(rc.loss == plain.loss);
    REQUIRE(rc.grads.size() == plain.grads.size());
    bool same = true;
    for (std::size_t i = 0; i < rc.grads.size(); ++i) same = same && rc.grads[i] == plain.grads[i];
    CHECK(same);
    CHECK(rc.peak_slots == plain.peak_slots);
    // The ledger: slots keep only their residual streams, and one set of
    // saved tensors serves every block of the rank.
    // On a rank whose chunks hold one block and one slot at a time the two
    // are equal; over the pipeline recompute keeps less.
    CAPTURE(plain.activation_bytes);
    CAPTURE(rc.activation_bytes);
    CHECK(rc.activation_bytes <= plain.activation_bytes);
    Kokkos::View<double*, Kokkos::HostSpace> total("activation bytes", 2);
    total(0) = double(plain.activation_bytes), total(1) = double(rc.activation_bytes);
    w.all_reduce(total);
    CAPTURE(total(0));
    CAPTURE(total(1));
    CHECK(total(1) < 0.8 * total(0));
  }
}

namespace {

// What each step of a precision run reports.
struct PrecisionRun {
  std::vector<double> loss, scale;
  std::vector<int> skipped;
  std::uint64_t sent_bytes = 0;   // pipelined: bytes this rank sent over pp, all steps
  std::size_t wire_bytes = 0;     // pipelined: the executor's wire buffers after the last step
  std::size_t activation_bytes = 0;  // pipelined: the ledger's activations after the last step
  bool stashed = false;              // pipelined: the stage keeps 2-byte saved activations
  void add(const weft::optim::StepResult& r) {
    loss.push_back(r.loss);
    scale.push_back(r.loss_scale);
    skipped.push_back(r.skipped ? 1 : 0);
  }
};

using NoDP = weft::parallel::DataParallel<float, weft::Replicated>;

// The one-process GPT in precision Prec on m microbatches of the global
// batch per step (a loss-scaled Prec with a scaler built from o).
template <class Prec>
PrecisionRun one_process(std::size_t m, const weft::DynamicLossScalerOptions& o = {}) {
  // Without recompute a 2-byte GPT keeps 2-byte copies of its saved
  // activations, and so do the stages.
  const auto cfg = tiny(kGlobalBatch / m);
  weft::nn::GPT<float, weft::Strategy<Prec>> gpt(cfg);
  weft::optim::AdamW<float, Space> opt(gpt.parameters());
  weft::DynamicLossScaler scaler(o);
  auto data = successor_stream();
  Kokkos::View<int*> ids("ids", cfg.tokens()), tg("tg", cfg.tokens());
  PrecisionRun run;
  for (std::size_t s = 0; s < kSteps; ++s) {
    if constexpr (Prec::loss_scaled)
      run.add(weft::optim::train_step(gpt, opt, data, s, m, ids, tg, kLr, kClip, scaler));
    else
      run.add(weft::optim::train_step(gpt, opt, data, s, m, ids, tg, kLr, kClip));
  }
  return run;
}

// The same model as a pipeline over pp (schedule Sched) whose strategy has precision Prec.
template <class Prec, class Sched = weft::OneFOneB>
PrecisionRun pipelined(weft::Comm& pp, std::size_t m, std::size_t steps, const weft::DynamicLossScalerOptions& o = {}) {
  using S = weft::Strategy<weft::On<weft::PP, weft::Pipeline<Sched>>, Prec>;
  const auto cfg = tiny(kGlobalBatch / m);
  weft::pipeline::Stage<float, S> stage(cfg, weft::pipeline::equal_partition(cfg.layers, std::size_t(pp.size())), pp.size(),
                                        pp.rank(), 1);
  weft::optim::AdamW<float, Space> opt(stage.parameters());
  weft::pipeline::Executor ex(stage, pp, weft::Pipeline<Sched>(pp.size(), int(m)));
  weft::DynamicLossScaler scaler(o);
  auto data = successor_stream();
  PrecisionRun run;
  const std::uint64_t sent0 = pp.stats()[weft::CommKind::send].bytes;
  for (std::size_t s = 0; s < steps; ++s) {
    if constexpr (Prec::loss_scaled)
      run.add(weft::pipeline::train_step(ex, static_cast<NoDP*>(nullptr), opt, data, s, kGlobalBatch, kLr, kClip, scaler));
    else
      run.add(weft::pipeline::train_step(ex, static_cast<NoDP*>(nullptr), opt, data, s, kGlobalBatch, kLr, kClip));
  }
  run.sent_bytes = pp.stats()[weft::CommKind::send].bytes - sent0;
  run.wire_bytes = ex.wire_buffer_bytes();
  run.activation_bytes = ex.memory().bytes(weft::metrics::MemoryCategory::activations);
  run.stashed = stage.saves_2_byte_activations();
  CHECK(ex.memory().bytes("pipeline.wire_buffers") == run.wire_bytes);
  return run;
}

double worst_rel(const std::vector<double>& a, const std::vector<double>& b, std::size_t n) {
  double w = 0;
  for (std::size_t i = 0; i < n; ++i) w = std::max(w, rel(a[i], b[i]));
  return w;
}

}  // namespace

// The bounds of the two tests below on the stages' 2-byte messages
// (Executor::wire_type: activations and input gradients cross each stage
// boundary rounded to bf16 or fp16, where the one-process model keeps its
// residual stream in fp32). Measured on this tiny model at pp = 2 and 4
// against the one-process curve: bf16 1.0e-5 and 1.4e-5 at step 0, at most
// 2.7e-5 and 7.6e-5 over steps 0-4, and 1.1e-4 and 4.4e-4 over 20 steps
// (weights crossing bf16 rounding boundaries make the later steps drift);
// fp16 at most 4.0e-5 and 7.1e-5. The bounds leave a factor of 3.5 to 4.5
// over the worst of these. Broken on purpose (measured at pp = 2 and 4):
// activations received but not widened into the slot (the stage reads a
// stale input) are 3.3e-3 off at step 0, 65 times the first step's bound;
// gradients received but not widened (a stale dy) cannot show before the
// first update, and are 1.8e-3 and 4.1e-3 off at step 1, 6 and 13 times the
// bound of steps 0-4.
constexpr double kWireFirstStep = 5e-5, kWireFirstSteps = 3e-4, kWireCurve = 2e-3;
constexpr std::size_t kFirstSteps = 5;

// A pipelined curve through 2-byte messages against the one-process curve:
// within the bounds above at step 0, over the first steps and over all.
void check_wire_curve(const std::vector<double>& got, const std::vector<double>& ref) {
  const double first = rel(got[0], ref[0]), early = worst_rel(got, ref, kFirstSteps), worst = worst_rel(got, ref, kSteps);
  CAPTURE(first);
  CAPTURE(early);
  CAPTURE(worst);
  CHECK(first <= kWireFirstStep);
  CHECK(early <= kWireFirstSteps);
  CHECK(worst <= kWireCurve);
  CHECK(got.back() < got.front());
}

// A pipeline of this rank alone (no messages, so no rounding of the wire):
// the stages' products against the one-process model's, bit for bit.
weft::Comm self_pp() { return weft::Comm::duplicate(MPI_COMM_SELF, "pp.self"); }

TEST_CASE("pipeline: bf16 products (Precision<BF16>) on pp = world follow the one-process bf16 curve") {
  auto& w = weft::test::world();
  using BF16 = weft::Precision<weft::BF16>;
  static_assert(std::is_same_v<weft::pipeline::Stage<float, weft::Strategy<weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>, BF16>>,
                               weft::pipeline::GPTStage<float, Space, weft::NoPolicy, BF16>>);
  using Ex = weft::pipeline::Executor<weft::pipeline::GPTStage<float, Space, weft::NoPolicy, BF16>, weft::OneFOneB>;
  static_assert(Ex::narrow_wire && std::is_same_v<Ex::wire_type, weft::bf16>);
  static_assert(!weft::pipeline::Executor<weft::pipeline::Stage<float>, weft::OneFOneB>::narrow_wire);
  const std::size_t m = std::size_t(std::max(4, w.size()));
  // The reference: the one-process bf16 model on the same microbatches. (Not
  // the whole batch as one microbatch: a weight gradient summed over other
  // microbatches differs in its last fp32 bits, which moves a few weights
  // across a bf16 rounding boundary from step 2 on; the curves then drift
  // apart by up to 4e-5 in 20 steps, more than fp32 and bf16 differ on this
  // tiny model.)
  const auto ref = one_process<BF16>(m);
  // One pipeline rank: the stage computes as the one-process model.
  weft::Comm self = self_pp();
  const auto alone = pipelined<BF16>(self, m, kSteps);
  // The bug this guards against: a stage that computes in fp32 whatever the
  // strategy says (as the stage did before it read the precision).
  const auto fp32_alone = pipelined<weft::Precision<>>(self, m, 3);
  // The bound: measured, the one-rank stage's curve equals the reference bit
  // for bit over the 20 steps (the same products on the same operands, the
  // same 2-byte copies of the saved activations, summed in the same order);
  // 1e-6 leaves room for a backend whose kernels sum in another order. The
  // fp32 stage is 4.0e-5 off within 3 steps (4.7e-6 at step 0 on this tiny
  // model), 40 times the bound; a stage that skips writing a block's 2-byte
  // input back before its backward (reading whatever the shared residual
  // buffer last held) is 1.1e-3 off, 1000 times.
  const double tolerance = 1e-6;
  const double exact = worst_rel(alone.loss, ref.loss, kSteps), gap = worst_rel(fp32_alone.loss, ref.loss, 3);
  CAPTURE(exact);
  CAPTURE(gap);
  CHECK(exact <= tolerance);
  CHECK(gap > 10 * tolerance);
  CHECK(alone.wire_bytes == 0);
  // Zero-bubble's deferred weight halves read copies of their inputs (the
  // stash's float working set is refilled before they run): the same curve.
  const auto zb_alone = pipelined<BF16, weft::ZeroBubble>(self, m, kSteps);
  const double zb_exact = worst_rel(zb_alone.loss, ref.loss, kSteps);
  CAPTURE(zb_exact);
  CHECK(zb_exact <= tolerance);
  // The slots keep 2-byte copies, as the one-process model does.
  CHECK(alone.stashed);
  CHECK(!fp32_alone.stashed);
  // Measured: 0.539 of the fp32 stage's activation bytes on one rank (the
  // logits and the messages' buffers stay fp32).
  const double saved_ratio = double(alone.activation_bytes) / double(fp32_alone.activation_bytes);
  CAPTURE(saved_ratio);
  CHECK(saved_ratio < 0.6);
  // pp = world: the same curve through bf16 messages, within the wire's bounds.
  const auto bf16 = pipelined<BF16>(w, m, kSteps);
  const auto fp32 = pipelined<weft::Precision<>>(w, m, 3);
  check_wire_curve(bf16.loss, ref.loss);
  // Half the bytes per step of the fp32 stage's messages, every message.
  CHECK(bf16.sent_bytes * 3 * 2 == fp32.sent_bytes * kSteps);
  CHECK((bf16.sent_bytes > 0) == (w.size() > 1));
  CHECK((bf16.wire_bytes > 0) == (w.size() > 1));
  CHECK(fp32.wire_bytes == 0);
}

TEST_CASE("pipeline: fp16 products with dynamic loss scaling follow the one-process fp16 run, skipped steps included") {
  auto& w = weft::test::world();
  using FP16 = weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale>;
  const std::size_t m = std::size_t(std::max(4, w.size()));
  // A first scale that overflows the fp16 operands (the loss gradient times
  // 2^24 exceeds fp16's 65504): the first steps are skipped and the scale
  // halves each time (hysteresis 1), until the gradients fit.
  weft::DynamicLossScalerOptions o;
  o.initial_scale = 16777216.0;
  o.hysteresis = 1;
  o.growth_interval = 1000;
  const auto ref = one_process<FP16>(m, o);
  std::size_t skipped = 0;
  for (int k : ref.skipped) skipped += std::size_t(k);
  CAPTURE(skipped);
  CHECK(skipped >= 1);            // the overflow path ran
  CHECK(skipped + 5 <= kSteps);  // and enough steps trained to compare curves
  // One pipeline rank: bit for bit, as for bf16.
  weft::Comm self = self_pp();
  const auto alone = pipelined<FP16>(self, m, kSteps, o);
  CHECK(alone.skipped == ref.skipped);
  CHECK(alone.scale == ref.scale);
  const double exact = worst_rel(alone.loss, ref.loss, kSteps);
  CAPTURE(exact);
  CHECK(exact <= 1e-6);
  // pp = world, through fp16 messages (scaled gradients that overflow fp16
  // become infinities, which the scaler sees as the one process does):
  // every rank skips the same steps at the same scales as the one process.
  const auto fp16 = pipelined<FP16>(w, m, kSteps, o);
  CHECK(fp16.skipped == ref.skipped);
  CHECK(fp16.scale == ref.scale);
  check_wire_curve(fp16.loss, ref.loss);
}

TEST_CASE("pipeline: the cap of in-flight gradient sends: waiting in place follows the curve; a cap that can deadlock is refused") {
  auto& w = weft::test::world();
  if (w.size() < 2) return;
  const auto& ref = reference_losses();
  const std::size_t m = std::size_t(std::max(4, w.size()));
  // 1F1B with no send buffer: every retiring slot waits for its gradient send.
  weft::pipeline::ExecutorOptions eo;
  eo.send_buffers = 0;
  const auto r = run_pipeline(w, nullptr, "1f1b", m, 6, eo);
  for (std::size_t i = 0; i < r.loss.size(); ++i) CHECK(rel(r.loss[i], ref[i]) <= 1e-5);
  // interleaved:2 needs one buffer: without it a rank can wait on a send
  // whose receive its peer posts only after a message this rank sends later.
  using Il2 = weft::Interleaved1F1B<2>;
  const auto cfg = tiny(kGlobalBatch / m);
  weft::pipeline::Stage<float> stage(cfg, weft::pipeline::equal_partition(cfg.layers, std::size_t(2 * w.size())), w.size(),
                                     w.rank(), 2);
  if (w.size() == 2) {
    CHECK_THROWS_WITH_AS(weft::pipeline::Executor(stage, w, weft::Pipeline<Il2>(w.size(), int(m)), eo),
                         doctest::Contains("ExecutorOptions::send_buffers = 0 can deadlock schedule interleaved:2 on 2 "
                                           "ranks with 4 microbatches; the smallest safe value is 1"),
                         weft::ConfigError);
  }
  // The default cap: one preallocated buffer of one message on every rank
  // that sends gradients, none on the rank that holds only the embedding.
  weft::pipeline::Executor ex(stage, w, weft::Pipeline<Il2>(w.size(), int(m)));
  CHECK(ex.send_buffers() == 1);
  std::size_t bytes = 0;
  const auto ledger = stage.memory();
  for (const auto& i : ledger.items())
    if (i.label == "pipeline.send_buffers") bytes += i.bytes;
  CHECK(bytes == stage.config().tokens() * stage.config().d_model * sizeof(float));
}

TEST_CASE("pipeline: dp x pp = 2 x 2 with replicate, zero1, zero2 and fsdp follows the single-process curve") {
  auto& w = weft::test::world();
  if (w.size() != 4) return;
  using M = weft::Mesh<weft::DP, weft::PP>;
  M mesh(w, {.dp = 2, .pp = 2});
  const auto& ref = reference_losses();
  weft::test::for_each_dp_policy([&]<class Policy>() {
    for (std::string s : {"1f1b", "interleaved:2", "zb"}) {
      CAPTURE(s);
      CAPTURE(Policy::policy_name());
      const auto r = run_pipeline<Policy>(mesh.axis<weft::PP>(), &mesh.axis<weft::DP>(), s, 2);
      double worst = 0;
      for (std::size_t i = 0; i < kSteps; ++i) worst = std::max(worst, rel(r.loss[i], ref[i]));
      CAPTURE(worst);
      CHECK(worst <= 1e-5);
    }
  });
}

TEST_CASE("pipeline: zero-bubble with zero2 and fsdp over dp = world follows the single-process curve") {
  // Weight gradients arrive after the group hooks' after_backward; zero2 and
  // fsdp reduce-scatter each group after its last weight half instead.
  auto& w = weft::test::world();
  using M = weft::Mesh<weft::DP, weft::PP>;
  M mesh(w, {.dp = w.size(), .pp = 1});
  const auto& ref = reference_losses();
  auto one = [&]<class Policy>() {
    CAPTURE(Policy::policy_name());
    const auto r = run_pipeline<Policy>(mesh.axis<weft::PP>(), &mesh.axis<weft::DP>(), "zb", 2);
    double worst = 0;
    for (std::size_t i = 0; i < kSteps; ++i) worst = std::max(worst, rel(r.loss[i], ref[i]));
    CAPTURE(worst);
    CHECK(worst <= 1e-5);
  };
  one.template operator()<weft::ZeRO<2>>();
  one.template operator()<weft::FullyShard>();
}

TEST_CASE("pipeline: bad schedules and stage specifications are named") {
  CHECK_THROWS_WITH_AS(weft::pipeline::parse_schedule("interleaved:1"), doctest::Contains("between 2 and 8"),
                       weft::ConfigError);
  CHECK_THROWS_WITH_AS(weft::pipeline::parse_schedule("pipedream"), doctest::Contains("unknown schedule"),
                       weft::ConfigError);
  auto& w = weft::test::world();
  if (w.size() >= 2) {
    // 1F1B needs at least as many microbatches as stages.
    CHECK_THROWS_WITH_AS(run_pipeline(w, nullptr, "1f1b", 1, 1),
                         doctest::Contains("microbatches >= stages"), weft::ConfigError);
  }
}

// Run by CTest as an expected failure only (tests/CMakeLists.txt): rank 1
// throws halfway through its plan on the second step; every rank must end the
// test case with an error within the deadline, none may hang.
TEST_CASE("pipeline: a rank that throws mid-schedule fails on purpose") {
  auto& w = weft::test::world();
  weft::pipeline::ExecutorOptions eo;
  int calls = 0;
  eo.before_action = [&](const weft::PipeAction&, std::size_t k) {
    ++calls;
    if (w.rank() == 1 && calls > 10 && k == 7) throw std::runtime_error("deliberate failure on pipeline rank 1");
  };
  run_pipeline(w, nullptr, "1f1b", std::size_t(std::max(4, w.size())), 3, eo);
}
