// The run-time side of the strategy types: validate_strategy raises, for
// dynamic extents and sizes, the ConfigError whose text the compile-time
// checks print for static ones; and a strategy's name spells its policies.
#include <string>

#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>

#include "weft_test.hpp"

using namespace weft;

TEST_CASE("strategy: the name spells each axis' policy") {
  using S = Strategy<On<DP, ZeRO<1>>, On<PP, Pipeline<Interleaved1F1B<2>>>, On<TP, TensorParallel<SequenceParallel>>>;
  CHECK(S::name() == "Strategy<On<dp, ZeRO<1>>, On<pp, Pipeline<Interleaved1F1B<2>>>, On<tp, TensorParallel<SequenceParallel>>>");
  CHECK(SingleProcess::name() == "Strategy<>");
  CHECK(Strategy<On<DP, Shard<0>>>::name() == "Strategy<On<dp, FullyShard>>");
}

TEST_CASE("strategy: dynamic sizes are checked at construction with the compile-time text") {
  auto& w = test::world();
  const int n = w.size();
  Mesh<DP, PP, TP> flat(w, {.dp = 1, .pp = 1, .tp = n});
  // Sequence parallelism on one TP rank.
  const auto sp = test::error_text<ConfigError>([&] {
    Mesh<DP, PP, TP> one(w, {.dp = n, .pp = 1, .tp = 1});
    validate_strategy<Strategy<On<DP, Replicated>, On<TP, TensorParallel<SequenceParallel>>>>(one);
  });
  CHECK(test::contains(sp, "sequence parallelism shards the tokens over the TP ranks and needs a TP axis of more than one rank"));
  CHECK(test::contains(sp, "(tp is 1)"));
  // Interleaving on one stage.
  const auto il = test::error_text<ConfigError>([&] { validate_strategy<Strategy<On<PP, Pipeline<Interleaved1F1B<2>>>, On<TP, TensorParallel<>>>>(flat); });
  CHECK(test::contains(il, "interleaving needs at least 2 pipeline stages on the PP axis"));
  // An axis of extent > 1 without a policy.
  const auto unused = test::error_text<ConfigError>([&] { validate_strategy<SingleProcess>(flat); });
  if (n > 1) {
    CHECK(test::contains(unused, "the mesh's tp axis has extent " + std::to_string(n) + " but the strategy gives it no policy"));
  } else {
    CHECK(unused.empty());
  }
  // Heads that do not divide by tp (static: the attention heads do not divide by tp).
  const auto heads = test::error_text<ConfigError>([&] { validate_strategy<Strategy<On<TP, TensorParallel<>>>>(flat, 3); });
  if (n == 2 || n == 4) {
    CHECK(test::contains(heads, "the attention heads do not divide by tp"));
    CHECK(test::contains(heads, "(heads 3, tp " + std::to_string(n) + ")"));
  } else {
    CHECK(heads.empty());
  }
  CHECK(test::error_text<ConfigError>([&] { validate_strategy<Strategy<On<TP, TensorParallel<>>>>(flat, 4); }).empty());
  // Blocks over stages x chunks, when the stages must be equal.
  Mesh<DP, PP, TP> pipe(w, {.dp = 1, .pp = n, .tp = 1});
  using P = Strategy<On<PP, Pipeline<OneFOneB>>>;
  const auto blocks = test::error_text<ConfigError>([&] { validate_strategy<P>(pipe, 0, 6, true); });
  if (n == 4) {
    CHECK(test::contains(blocks, "the blocks do not divide by stages x chunks"));
  } else {
    CHECK(blocks.empty());
  }
  CHECK(test::error_text<ConfigError>([&] { validate_strategy<P>(pipe, 0, 6, false); }).empty());
}
