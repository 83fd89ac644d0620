// Byte-level corpora for training: a deterministic synthetic language (a small
// probabilistic grammar, learnable within a few hundred steps) and text files,
// plus the unigram entropy that a trained model's loss should fall below.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/ops/random.hpp>

namespace weft::data {

namespace detail {
// Draws from a fixed counter stream so the corpus depends on (seed, size) only.
struct Draw {
  std::uint64_t seed, n = 0;
  std::size_t below(std::size_t k) {
    return std::size_t(ops::Philox(seed, ops::name_hash("weft.synthetic_corpus"), n++).uniform() * double(k)) % k;
  }
};
}  // namespace detail

/// About `bytes` bytes of a synthetic English-like language: sentences
/// "Det [Adj] Noun Verb Det [Adj] Noun [Prep Det Noun]." in paragraphs. Each
/// subject noun prefers its own verbs, so there is structure beyond word
/// spelling for a model to learn. Deterministic in (bytes, seed).
inline std::vector<std::uint8_t> synthetic_corpus(std::size_t bytes, std::uint64_t seed = 0) {
  static const char* det[] = {"the", "a", "every", "some", "this", "that"};
  static const char* adj[] = {"big", "small", "red", "old", "quiet", "happy", "green", "dark", "brave", "tired"};
  static const char* noun[] = {"cat", "dog", "bird", "child", "farmer", "river", "house", "tree", "king", "ship",
                               "teacher", "horse"};
  static const char* verb[] = {"sees", "likes", "finds", "follows", "builds", "carries", "watches", "paints",
                               "guards", "hears", "feeds", "visits"};
  static const char* prep[] = {"near", "under", "behind", "with", "beyond", "inside"};
  constexpr std::size_t nd = 6, na = 10, nn = 12, nv = 12, np = 6;
  detail::Draw r{seed};
  std::string out;
  out.reserve(bytes + 128);
  auto np_phrase = [&](bool capital) {
    std::string d = det[r.below(nd)];
    if (capital) d[0] = char(d[0] - 'a' + 'A');
    out += d;
    if (r.below(2) == 0) (out += ' ') += adj[r.below(na)];
    const std::size_t n = r.below(nn);
    (out += ' ') += noun[n];
    return n;
  };
  std::size_t in_paragraph = 0;
  while (out.size() < bytes) {
    const std::size_t subject = np_phrase(true);
    // The subject's three favourite verbs take 3/4 of the mass.
    const std::size_t v = r.below(4) < 3 ? (subject * 3 + r.below(3)) % nv : r.below(nv);
    (out += ' ') += verb[v];
    out += ' ';
    np_phrase(false);
    if (r.below(3) == 0) {
      (out += ' ') += prep[r.below(np)];
      out += ' ';
      np_phrase(false);
    }
    out += '.';
    if (++in_paragraph == 4 + r.below(4)) {
      out += '\n';
      in_paragraph = 0;
    } else {
      out += ' ';
    }
  }
  out.resize(bytes);
  return {out.begin(), out.end()};
}

/// The bytes of a file. An unreadable or empty file is a ConfigError naming
/// `flag` (e.g. "--data") and the path.
inline std::vector<std::uint8_t> read_corpus(const std::string& path, const char* flag = "--data") {
  std::ifstream f(path, std::ios::binary);
  WEFT_REQUIRE(f.good(), ConfigError, flag, " ", path, ": cannot open the file (", std::strerror(errno),
               "); give a readable text file");
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  WEFT_REQUIRE(!f.bad(), ConfigError, flag, " ", path, ": reading failed (", std::strerror(errno), ")");
  WEFT_REQUIRE(!bytes.empty(), ConfigError, flag, " ", path, ": the file is empty; give a text file with at least one sequence of bytes");
  return bytes;
}

/// Entropy in nats of the corpus' byte frequencies: the loss of the best model
/// that ignores context. A model that learnt anything beats it.
inline double unigram_entropy(const std::vector<std::uint8_t>& bytes) {
  double count[256] = {};
  for (auto b : bytes) count[b] += 1;
  double h = 0;
  for (double c : count)
    if (c > 0) {
      const double p = c / double(bytes.size());
      h -= p * std::log(p);
    }
  return h;
}

}  // namespace weft::data
