// The planner against measurement, for the strategies that need several
// ranks: the memory budget of every pipeline rank (pp = world size, each
// schedule) against what its Stage and optimizer allocate, category by
// category; the pipeline's point-to-point bytes and the tensor-parallel bytes
// per collective kind (with and without sequence parallelism) against the
// CommStats of a real step; the planner's bubble against the pipeline
// simulator; dp x pp = 2 x 2 in every dp mode (and zb under zero2 and fsdp);
// pp x tp = 2 x 2 with and without sequence parallelism for every schedule;
// dp x pp x tp = 2 x 2 x 2 at 8 ranks; bf16 stages (2-byte stashes and
// messages) at pp = world. Every comparison is exact
// (the budgets and volumes are formulas of weft's own allocation and
// communication, docs/plan.md) except the transient DP buffers whose peak
// depends on when MPI completes a request (zero2's group gradients, fsdp's
// gathered groups in a pipeline), which are checked between bounds. The
// pipeline's send buffers are exact too: the executor preallocates its cap of
// in-flight gradient sends (weft/parallel/pipeline/send_cap.hpp).
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/parallel/pipeline/executor.hpp>
#include <weft/parallel/pipeline/simulator.hpp>
#include <weft/plan/meshes.hpp>
#include <weft/plan/memory.hpp>

#include "../parallel/tiny_gpt.hpp"
#include "spec_of_gpt.hpp"
#include "weft_test.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;
using C = weft::metrics::MemoryCategory;
using weft::plan::MeshSpec;
using weft::plan::ModelSpec;
using weft::test::spec_of;

// Eight blocks: interleaved:2 on four ranks has a block per virtual stage.
weft::nn::GPTConfig pipe_gpt(std::size_t microbatch) {
  weft::nn::GPTConfig c;
  c.layers = 8;
  c.d_model = 16;
  c.heads = 2;
  c.seq = 8;
  c.vocab = 32;
  c.batch = microbatch;
  c.seed = 5;
  return c;
}

weft::data::TokenStream stream(int vocab) {
  std::vector<int> toks(2000);
  std::uint64_t x = 99;
  for (auto& t : toks) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = int((x >> 33) % std::uint64_t(vocab));
  }
  return weft::data::TokenStream(std::move(toks), 8, 3);
}

// The activation slots a chunk allocated in the step and their message
// buffers (received output gradient, input gradient to send): taken back out
// of the chunk's pool one by one until taking one allocates a new slot.
struct PooledSlots {
  std::size_t count = 0, message_bytes = 0;
};
template <class St>
PooledSlots pooled_slots(St& st, int chunk) {
  PooledSlots r;
  const std::size_t base = st.memory().bytes("pipeline.slots");
  for (int mb = 1000;; ++mb) {
    auto& s = st.slot(mb, chunk);
    if (st.memory().bytes("pipeline.slots") != base) break;  // the pool was empty: a fresh slot
    ++r.count;
    r.message_bytes += weft::nn::detail::bytes_of(s.dy) + weft::nn::detail::bytes_of(s.dx);
  }
  st.release_all();
  return r;
}

// The slots of every chunk against the planner's layout; their totals.
template <class St>
PooledSlots checked_slots(St& st, const std::vector<weft::plan::ChunkLayout>& layout) {
  REQUIRE(layout.size() == st.chunks().size());
  PooledSlots all;
  for (std::size_t c = 0; c < layout.size(); ++c) {
    const auto p = pooled_slots(st, int(c));
    CAPTURE(c);
    CHECK(p.count == layout[c].slots);  // in-flight microbatches of this chunk
    all.count += p.count;
    all.message_bytes += p.message_bytes;
  }
  return all;
}

// What a pipeline rank allocated, split the way the planner splits it, from
// its stage's ledger `led` (taken before checked_slots adds probe slots),
// its optimizer's and, with data parallelism, DataParallel's (`dp`).
// Labels a configuration does not have count zero.
struct StageMeasured {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0, temporary = 0, communication = 0,
         send_buffers = 0, workspace = 0;
};
StageMeasured measure_stage(const weft::metrics::MemoryLedger& led, const weft::metrics::MemoryLedger* dp,
                            const weft::metrics::MemoryLedger& opt, const PooledSlots& slots) {
  StageMeasured r;
  const auto& owner = dp ? *dp : led;  // DataParallel holds the (sharded) parameters and gradients
  r.parameters = double(owner.bytes(C::parameters));
  r.gradients = double(owner.bytes(C::gradients));
  r.optimizer = double(opt.bytes(C::optimizer_state));
  // zb's pooled copies of output gradients are activations; the slots'
  // message buffers are communication.
  // Under recompute: the one saved set the blocks share.
  r.activations = double(led.bytes("pipeline.slots") - slots.message_bytes +
                         led.bytes("pipeline.deferred_output_gradients") +
                         led.bytes("pipeline.blocks.shared"));
  r.workspace = double(led.bytes("pipeline.backward_workspace"));
  r.temporary = r.workspace + double(led.bytes("tensor-parallel buffers"));
  r.send_buffers = double(led.bytes("pipeline.send_buffers"));
  r.communication = double(slots.message_bytes) + r.send_buffers;
  if (dp) {
    r.temporary += double(dp->bytes("dp.gathered_groups_peak"));
    r.communication += double(dp->bytes("dp.communication_buffers"));
  }
  return r;
}

// Every category against budget b, exactly (the temporaries only when
// `exact_temporary`: zero2's and fsdp's peaks depend on timing and are
// checked by the caller), and the step's pipeline traffic against the
// planner's volume.
void check_stage_budget(const StageMeasured& got, const weft::plan::TrainingBudget& b, const ModelSpec& spec,
                        const MeshSpec& s, std::size_t pp_rank, const weft::CommStats& pstats, bool exact_temporary) {
  CHECK(got.parameters == b.parameters);
  CHECK(got.gradients == b.gradients);
  CHECK(got.optimizer == b.optimizer_state);
  CHECK(got.activations == b.activations);
  if (exact_temporary) CHECK(got.temporary == b.temporary);
  CHECK(got.communication == b.communication);
  CHECK(got.send_buffers == weft::plan::pipeline_send_buffer_bytes(spec, s, pp_rank));
  const auto v = weft::plan::comm_volume(spec, s, pp_rank);
  using K = weft::CommKind;
  CHECK(double(pstats[K::send].bytes) == v.pp_send);
  CHECK(double(pstats[K::recv].bytes) == v.pp_recv);
  CHECK(double(pstats[K::all_reduce].bytes) == v.pp_all_reduce);
}

// One training step of this pipeline rank as the runtime runs it: the stage
// of `schedule` (TP-split over `tp`), DataParallel<float, Policy> over `dpc`
// when there is one (its hooks set on the stage), AdamW, the executor on `m`
// microbatches of a `global_batch`; `pstats` holds the PP axis' statistics
// of the step.
template <class Sched, class LayerPolicy, class Policy = weft::Replicated>
struct StageStep {
  weft::pipeline::GPTStage<float, Space, LayerPolicy> stage;
  std::unique_ptr<weft::parallel::DataParallel<float, Policy>> ddp;
  weft::optim::AdamW<float, Space> opt;
  weft::pipeline::Executor<weft::pipeline::GPTStage<float, Space, LayerPolicy>, Sched> ex;
  weft::CommStats pstats;

  StageStep(const weft::nn::GPTConfig& cfg, weft::Comm& ppc, weft::Comm* dpc, weft::Comm* tp, std::size_t m,
            std::size_t global_batch)
      : stage(cfg, weft::pipeline::equal_partition(cfg.layers, std::size_t(ppc.size()) * std::size_t(Sched::chunks)),
              ppc.size(), ppc.rank(), Sched::chunks, tp),
        ddp(dpc ? std::make_unique<weft::parallel::DataParallel<float, Policy>>(*dpc, stage.parameter_groups())
                : nullptr),
        opt(ddp ? ddp->optimizer_parameters() : stage.parameters()),
        ex(stage, ppc, weft::Pipeline<Sched>(ppc.size(), int(m))) {
    if (ddp) stage.set_hooks(ddp.get());
    auto data = stream(int(cfg.vocab));
    ppc.reset_stats();
    weft::pipeline::train_step(ex, ddp.get(), opt, data, 0, global_batch, 1e-3, 1.0);
    pstats = ppc.stats();
  }
  StageStep(const StageStep&) = delete;
  StageStep& operator=(const StageStep&) = delete;
  ~StageStep() { stage.set_hooks(nullptr); }
};

// Runs body(step) on the StageStep of the schedule `name` (as on the command
// line) with the layers split as LayerPolicy says and DataParallel of Policy.
template <class LayerPolicy, class Policy, class Body>
void with_step(const weft::nn::GPTConfig& cfg, const std::string& name, weft::Comm& ppc, weft::Comm* dpc, weft::Comm* tp,
               std::size_t m, std::size_t global_batch, Body&& body) {
  weft::pipeline::visit_schedule(name, [&]<class S>(std::type_identity<S>) {
    StageStep<S, LayerPolicy, Policy> run(cfg, ppc, dpc, tp, m, global_batch);
    body(run);
  });
}
// The same over TP, with or without sequence parallelism.
template <class Policy, class Body>
void with_tp_step(bool sp, const weft::nn::GPTConfig& cfg, const std::string& name, weft::Comm& ppc, weft::Comm* dpc,
                  weft::Comm* tp, std::size_t m, std::size_t global_batch, Body&& body) {
  if (sp) with_step<weft::TensorParallel<weft::SequenceParallel>, Policy>(cfg, name, ppc, dpc, tp, m, global_batch, body);
  else with_step<weft::TensorParallel<>, Policy>(cfg, name, ppc, dpc, tp, m, global_batch, body);
}

}  // namespace

TEST_CASE("pipeline: each rank's budget equals what its stage allocates, per category, for every schedule") {
  auto& w = weft::test::world();
  const std::size_t pp = std::size_t(w.size());
  if (pp < 2 || pp > 4) return;  // 8 blocks: interleaved:2 at pp = 8 would have empty virtual stages
  const std::size_t m = 4, mb = 2;  // microbatches per step (a multiple of pp), sequences per microbatch
  for (bool recompute : {false, true})
  for (std::string name : {"gpipe", "1f1b", "interleaved:2", "zb"}) {
    CAPTURE(recompute);
    CAPTURE(name);
    auto cfg = pipe_gpt(mb);
    cfg.recompute = recompute;
    const ModelSpec spec = spec_of(cfg, m);
    const auto kind_chunks = weft::plan::parse_schedule_name(name);
    const auto kind = kind_chunks.first;
    const auto chunks = kind_chunks.second;
    with_step<weft::NoPolicy, weft::Replicated>(cfg, name, w, nullptr, nullptr, m, m * mb, [&](auto& run) {
    auto& stage = run.stage;
    auto& opt = run.opt;
    const auto& stats = run.pstats;

    const MeshSpec mesh{.pp = pp, .schedule = kind, .chunks = chunks};
    const auto b = weft::plan::stage_memory(spec, mesh, std::size_t(w.rank()), 0.0);
    const auto layout = weft::plan::rank_layout(spec, mesh, std::size_t(w.rank()));
    const auto led = stage.memory();
    const auto slots = checked_slots(stage, layout);
    const auto got = measure_stage(led, nullptr, opt.memory(), slots);
    check_stage_budget(got, b, spec, mesh, std::size_t(w.rank()), stats, true);
    const auto v = weft::plan::comm_volume(spec, mesh, std::size_t(w.rank()));
    using K = weft::CommKind;

    // The figures docs/plan.md quotes, one line per rank.
    for (int r = 0; r < w.size(); ++r) {
      if (r == w.rank())
        std::printf("validation pp=%zu %-13s%s rank %d slots %zu/%zu parameters %zu/%.0f gradients %zu/%.0f "
                    "optimizer %zu/%.0f activations %.0f/%.0f temporary %zu/%.0f communication %.0f/%.0f "
                    "p2p-sent %llu/%.0f\n",
                    pp, name.c_str(), recompute ? " recompute" : "", w.rank(), slots.count, [&] {
                      std::size_t n = 0;
                      for (const auto& k : layout) n += k.slots;
                      return n;
                    }(), led.bytes(C::parameters), b.parameters, led.bytes(C::gradients), b.gradients,
                    opt.memory().bytes(C::optimizer_state), b.optimizer_state, got.activations, b.activations,
                    led.bytes("pipeline.backward_workspace"), b.temporary, got.communication, b.communication,
                    static_cast<unsigned long long>(stats[K::send].bytes), v.pp_send);
      std::fflush(stdout);
      w.barrier();
    }
    });
  }
}

TEST_CASE("pipeline in bf16: 2-byte stashes and messages, each rank's activations and bytes sent as the planner says") {
  auto& w = weft::test::world();
  const std::size_t pp = std::size_t(w.size());
  if (pp < 2 || pp > 4) return;
  const std::size_t m = 4, mb = 2;
  using BF16 = weft::Precision<weft::BF16>;
  using StageT = weft::pipeline::GPTStage<float, Space, weft::NoPolicy, BF16>;
  for (std::string name : {"1f1b", "interleaved:2", "zb"}) {
    CAPTURE(name);
    const auto cfg = pipe_gpt(mb);
    auto spec = spec_of(cfg, m);
    spec.saved_bytes = spec.product_bytes = 2;
    const auto kind_chunks = weft::plan::parse_schedule_name(name);
    const MeshSpec mesh{.pp = pp, .schedule = kind_chunks.first, .chunks = kind_chunks.second};
    weft::pipeline::visit_schedule(name, [&]<class S>(std::type_identity<S>) {
      StageT stage(cfg, weft::pipeline::equal_partition(cfg.layers, pp * std::size_t(S::chunks)), w.size(), w.rank(),
                   S::chunks);
      REQUIRE(stage.saves_2_byte_activations());
      weft::optim::AdamW<float, Space> opt(stage.parameters());
      weft::pipeline::Executor<StageT, S> ex(stage, w, weft::Pipeline<S>(w.size(), int(m)));
      auto data = stream(int(cfg.vocab));
      w.reset_stats();
      weft::pipeline::train_step(ex, static_cast<weft::parallel::DataParallel<float, weft::Replicated>*>(nullptr), opt,
                                 data, 0, m * mb, 1e-3, 1.0);
      const auto pstats = w.stats();
      const std::size_t r = std::size_t(w.rank());
      const auto b = weft::plan::stage_memory(spec, mesh, r, 0.0);
      const auto led = ex.memory();
      const auto slots = checked_slots(stage, weft::plan::rank_layout(spec, mesh, r));
      // The slots' 2-byte copies of each block input and dense block's saved
      // tensors, beside their chunk's float input and output: to the byte.
      const double act = double(led.bytes("pipeline.slots") - slots.message_bytes +
                                led.bytes("pipeline.deferred_output_gradients"));
      CHECK(act == b.activations);
      // The float working set, the residual pair, the product staging and the
      // backward workspace: the staging's slots are the whole model's largest
      // (a rank without the embedding reads no position table), so within 15 %.
      const double temp = double(led.bytes("pipeline.backward_workspace") + led.bytes("pipeline.blocks.working") +
                                 led.bytes("pipeline.residual.working") + led.bytes("product staging"));
      CHECK(temp <= b.temporary);
      CHECK(temp >= 0.85 * b.temporary);
      // Messages: the slots' float dy and dx, and the pooled 2-byte wire
      // buffers, which the planner bounds from above; no fp32 send buffers.
      const double wire = double(led.bytes("pipeline.wire_buffers"));
      CHECK(led.bytes("pipeline.send_buffers") == 0);
      CHECK(wire <= weft::plan::pipeline_wire_buffer_bytes(spec, mesh, r));
      CHECK(double(slots.message_bytes) + wire <= b.communication);
      // The messages travel at 2 bytes an element: exactly the planner's volume.
      const auto v = weft::plan::comm_volume(spec, mesh, r);
      using K = weft::CommKind;
      CHECK(double(pstats[K::send].bytes) == v.pp_send);
      CHECK(double(pstats[K::recv].bytes) == v.pp_recv);
      for (int q = 0; q < w.size(); ++q) {
        if (q == w.rank())
          std::printf("validation bf16 pp=%zu %-13s rank %d activations %.0f/%.0f temporary %.0f/%.0f wire %.0f/%.0f "
                      "p2p-sent %llu/%.0f\n",
                      pp, name.c_str(), w.rank(), act, b.activations, temp, b.temporary, wire,
                      weft::plan::pipeline_wire_buffer_bytes(spec, mesh, r),
                      static_cast<unsigned long long>(pstats[K::send].bytes), v.pp_send);
        std::fflush(stdout);
        w.barrier();
      }
    });
  }
}

TEST_CASE("tensor parallelism: the predicted bytes per collective kind equal a real step's CommStats") {
  auto& w = weft::test::world();
  const std::size_t tp = std::size_t(w.size());
  if (tp < 2 || 4 % tp != 0) return;
  for (bool swiglu : {false, true})
    for (bool sp : {false, true})
    for (bool recompute : {false, true})
    for (bool bf16 : {false, true}) {
      if (bf16 && !sp) continue;  // bf16 changes only the sequence-parallel gathers
      CAPTURE(swiglu);
      CAPTURE(sp);
      CAPTURE(recompute);
      CAPTURE(bf16);
      weft::nn::GPTConfig c;
      c.recompute = recompute;
      c.layers = 2;
      c.d_model = 32;
      c.heads = 4;
      c.seq = 8;
      c.vocab = 64;
      c.batch = 2;
      if (swiglu) {
        c.mlp = weft::nn::MlpKind::swiglu;
        c.norm = weft::nn::NormKind::rmsnorm;
        c.position = weft::nn::PositionKind::rotary;
      }
      const std::size_t M = 2;  // microbatches per step
      auto step = [&](auto& gpt) {
        weft::optim::AdamW<float, Space> opt(gpt.parameters());
        auto data = stream(int(c.vocab));
        Kokkos::View<int*> ids("ids", c.tokens()), tg("tg", c.tokens());
        w.reset_stats();
        weft::optim::train_step(gpt, opt, data, 0, M, ids, tg, 1e-3, 1.0);
      };
      if (sp && bf16) {
        weft::nn::GPT<float, weft::Strategy<weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>,
                                            weft::Precision<weft::BF16>>> gpt(c, w);
        step(gpt);
      } else if (sp) {
        weft::nn::GPT<float, weft::Strategy<weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>> gpt(c, w);
        step(gpt);
      } else {
        weft::nn::GPT<float, weft::Strategy<weft::On<weft::TP, weft::TensorParallel<>>>> gpt(c, w);
        step(gpt);
      }
      const auto& st = w.stats();
      auto spec = spec_of(c, M);
      if (bf16) spec.saved_bytes = spec.product_bytes = 2;
      const auto v = weft::plan::comm_volume(spec, MeshSpec{.tp = tp, .sequence_parallel = sp}, 0);
      using K = weft::CommKind;
      CHECK(double(st[K::all_reduce].bytes) == v.tp_all_reduce);
      CHECK(double(st[K::all_gather].bytes) == v.tp_all_gather);
      CHECK(double(st[K::reduce_scatter].bytes) == v.tp_reduce_scatter);
      if (w.rank() == 0)
        std::printf("validation tp=%zu sp=%d bf16=%d swiglu=%d recompute=%d all_reduce %llu/%.0f all_gather %llu/%.0f "
                    "reduce_scatter %llu/%.0f\n",
                    tp, int(sp), int(bf16), int(swiglu), int(recompute), static_cast<unsigned long long>(st[K::all_reduce].bytes), v.tp_all_reduce,
                    static_cast<unsigned long long>(st[K::all_gather].bytes), v.tp_all_gather,
                    static_cast<unsigned long long>(st[K::reduce_scatter].bytes), v.tp_reduce_scatter);
    }
}

TEST_CASE("schedules: the planner's bubble equals the simulated idle fraction; rejections; no pipeline, no schedule") {
  using weft::plan::Schedule;
  {
    // Without a pipeline the schedule changes nothing.
    ModelSpec spec;
    const auto plain = weft::plan::training_memory(spec, MeshSpec{}, 0.0);
    const auto inter = weft::plan::training_memory(spec, MeshSpec{.schedule = Schedule::interleaved, .chunks = 2}, 0.0);
    CHECK(inter.total() == plain.total());
    CHECK(inter.activations == plain.activations);
    // A schedule that cannot run the layout is a rejection naming it.
    spec.layers = 8;
    spec.micro_batch = 1;
    spec.global_batch = 6;  // m = 6 microbatches: not a multiple of pp = 4
    const weft::plan::Topology t;
    const auto r = weft::plan::rejection_reasons(spec, MeshSpec{.pp = 4, .schedule = Schedule::interleaved, .chunks = 2}, t);
    REQUIRE(r.size() == 1);
    CHECK(r[0].find("interleaved:2: ") == 0);
    CHECK(r[0].find("multiple of the stage count") != std::string::npos);
    CHECK(weft::plan::rejection_reasons(spec, MeshSpec{.pp = 4, .schedule = Schedule::gpipe}, t).empty());
    CHECK(weft::plan::rejection_reasons(spec, MeshSpec{.pp = 4, .schedule = Schedule::interleaved, .chunks = 4}, t).size() == 2);
  }
  struct Case {
    Schedule s;
    std::size_t chunks;
  };
  for (Case k : {Case{Schedule::gpipe, 1}, Case{Schedule::one_f_one_b, 1}, Case{Schedule::interleaved, 2},
                 Case{Schedule::interleaved, 4}, Case{Schedule::zero_bubble, 1}})
    for (int p : {2, 4})
      for (int m : {4, 8, 16}) {
        CAPTURE(weft::plan::schedule_name(k.s, k.chunks));
        CAPTURE(p);
        CAPTURE(m);
        std::vector<std::vector<weft::PipeAction>> plans;
        for (int r = 0; r < p; ++r) plans.push_back(weft::plan::schedule_plan(k.s, k.chunks, p, m, r));
        const auto sim = weft::simulate_pipeline(plans, m, int(k.chunks), weft::PipeCosts{});
        ModelSpec spec;
        spec.layers = 16;
        spec.micro_batch = 1;
        spec.global_batch = std::size_t(m);
        const double predicted =
            weft::plan::pipeline_bubble(spec, MeshSpec{.pp = std::size_t(p), .schedule = k.s, .chunks = k.chunks});
        CHECK(predicted == doctest::Approx(sim.idle_fraction()).epsilon(1e-12));
        if (weft::test::world().rank() == 0 && m == 8)
          std::printf("validation bubble %-13s p=%d m=%d predicted %.4f simulated %.4f\n",
                      weft::plan::schedule_name(k.s, k.chunks).c_str(), p, m, predicted, sim.idle_fraction());
      }
}

TEST_CASE("dp x pp = 2 x 2: each rank's budget against its stage, DataParallel and optimizer, per dp mode") {
  auto& w = weft::test::world();
  if (w.size() != 4) return;
  using M = weft::Mesh<weft::DP, weft::PP>;
  M mesh(w, {.dp = 2, .pp = 2});
  auto& ppc = mesh.axis<weft::PP>();
  auto& dpc = mesh.axis<weft::DP>();
  const std::size_t m = 2, mb = 2, dp = 2;  // microbatches per dp rank, sequences per microbatch
  const auto cfg = pipe_gpt(mb);
  ModelSpec spec = spec_of(cfg, m);
  spec.global_batch = dp * m * mb;
  using weft::parallel::DPMode;
  auto one = [&]<class Policy>(const std::string& name) {
    constexpr DPMode mode = Policy::mode;
    CAPTURE(weft::parallel::to_string(mode));
    CAPTURE(name);
    const auto kind_chunks = weft::plan::parse_schedule_name(name);
    const auto kind = kind_chunks.first;
    const auto chunks = kind_chunks.second;
    with_step<weft::NoPolicy, Policy>(cfg, name, ppc, &dpc, nullptr, m, spec.global_batch, [&](auto& run) {
    auto& stage = run.stage;
    auto& opt = run.opt;
    const auto& pstats = run.pstats;

    const MeshSpec s{.dp = dp, .pp = 2, .mode = mode, .schedule = kind, .chunks = chunks};
    const auto b = weft::plan::stage_memory(spec, s, std::size_t(ppc.rank()), 0.0);
    const auto d = run.ddp->memory();
    const auto led = stage.memory();
    const auto got = measure_stage(led, &d, opt.memory(), checked_slots(stage, weft::plan::rank_layout(spec, s, std::size_t(ppc.rank()))));
    // The pipeline axis carries the same point-to-point volume as without DP.
    check_stage_budget(got, b, spec, s, std::size_t(ppc.rank()), pstats, false);
    const double temporary = got.temporary, workspace = got.workspace;
    const auto grads_all = weft::plan::stage_params(spec, s, std::size_t(ppc.rank())).total() * 4;
    if (name == "zb" && mode == DPMode::zero2) {
      // Deferred reduce-scatters: every group's full gradient is held at
      // once at the end of the step, deterministically.
      CHECK(temporary == b.temporary);
      CHECK(temporary - workspace == grads_all);
    } else if (name == "zb" && mode == DPMode::fsdp) {
      // All full gradients at once, plus gathered parameters between none
      // (the end of the step: only weight halves, which read no weights) and
      // the root + 3 blocks the budget takes.
      CHECK(temporary <= b.temporary);
      CHECK(temporary - workspace >= grads_all);
    } else if (mode == weft::parallel::DPMode::zero2) {
      // As without a pipeline (test_plan): the group gradients alive at once
      // depend on when MPI completes their reduce-scatters; the budget is the
      // upper bound.
      CHECK(temporary <= b.temporary);
    } else if (mode == weft::parallel::DPMode::fsdp) {
      // The gathered parameters: root + 2 blocks, or + 3 when a prefetch is
      // still in flight as the schedule turns from forward to backward; the
      // budget is the upper bound.
      const double block = weft::plan::stage_params(spec, s, std::size_t(ppc.rank())).block * 4;
      CHECK(temporary <= b.temporary);
      CHECK(temporary >= b.temporary - block);
    } else {
      CHECK(temporary == b.temporary);
    }
    for (int r = 0; r < w.size(); ++r) {
      if (r == w.rank())
        std::printf("validation dp=2 pp=2 %-4s %-9s rank %d (pp rank %d) parameters %zu/%.0f gradients %zu/%.0f "
                    "optimizer %zu/%.0f activations %.0f/%.0f temporary %.0f/%.0f communication %.0f/%.0f\n",
                    name.c_str(), weft::parallel::to_string(mode), w.rank(), ppc.rank(), d.bytes(C::parameters), b.parameters,
                    d.bytes(C::gradients), b.gradients, opt.memory().bytes(C::optimizer_state), b.optimizer_state,
                    got.activations, b.activations, temporary, b.temporary, got.communication, b.communication);
      std::fflush(stdout);
      w.barrier();
    }
    });
  };
  // 1F1B in every mode; zb with the modes whose gradients it changes (zero2
  // and fsdp reduce-scatter once per step, after the deferred weight halves).
  weft::test::for_each_dp_policy([&]<class Policy>() { one.template operator()<Policy>("1f1b"); });
  one.template operator()<weft::ZeRO<2>>("zb");
  one.template operator()<weft::FullyShard>("zb");
}

TEST_CASE("pp x tp = 2 x 2: each rank's budget against its TP-split stage, per category, with and without sp") {
  auto& w = weft::test::world();
  if (w.size() != 4) return;
  using M3 = weft::Mesh<weft::DP, weft::PP, weft::TP>;
  M3 mesh(w, weft::MeshSizes{.dp = 1, .pp = 2, .tp = 2});
  auto& ppc = mesh.axis<weft::PP>();
  const std::size_t m = 4, mb = 2, pp = 2, tp = 2;  // microbatches per step, sequences per microbatch
  // With recompute too (sequence-parallel stages, the schedules with and
  // without a split backward).
  for (int variant = 0; variant < 3; ++variant)
    for (std::string name : {"1f1b", "zb", "gpipe", "interleaved:2"}) {
      const bool sp = variant >= 1, recompute = variant == 2;
      if (recompute && name != "1f1b" && name != "zb") continue;
      CAPTURE(sp);
      CAPTURE(recompute);
      CAPTURE(name);
      auto cfg = pipe_gpt(mb);
      cfg.recompute = recompute;
      const ModelSpec spec = spec_of(cfg, m);
      const auto kind_chunks = weft::plan::parse_schedule_name(name);
      const auto kind = kind_chunks.first;
      const auto chunks = kind_chunks.second;
      with_tp_step<weft::Replicated>(sp, cfg, name, ppc, nullptr, &mesh.axis<weft::TP>(), m, m * mb, [&](auto& run) {
      auto& stage = run.stage;
      auto& opt = run.opt;
      const auto& pstats = run.pstats;

      const MeshSpec s{.tp = tp, .pp = pp, .sequence_parallel = sp, .schedule = kind, .chunks = chunks};
      const auto b = weft::plan::stage_memory(spec, s, std::size_t(ppc.rank()), 0.0);
      const auto led = stage.memory();
      const auto got = measure_stage(led, nullptr, opt.memory(),
                                     checked_slots(stage, weft::plan::rank_layout(spec, s, std::size_t(ppc.rank()))));
      check_stage_budget(got, b, spec, s, std::size_t(ppc.rank()), pstats, true);
      const auto v = weft::plan::comm_volume(spec, s, std::size_t(ppc.rank()));
      for (int r = 0; r < w.size(); ++r) {
        if (r == w.rank())
          std::printf("validation pp=2 tp=2 sp=%d%s %-13s rank %d (pp rank %d) parameters %zu/%.0f gradients %zu/%.0f "
                      "optimizer %zu/%.0f activations %.0f/%.0f (deferred dy %zu) temporary %.0f/%.0f "
                      "communication %.0f/%.0f (send buffers %.0f) p2p-sent %llu/%.0f\n",
                      int(sp), recompute ? " recompute" : "", name.c_str(), w.rank(), ppc.rank(), led.bytes(C::parameters), b.parameters,
                      led.bytes(C::gradients), b.gradients, opt.memory().bytes(C::optimizer_state), b.optimizer_state,
                      got.activations, b.activations, led.bytes("pipeline.deferred_output_gradients"),
                      got.temporary, b.temporary, got.communication, b.communication, got.send_buffers,
                      static_cast<unsigned long long>(pstats[weft::CommKind::send].bytes), v.pp_send);
        std::fflush(stdout);
        w.barrier();
      }
      });
    }
}

TEST_CASE("dp x pp x tp = 2 x 2 x 2: each rank's budget against its TP-split stage, DataParallel and optimizer") {
  auto& w = weft::test::world();
  if (w.size() != 8) return;
  using M3 = weft::Mesh<weft::DP, weft::PP, weft::TP>;
  M3 mesh(w, weft::MeshSizes{.dp = 2, .pp = 2, .tp = 2});
  auto& ppc = mesh.axis<weft::PP>();
  auto& dpc = mesh.axis<weft::DP>();
  const std::size_t m = 2, mb = 2, dp = 2, pp = 2, tp = 2;  // microbatches per dp rank, sequences per microbatch
  const auto cfg = pipe_gpt(mb);
  ModelSpec spec = spec_of(cfg, m);
  spec.global_batch = dp * m * mb;
  using Policy = weft::ZeRO<1>;  // every category deterministic
  const auto mode = Policy::mode;
  struct Case {
    const char* schedule;
    bool sp;
  };
  for (Case k : {Case{"1f1b", false}, Case{"zb", true}}) {
    const std::string name = k.schedule;
    CAPTURE(name);
    CAPTURE(k.sp);
    const auto kind_chunks = weft::plan::parse_schedule_name(name);
    const auto kind = kind_chunks.first;
    const auto chunks = kind_chunks.second;
    with_tp_step<Policy>(k.sp, cfg, name, ppc, &dpc, &mesh.axis<weft::TP>(), m, spec.global_batch, [&](auto& run) {
    auto& stage = run.stage;
    auto& opt = run.opt;
    const auto& pstats = run.pstats;

    const MeshSpec s{.dp = dp, .tp = tp, .pp = pp, .mode = mode, .sequence_parallel = k.sp, .schedule = kind,
                     .chunks = chunks};
    const auto b = weft::plan::stage_memory(spec, s, std::size_t(ppc.rank()), 0.0);
    const auto d = run.ddp->memory();
    const auto led = stage.memory();
    const auto got = measure_stage(led, &d, opt.memory(), checked_slots(stage, weft::plan::rank_layout(spec, s, std::size_t(ppc.rank()))));
    check_stage_budget(got, b, spec, s, std::size_t(ppc.rank()), pstats, true);  // zero1: every category exact
    for (int r = 0; r < w.size(); ++r) {
      if (r == w.rank())
        std::printf("validation dp=2 pp=2 tp=2 sp=%d %-4s zero1 rank %d (pp rank %d) parameters %zu/%.0f "
                    "gradients %zu/%.0f optimizer %zu/%.0f activations %.0f/%.0f temporary %.0f/%.0f "
                    "communication %.0f/%.0f (send buffers %.0f)\n",
                    int(k.sp), name.c_str(), w.rank(), ppc.rank(), d.bytes(C::parameters), b.parameters,
                    d.bytes(C::gradients), b.gradients, opt.memory().bytes(C::optimizer_state), b.optimizer_state,
                    got.activations, b.activations, got.temporary, b.temporary, got.communication, b.communication,
                    got.send_buffers);
      std::fflush(stdout);
      w.barrier();
    }
    });
  }
}
