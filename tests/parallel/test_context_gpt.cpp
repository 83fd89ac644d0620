// The GPT under context parallelism, the world as the CP axis: one microbatch
// of whole sequences through nn::GPT split over cp = world size by each
// variant gives the single-process loss and, summed over CP, the
// single-process parameter gradients, in double within 1e-10 relative --
// GPT-2 shaped (learned positions) and Llama shaped (rotary positions,
// grouped-query heads) -- and under tensor parallelism with sequence
// parallelism beside it (2 x 2). Plus the errors for a sequence length and
// AllToAll heads that do not fit, naming the sizes that work; and the same
// gradients with recomputation.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <weft/parallel/context.hpp>

#include "tiny_gpt.hpp"
#include "weft_test.hpp"

using namespace weft;

namespace {

using Space = Kokkos::DefaultExecutionSpace;

nn::GPTConfig shape(bool llama) {
  nn::GPTConfig c = test::tiny_gpt(2, 2, llama);
  c.seq = 16;
  return c;
}

// Token ids of two sequences (the same on every rank).
void fill(Kokkos::View<int*>& ids, Kokkos::View<int*>& tg, std::size_t vocab) {
  auto hi = Kokkos::create_mirror_view(ids);
  auto ht = Kokkos::create_mirror_view(tg);
  for (std::size_t i = 0; i < ids.extent(0); ++i) {
    hi(i) = int((i * 7 + 3) % vocab);
    ht(i) = int((i * 5 + 1) % vocab);
  }
  Kokkos::deep_copy(ids, hi);
  Kokkos::deep_copy(tg, ht);
}

struct Result {
  double loss = 0;
  std::vector<std::vector<double>> grads;
};

template <class Model>
Result run(Model& m, const nn::GPTConfig& c) {
  Kokkos::View<int*> ids("ids", c.tokens()), tg("tg", c.tokens());
  fill(ids, tg, c.vocab);
  m.zero_grad();
  Result r;
  r.loss = m.forward_backward(ids, tg);
  for (auto* p : m.parameters()) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p->grad);
    r.grads.emplace_back(h.data(), h.data() + h.size());
  }
  return r;
}

// Worst relative difference (by each gradient's largest element) of the CP
// model's gradients summed over `sum` against the single-process ones.
double grad_diff(Result& cp, const Result& ref, Comm& sum) {
  double worst = 0;
  REQUIRE(cp.grads.size() == ref.grads.size());
  for (std::size_t k = 0; k < ref.grads.size(); ++k) {
    auto& g = cp.grads[k];
    Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(g.data(), g.size());
    sum.all_reduce(v);
    REQUIRE(g.size() == ref.grads[k].size());
    double d = 0, s = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      d = std::max(d, std::abs(g[i] - ref.grads[k][i]));
      s = std::max(s, std::abs(ref.grads[k][i]));
    }
    worst = std::max(worst, d / std::max(s, 1e-300));
  }
  return worst;
}

template <class V, class F>
void for_each_variant(F&& f) {
  f.template operator()<Context<Ring>>();
  f.template operator()<Context<AllGather>>();
  f.template operator()<Context<AllToAll>>();
}

}  // namespace

TEST_CASE("the GPT over cp ranks gives the single-process loss and, summed over CP, its gradients (double, 1e-10)") {
  auto& w = test::world();
  const std::size_t cp = std::size_t(w.size());
  for (bool llama : {false, true}) {
    const nn::GPTConfig c = shape(llama);
    nn::GPT<double> single(c);
    const Result ref = run(single, c);
    Mesh<CP> mesh(w, int(cp));
    for_each_variant<void>([&]<class P>() {
      CAPTURE(P::policy_name());
      CAPTURE(llama);
      if (std::is_same_v<P, Context<AllToAll>> && !context::alltoall_fits(c.heads, c.kv(), cp)) return;
      nn::GPT<double> split(mesh, c, context::attention_of<P, double>(mesh.axis<CP>()));
      CHECK(split.context_parallel().size() == cp);
      Result r = run(split, c);
      CHECK(test::rel(r.loss, ref.loss) < 1e-12);
      CHECK(grad_diff(r, ref, mesh.axis<CP>()) < 1e-10);
    });
  }
}

TEST_CASE("recomputation under context parallelism re-runs each block's attention and keeps the gradients") {
  auto& w = test::world();
  const std::size_t cp = std::size_t(w.size());
  nn::GPTConfig c = shape(true);
  c.recompute = true;
  nn::GPT<double> single(c);
  const Result ref = run(single, c);
  Mesh<CP> mesh(w, int(cp));
  for_each_variant<void>([&]<class P>() {
    CAPTURE(P::policy_name());
    if (std::is_same_v<P, Context<AllToAll>> && !context::alltoall_fits(c.heads, c.kv(), cp)) return;
    nn::GPT<double> split(mesh, c, context::attention_of<P, double>(mesh.axis<CP>()));
    Result r = run(split, c);
    CHECK(test::rel(r.loss, ref.loss) < 1e-12);
    CHECK(grad_diff(r, ref, mesh.axis<CP>()) < 1e-10);
  });
}

TEST_CASE("context parallelism beside tensor parallelism with sequence parallelism (2 x 2) gives the single-process gradients") {
  auto& w = test::world();
  if (w.size() != 4) return;
  using SP = Strategy<On<CP, Context<Ring>>, On<TP, TensorParallel<SequenceParallel>>>;
  for (bool llama : {false, true}) {
    const nn::GPTConfig c = shape(llama);
    nn::GPT<double> single(c);
    const Result ref = run(single, c);
    Mesh<CP, TP> mesh(w, 2, 2);
    // The context parallelism the strategy gives on this mesh (checked against it).
    nn::GPT<double, SP> split(mesh, c, context::attention_of<SP, double>(mesh));
    Result r = run(split, c);
    CHECK(test::rel(r.loss, ref.loss) < 1e-12);
    // The gradients of TP-sharded parameters are compared shard by shard: gather them is the
    // tensor-parallel tests' business; here every rank's shard summed over CP must equal the
    // single-process gradient restricted to that shard, which the replicated ones (norms,
    // positions, biases of row-parallel layers) show directly.
    std::vector<std::size_t> whole;
    auto params = split.parameters();
    auto ref_params = single.parameters();
    for (std::size_t k = 0; k < params.size(); ++k)
      if (params[k]->size() == ref_params[k]->size()) whole.push_back(k);
    REQUIRE(!whole.empty());
    double worst = 0;
    for (std::size_t k : whole) {
      auto& g = r.grads[k];
      Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(g.data(), g.size());
      mesh.axis<CP>().all_reduce(v);
      double d = 0, s = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        d = std::max(d, std::abs(g[i] - ref.grads[k][i]));
        s = std::max(s, std::abs(ref.grads[k][i]));
      }
      worst = std::max(worst, d / std::max(s, 1e-300));
    }
    CHECK(worst < 1e-10);
  }
}

TEST_CASE("a sequence that does not split into 2·cp chunks, and AllToAll heads that do not shard, are ConfigErrors naming what works") {
  auto& w = test::world();
  const std::size_t cp = std::size_t(w.size());
  if (cp < 2) return;
  Mesh<CP> mesh(w, int(cp));
  nn::GPTConfig c = shape(false);
  c.seq = 2 * cp + 2;  // not a multiple of 2·cp for cp >= 2
  const std::string msg = test::error_text<ConfigError>(
      [&] { nn::GPT<double> m(mesh, c, context::attention_of<Context<Ring>, double>(mesh.axis<CP>())); });
  CHECK(msg.find("multiples of " + std::to_string(2 * cp)) != std::string::npos);
  if (cp == 4) {
    nn::GPTConfig h = shape(false);  // 2 heads: AllToAll needs cp to divide them
    const std::string m2 = test::error_text<ConfigError>(
        [&] { nn::GPT<double> m(mesh, h, context::attention_of<Context<AllToAll>, double>(mesh.axis<CP>())); });
    CHECK(m2.find("cp sizes that work: 1, 2") != std::string::npos);
  }
  // The context parallelism a strategy gives is checked against the mesh's
  // extents before anything is built: sequence parallelism at tp = 1.
  using SP = Strategy<On<CP, Context<Ring>>, On<TP, TensorParallel<SequenceParallel>>>;
  Mesh<CP, TP> flat(w, int(cp), 1);
  const std::string m3 = test::error_text<ConfigError>([&] { (void)context::attention_of<SP, double>(flat); });
  CHECK(m3.find("sequence parallelism shards the tokens over the TP ranks") != std::string::npos);
}
