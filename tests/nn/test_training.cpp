// Training the reference GPT end to end: the data stream is a pure function of
// (seed, step) and slices of a global batch agree with the whole; two runs of
// one config give bit-identical losses; and on the synthetic corpus a small
// model's loss falls clearly below the corpus' unigram entropy.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <weft/data/corpus.hpp>
#include <weft/nn/gpt.hpp>
#include <weft/optim/train_step.hpp>

#include "../ops/gradcheck.hpp"

namespace {

using namespace weft;
using weft::test::to_vector;
using Space = Kokkos::DefaultExecutionSpace;

TEST_CASE("synthetic corpus: deterministic, printable, sentence structured") {
  const auto a = data::synthetic_corpus(5000, 3), b = data::synthetic_corpus(5000, 3), c = data::synthetic_corpus(5000, 4);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a.size() == 5000);
  std::size_t dots = 0;
  for (auto ch : a) {
    CHECK((ch == '\n' || (ch >= 32 && ch < 127)));
    dots += ch == '.';
  }
  CHECK(dots > 50);
  const double h = data::unigram_entropy(a);
  CHECK(h > 2.0);
  CHECK(h < std::log(256.0));
}

TEST_CASE("data stream: a global batch is fixed by (seed, step); rank slices agree with it") {
  const auto bytes = data::synthetic_corpus(4000, 1);
  data::TokenStream s(bytes, 16, 7), same(bytes, 16, 7), other(bytes, 16, 8);
  ops::Tokens<Space> ids("ids", 4 * 16), tg("tg", 4 * 16), ids2("ids2", 2 * 16), tg2("tg2", 2 * 16);
  s.fill(5, 4, 0, 4, ids, tg);
  const auto whole = to_vector(ids), whole_t = to_vector(tg);
  for (std::size_t i = 0; i + 1 < 16; ++i) CHECK(whole[i + 1] == whole_t[i]);  // targets are next tokens
  same.fill(5, 4, 2, 2, ids2, tg2);  // "rank 1 of 2"
  const auto half = to_vector(ids2);
  for (std::size_t i = 0; i < half.size(); ++i) CHECK(half[i] == whole[2 * 16 + i]);
  other.fill(5, 4, 0, 4, ids, tg);
  CHECK(to_vector(ids) != whole);
  s.fill(6, 4, 0, 4, ids, tg);
  CHECK(to_vector(ids) != whole);
  CHECK_THROWS_AS(s.fill(5, 4, 3, 2, ids2, tg2), ConfigError);
  CHECK_THROWS_AS(data::TokenStream(std::vector<int>(16, 1), 16, 0), ConfigError);
  CHECK(s.min_vocab() <= 128);
}

TEST_CASE("corpus files: an unreadable or empty file is a clear error") {
  try {
    data::read_corpus("/nonexistent/weft.txt");
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("--data /nonexistent/weft.txt: cannot open") != std::string::npos);
  }
  const std::string empty = "weft_test_empty_corpus.txt";
  std::ofstream(empty).close();
  CHECK_THROWS_WITH_AS(data::read_corpus(empty), doctest::Contains("the file is empty"), ConfigError);
  std::ofstream(empty) << "hello";
  CHECK(data::read_corpus(empty) == std::vector<std::uint8_t>{'h', 'e', 'l', 'l', 'o'});
  std::remove(empty.c_str());
}

std::vector<double> train(nn::GPTConfig c, int steps, double lr, std::size_t microbatches = 1) {
  const auto bytes = data::synthetic_corpus(200000, 0);
  data::TokenStream stream(bytes, c.seq, c.seed);
  nn::GPT<float, SingleProcess, Space> gpt(c);
  optim::AdamW<float, Space> opt(gpt.parameters());
  ops::Tokens<Space> ids("ids", c.tokens()), tg("tg", c.tokens());
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s)
    losses.push_back(optim::train_step(gpt, opt, stream, std::uint64_t(s), microbatches, ids, tg, lr, 1.0).loss);
  return losses;
}

nn::GPTConfig small() {
  nn::GPTConfig c;
  c.layers = 2;
  c.d_model = 64;
  c.heads = 4;
  c.seq = 32;
  c.batch = 8;
  c.vocab = 256;
  c.seed = 11;
  return c;
}

TEST_CASE("determinism: two runs of one config give bit-identical losses") {
  auto c = small();
  c.layers = 1;
  const auto a = train(c, 8, 3e-3), b = train(c, 8, 3e-3);
  CHECK(a == b);
  c.seed += 1;
  CHECK(train(c, 8, 3e-3) != a);
}

TEST_CASE("microbatches: one batch of 8 and two microbatches of 4 give the same step") {
  auto c = small();
  c.layers = 1;
  const auto whole = train(c, 3, 3e-3, 1);
  c.batch = 4;
  const auto split = train(c, 3, 3e-3, 2);
  for (int i = 0; i < 3; ++i) CHECK(split[i] == doctest::Approx(whole[i]).epsilon(1e-5));
}

TEST_CASE("the loss falls clearly below the unigram entropy of the synthetic corpus") {
  const double h = data::unigram_entropy(data::synthetic_corpus(200000, 0));
  const auto losses = train(small(), 150, 3e-3);
  double last = 0;
  for (int i = 140; i < 150; ++i) last += losses[i] / 10;
  std::printf("unigram entropy %.3f nats; loss %.3f -> %.3f (mean of steps 140-149)\n", h, losses.front(), last);
  CHECK(losses.front() > h);  // an untrained model knows nothing
  CHECK(last < h - 0.5);
}

}  // namespace
