// Data parallelism: every policy (Replicated, ZeRO<1>, ZeRO<2>, FullyShard) at
// dp = world size follows the single-process
// loss curve of the same model on the same global batch; sharded optimizer
// states equal the single-process ones; fully sharded memory is a fraction of
// the single-process figure; bad batch sizes are named.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tiny_gpt.hpp"
#include "weft_test.hpp"

namespace {

using weft::parallel::DataParallel;
using weft::parallel::DPMode;
using weft::parallel::DPOptions;

constexpr std::size_t kGlobalBatch = 8;

weft::nn::GPTConfig tiny(std::size_t microbatch) { return weft::test::tiny_gpt(2, microbatch); }

using weft::test::successor_stream;

template <class T>
struct Run {
  std::vector<double> loss;
  std::vector<double> norm;
};

// The single-process reference: one microbatch of the whole global batch.
template <class T>
Run<T> reference(std::size_t steps, weft::nn::GPT<T>** keep = nullptr, weft::optim::AdamW<T, Kokkos::DefaultExecutionSpace>** opt_out = nullptr) {
  auto* gpt = new weft::nn::GPT<T>(tiny(kGlobalBatch));
  auto* opt = new weft::optim::AdamW<T, Kokkos::DefaultExecutionSpace>(gpt->parameters());
  auto data = successor_stream();
  Kokkos::View<int*> ids("ids", kGlobalBatch * 8), tg("tg", kGlobalBatch * 8);
  Run<T> r;
  for (std::size_t s = 0; s < steps; ++s) {
    auto st = weft::optim::train_step(*gpt, *opt, data, s, 1, ids, tg, 3e-3, 1.0);
    r.loss.push_back(st.loss);
    r.norm.push_back(st.grad_norm);
  }
  if (keep) *keep = gpt; else delete gpt;
  if (opt_out) *opt_out = opt; else delete opt;
  return r;
}

template <class T, class Policy>
struct DPRun {
  Run<T> run;
  std::unique_ptr<weft::nn::GPT<T>> gpt;
  std::unique_ptr<DataParallel<T, Policy>> dp;
  std::unique_ptr<weft::optim::AdamW<T, Kokkos::DefaultExecutionSpace>> opt;
};

template <class T, class Policy>
DPRun<T, Policy> data_parallel(weft::Comm& comm, DPOptions o, std::size_t microbatches, std::size_t steps) {
  DPRun<T, Policy> out;
  const std::size_t mb = weft::parallel::local_microbatch(kGlobalBatch, std::size_t(comm.size()), microbatches);
  out.gpt = std::make_unique<weft::nn::GPT<T>>(tiny(mb));
  out.dp = std::make_unique<DataParallel<T, Policy>>(comm, out.gpt->parameter_groups(), o);
  out.gpt->set_hooks(out.dp.get());
  out.opt = std::make_unique<weft::optim::AdamW<T, Kokkos::DefaultExecutionSpace>>(out.dp->optimizer_parameters());
  auto data = successor_stream();
  Kokkos::View<int*> ids("ids", mb * 8), tg("tg", mb * 8);
  for (std::size_t s = 0; s < steps; ++s) {
    auto st = weft::parallel::train_step(*out.gpt, *out.dp, *out.opt, data, s, kGlobalBatch, microbatches, ids, tg, 3e-3, 1.0);
    out.run.loss.push_back(st.loss);
    out.run.norm.push_back(st.grad_norm);
  }
  return out;
}

DPOptions small_buckets() {
  DPOptions o;
  o.bucket_mb = 0.004;  // a few KiB: several buckets even for the tiny model
  return o;
}

using weft::test::for_each_dp_policy;
using weft::test::rel;

// The policy types name the modes of the planner's vocabulary.
static_assert(DataParallel<float>::mode() == DPMode::replicate);
static_assert(DataParallel<float, weft::ZeRO<1>>::mode() == DPMode::zero1);
static_assert(DataParallel<float, weft::ZeRO<2>>::mode() == DPMode::zero2);
static_assert(DataParallel<float, weft::FullyShard>::mode() == DPMode::fsdp);
static_assert(std::is_same_v<weft::dp_policy_of<DPMode::zero2>, weft::ZeRO<2>>);
// A strategy selects its DataParallel; one without DP replicates.
static_assert(std::is_base_of_v<DataParallel<float, weft::FullyShard>,
                                weft::parallel::DataParallelOf<float, weft::Strategy<weft::On<weft::DP, weft::Shard<0>>>>>);
static_assert(std::is_base_of_v<DataParallel<float>, weft::parallel::DataParallelOf<float, weft::SingleProcess>>);
static_assert(weft::parallel::DataParallelType<weft::parallel::DataParallelOf<float, weft::SingleProcess>>);

}  // namespace

TEST_CASE("every data-parallel mode follows the single-process loss curve (fp32, 20 steps, 1e-5)") {
  auto& w = weft::test::world();
  const auto ref = reference<float>(20);
  const std::size_t micro = (kGlobalBatch / std::size_t(w.size())) % 2 == 0 ? 2 : 1;
  for_each_dp_policy([&]<class P>() {
    INFO("mode ", P::policy_name(), " dp ", w.size(), " microbatches ", micro);
    auto r = data_parallel<float, P>(w, small_buckets(), micro, 20);
    for (std::size_t s = 0; s < ref.loss.size(); ++s) {
      // A message only on failure: nvcc warns about INFO's scope object in this template lambda's loop.
      const double d = rel(r.run.loss[s], ref.loss[s]);
      if (!(d <= 1e-5)) {
        const std::string what = "step " + std::to_string(s) + " loss " + std::to_string(r.run.loss[s]) +
                                 " reference " + std::to_string(ref.loss[s]);
        MESSAGE(what);
      }
      CHECK(d <= 1e-5);
    }
    CHECK(ref.loss.back() < ref.loss.front());  // it trains
  });
}

TEST_CASE("in double precision the whole curve agrees to 1e-11, with and without overlap and prefetch") {
  auto& w = weft::test::world();
  const auto ref = reference<double>(10);
  for_each_dp_policy([&]<class P>() {
    for (bool variant : {false, true}) {
      DPOptions o = small_buckets();
      o.overlap = variant;
      o.prefetch = variant;
      o.reshard_after_forward = variant;
      INFO("mode ", P::policy_name(), " overlap/prefetch/reshard ", variant);
      auto r = data_parallel<double, P>(w, o, 1, 10);
      for (std::size_t s = 0; s < ref.loss.size(); ++s) {
        INFO("step ", s);
        CHECK(rel(r.run.loss[s], ref.loss[s]) <= 1e-11);
        CHECK(rel(r.run.norm[s], ref.norm[s]) <= 1e-9);
      }
    }
  });
}

TEST_CASE("sharded optimizer states equal the single-process ones, element by element") {
  auto& w = weft::test::world();
  weft::nn::GPT<double>* ref_gpt = nullptr;
  weft::optim::AdamW<double, Kokkos::DefaultExecutionSpace>* ref_opt = nullptr;
  reference<double>(5, &ref_gpt, &ref_opt);
  auto ref_params = ref_gpt->parameters();
  for_each_dp_policy([&]<class P>() {
    INFO("mode ", P::policy_name());
    auto r = data_parallel<double, P>(w, small_buckets(), 1, 5);
    const auto& origins = r.dp->piece_origins();
    auto pieces = r.dp->optimizer_parameters();
    REQUIRE(origins.size() == pieces.size());
    std::size_t covered = 0;
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      std::size_t k = 0;
      while (k < ref_params.size() && ref_params[k]->name() != origins[i].parameter) ++k;
      REQUIRE(k < ref_params.size());
      const std::size_t off = origins[i].offset, n = pieces[i]->size();
      auto hm = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r.opt->first_moment(i));
      auto hv = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r.opt->second_moment(i));
      auto rm = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ref_opt->first_moment(k));
      auto rv = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ref_opt->second_moment(k));
      auto hw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pieces[i]->value);
      auto rw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ref_params[k]->value);
      // Norm-wise relative error per tensor: elements whose gradient is a
      // cancelling sum (near zero) differ in the last bits of a tiny value.
      double dm = 0, dv = 0, dw = 0, sm = 0, sv = 0, sw = 0;
      for (std::size_t j = 0; j < n; ++j) {
        dm = std::max(dm, std::abs(hm(j) - rm(off + j)));
        dv = std::max(dv, std::abs(hv(j) - rv(off + j)));
        dw = std::max(dw, std::abs(hw(j) - rw(off + j)));
        sm = std::max(sm, std::abs(rm(off + j)));
        sv = std::max(sv, std::abs(rv(off + j)));
        sw = std::max(sw, std::abs(rw(off + j)));
      }
      const double worst = std::max({dm / (sm + 1e-300), dv / (sv + 1e-300), dw / (sw + 1e-300)});
      INFO("piece ", pieces[i]->name());
      CHECK(worst <= 1e-8);
      covered += n;
    }
    // Together the ranks hold every element exactly once (replicate: each rank all of them).
    std::int64_t total = std::int64_t(covered);
    Kokkos::View<std::int64_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> tv(&total, 1);
    w.all_reduce(tv);
    const std::int64_t want = std::int64_t(ref_gpt->num_parameters()) * (P::mode == DPMode::replicate ? w.size() : 1);
    CHECK(total == want);
  });
  delete ref_opt;
  delete ref_gpt;
}

TEST_CASE("fully sharded: per-rank parameter + gradient + optimizer memory is a fraction of the single-process one") {
  auto& w = weft::test::world();
  if (w.size() != 4) return;  // the figure is for dp = 4
  auto c = tiny(2);
  c.layers = 8;  // blocks dominate, as in real models
  c.d_model = 32;
  weft::nn::GPT<float> single(c);
  weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace> sopt(single.parameters());
  const auto sm = single.memory();
  using C = weft::metrics::MemoryCategory;
  const double single_bytes = double(sm.bytes(C::parameters) + sm.bytes(C::gradients) + sopt.memory().bytes(C::optimizer_state));
  auto c2 = c;
  c2.batch = 2;
  weft::nn::GPT<float> model(c2);
  DataParallel<float, weft::FullyShard> dp(w, model.parameter_groups());
  model.set_hooks(&dp);
  weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace> opt(dp.optimizer_parameters());
  auto data = successor_stream();
  Kokkos::View<int*> ids("ids", 16), tg("tg", 16);
  weft::parallel::train_step(model, dp, opt, data, 0, kGlobalBatch, 1, ids, tg, 1e-3, 1.0);
  const auto m = dp.memory();
  const double sharded = double(m.bytes(C::parameters) + m.bytes(C::gradients) + opt.memory().bytes(C::optimizer_state));
  INFO("single ", single_bytes, " sharded ", sharded, " gathered peak ", dp.peak_transient_bytes());
  CHECK(sharded <= 0.3 * single_bytes);
  // The gathered groups are transient: at most a few groups' worth, well under the full model.
  CHECK(double(dp.peak_transient_bytes()) < 0.5 * single_bytes);
  CHECK(dp.peak_transient_bytes() > 0);
}

TEST_CASE("a global batch that dp ranks x microbatches do not divide is a ConfigError naming the numbers") {
  try {
    weft::parallel::local_microbatch(6, 4, 1);
    FAIL("no error");
  } catch (const weft::ConfigError& e) {
    CHECK(std::string(e.what()).find("--batch 6 is not divisible by dp 4") != std::string::npos);
  }
  try {
    weft::parallel::local_microbatch(8, 2, 3);
    FAIL("no error");
  } catch (const weft::ConfigError& e) {
    CHECK(std::string(e.what()).find("do not split into --microbatches 3") != std::string::npos);
  }
  CHECK(weft::parallel::local_microbatch(16, 4, 2) == 2);
  CHECK_THROWS_AS(weft::parallel::parse_dp_mode("zero4"), weft::ConfigError);
  CHECK(weft::parallel::parse_dp_mode("fsdp") == DPMode::fsdp);
}
