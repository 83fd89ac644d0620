// Kokkos event counters (weft/metrics/counters.hpp): a known sequence of
// kernels, copies and allocations gives known counts; one training step of a
// tiny GPT and one decode step of a tiny serving engine stay under the counts
// measured when this test was written, so a new kernel, sync, copy or
// allocation in a step fails here and the message lists the step's events by
// label (Kokkos passes each kernel's label to the callbacks).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <string>
#include <vector>

#include "weft_test.hpp"

namespace {

using weft::metrics::KernelCounters;
using weft::metrics::KernelCounts;
using Space = Kokkos::DefaultExecutionSpace;

// The ceilings below were measured on a host backend with Kokkos 3.4 (which
// reports no fences); other Kokkos versions and device backends count
// differently (Kokkos 4 reports its internal fences, a device's mirror views
// are allocations), so there the test prints the counts and checks only that
// they are steady from one step to the next.
constexpr bool measured_config =
    KOKKOS_VERSION < 30500 && Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible;

// All events of a step, by kind and label: what a failed ceiling prints.
std::string events(const KernelCounts& c) {
  std::string s = c.summary() + "\n";
  for (const char* kind : {"for", "reduce", "scan", "fence", "copy_host_device", "copy_same_space", "fill", "alloc"}) {
    const std::string l = c.labels_of(kind);
    if (!l.empty()) s += std::string(kind) + ":\n" + l;
  }
  return s;
}

// Counts that a step must not exceed.
struct Ceiling {
  std::int64_t kernels, fences, copies_host_device, copies_same_space, fills, allocations;
};

// A count over its ceiling fails with all of the step's events by label: the
// new kernel, fence, copy or allocation is among them. (The harness prints
// failed checks and FAIL_CHECK messages, not INFO contexts.)
// [[maybe_unused]]: a HIP build uses it only in a discarded if-constexpr branch.
[[maybe_unused]] void check_ceiling(const KernelCounts& c, const Ceiling& most, const char* what) {
  const std::pair<const char*, std::pair<std::int64_t, std::int64_t>> rows[] = {
      {"kernels", {c.kernels(), most.kernels}},
      {"fences", {c.fences, most.fences}},
      {"host<->device copies", {c.copies_host_device, most.copies_host_device}},
      {"same-space copies", {c.copies_same_space, most.copies_same_space}},
      {"fills", {c.fills, most.fills}},
      {"allocations", {c.allocations, most.allocations}}};
  std::string over;
  for (const auto& [name, v] : rows)
    if (v.first > v.second)
      over += std::string(over.empty() ? "" : ", ") + name + " " + std::to_string(v.first) + " > " +
              std::to_string(v.second);
  if (!over.empty()) FAIL_CHECK(std::string(what) << ": " << over << "; the step's events:\n" << events(c));
}

// The same events in two steps: a step's counts do not drift.
void check_steady(const KernelCounts& a, const KernelCounts& b) {
  if (a.kernels() != b.kernels() || a.fences != b.fences || a.deep_copies() != b.deep_copies() ||
      a.fills != b.fills || a.allocations != b.allocations)
    FAIL_CHECK("two steps differ:\n" << events(a) << "against\n" << events(b));
}

weft::nn::GPTConfig tiny() {
  weft::nn::GPTConfig c;
  c.layers = 2;
  c.d_model = 32;
  c.heads = 4;
  c.seq = 16;
  c.batch = 2;
  c.vocab = 256;
  c.seed = 5;
  return c;
}

// Two named parallel_fors, a reduction, a scan, a same-space copy, a copy to
// the host and a fill, over two new Views; returns the reduction. A named
// function with its return type spelled: nvcc's extended lambdas may not sit
// in a lambda nor in a function whose return type is deduced.
constexpr int known_n = 100;
double known_sequence() {
  constexpr int n = known_n;
  Kokkos::View<double*, Space> v("weft.count.v", n), w("weft.count.w", n);
  Kokkos::parallel_for("weft.count.fill", Kokkos::RangePolicy<Space>(0, n), KOKKOS_LAMBDA(int i) { v(i) = i; });
  Kokkos::parallel_for("weft.count.fill", Kokkos::RangePolicy<Space>(0, n), KOKKOS_LAMBDA(int i) { v(i) += 1; });
  double sum = 0;
  Kokkos::parallel_reduce("weft.count.sum", Kokkos::RangePolicy<Space>(0, n),
                          KOKKOS_LAMBDA(int i, double& s) { s += v(i); }, sum);
  Kokkos::parallel_scan("weft.count.scan", Kokkos::RangePolicy<Space>(0, n),
                        KOKKOS_LAMBDA(int i, double& s, bool final) {
                          s += v(i);
                          if (final) w(i) = s;
                        });
  Kokkos::deep_copy(w, v);  // same space
  auto h = Kokkos::create_mirror_view(v);
  Kokkos::deep_copy(h, v);  // to the host (on a host backend: the mirror onto itself)
  Kokkos::deep_copy(w, 2.0);
  return sum;
}

// The count of one "kind:label" (0 if it did not happen).
std::int64_t label(const KernelCounts& c, const std::string& key) {
  const auto it = c.labels.find(key);
  return it == c.labels.end() ? 0 : it->second;
}

}  // namespace

TEST_CASE("counters: a known sequence of kernels, copies and allocations") {
  KernelCounters::install(true);
  REQUIRE(KernelCounters::installed());
  constexpr int n = known_n;
  CHECK(known_sequence() == doctest::Approx(n * (n + 1) / 2.0));  // first use: scratch space and the like
  const auto before = KernelCounters::snapshot();
  known_sequence();
  const KernelCounts c = KernelCounters::snapshot() - before;
  CHECK(label(c, "for:weft.count.fill") == 2);
  CHECK(label(c, "reduce:weft.count.sum") == 1);
  CHECK(label(c, "scan:weft.count.scan") == 1);
  CHECK(c.parallel_reduce == 1);
  CHECK(c.parallel_scan == 1);
  CHECK(c.parallel_for >= 2);  // and the Views' initialisation and the fill, where Kokkos uses kernels for them
  CHECK(c.copies_same_space == 1);
  CHECK(c.copies_host_device == 1);
  CHECK(c.fills == 1);
  constexpr bool own_mirror = !Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space::memory_space>::accessible;
  CHECK(c.allocations == (own_mirror ? 3 : 2));
  CHECK(c.allocated_bytes >= 2 * n * std::int64_t(sizeof(double)));
  CHECK(label(c, "alloc:weft.count.v") == 1);

  // A region counts what happened inside it only; uninstalled, nothing is counted.
  weft::metrics::CountedRegion region;
  { Kokkos::View<float*, Space> x("weft.count.x", 8); }
  CHECK(region.counts().allocations == 1);
  KernelCounters::uninstall();
  CHECK(!KernelCounters::installed());
  const auto off = KernelCounters::snapshot();
  known_sequence();
  CHECK((KernelCounters::snapshot() - off).kernels() == 0);
  CHECK((KernelCounters::snapshot() - off).allocations == 0);
  KernelCounters::install(true);
}

TEST_CASE("counters: one training step of a tiny GPT stays under today's counts") {
  const auto c = tiny();
  const auto corpus = weft::data::synthetic_corpus(20000, 0);
  weft::nn::GPT<float, weft::SingleProcess, Space> gpt(c);
  weft::optim::AdamW<float, Space> opt(gpt.parameters());
  weft::data::TokenStream stream(corpus, c.seq, c.seed);
  weft::ops::Tokens<Space> ids("ids", c.batch * c.seq), tg("targets", c.batch * c.seq);
  KernelCounters::install(true);
  auto step = [&](std::uint64_t s) {
    const auto before = KernelCounters::snapshot();
    weft::optim::train_step(gpt, opt, stream, s, 1, ids, tg, 1e-3, 1.0);
    return KernelCounters::snapshot() - before;
  };
  const KernelCounts first = step(0), second = step(1), third = step(2);
  std::printf("training step, first: %s\ntraining step, after the first: %s\n", first.summary().c_str(),
              second.summary().c_str());
  if (std::getenv("WEFT_COUNTERS_LABELS")) std::printf("%s", events(second).c_str());
  check_steady(second, third);
  if constexpr (measured_config) {
    // Today's counts (2 layers, measured when this test was written): 108
    // parallel_for (31 of them the gradients' zero fills) and 32 reductions
    // (29 of them per-parameter gradient norms), the two token batches'
    // host-to-device copies, no allocation. These are ceilings to lower, not
    // goals: issue 40 wants far fewer kernels and no copy inside a step.
    check_ceiling(second, {.kernels = 140, .fences = 0, .copies_host_device = 2, .copies_same_space = 0, .fills = 31,
                           .allocations = 0},
                  "training step after the first");
  }
}

TEST_CASE("counters: one decode step of a tiny serving engine stays under today's counts") {
  auto c = tiny();
  c.seq = 40;
  c.batch = 1;
  weft::nn::GPT<float, weft::SingleProcess, Space> model(c);
  weft::serve::EngineConfig ec;
  ec.block_size = 4;
  ec.blocks = 32;
  ec.token_budget = 32;
  ec.max_seqs = 4;
  weft::serve::Engine<float, Space> engine(model, ec);
  for (int r = 0; r < 2; ++r) {
    weft::serve::Request q;
    for (int t = 0; t < 5 + r; ++t) q.prompt.push_back(7 + 3 * t + r);
    q.max_new_tokens = 8;
    REQUIRE(engine.submit(q).accepted);
  }
  KernelCounters::install(true);
  auto step = [&] {
    const auto before = KernelCounters::snapshot();
    const auto st = engine.step();
    return std::pair{st, KernelCounters::snapshot() - before};
  };
  const auto [prefill, first] = step();  // both prompts
  REQUIRE(prefill.tokens == 11);
  const auto [d1, second] = step();
  const auto [d2, third] = step();
  REQUIRE(d1.sequences == 2);
  REQUIRE(d1.tokens == 2);  // decode steps: one token of each sequence
  REQUIRE(d2.tokens == 2);
  std::printf("first (prefill) step: %s\ndecode step (2 sequences): %s\n", first.summary().c_str(), second.summary().c_str());
  if (std::getenv("WEFT_COUNTERS_LABELS")) std::printf("%s", events(second).c_str());
  check_steady(second, third);
  if constexpr (measured_config) {
    // Today's counts (2 layers, 2 sequences): 34 kernels, 5 host-to-device
    // copies of the step's tables, one same-space copy of the logits into
    // the runner's host buffer, and no allocation: the logits' host view
    // lives across steps (a view made per step was one allocation and one
    // initialisation kernel in every decode step, 35 kernels before).
    check_ceiling(second, {.kernels = 34, .fences = 0, .copies_host_device = 5, .copies_same_space = 1, .fills = 0,
                           .allocations = 0},
                  "decode step");
  }
}
