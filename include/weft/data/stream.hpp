// The training data stream: the global batch of step s is fixed by (seed, s)
// alone -- sequence i of it starts at a position drawn from a counter-based
// generator -- and each data-parallel rank copies out its own slice, so any
// rank layout trains on exactly the single-process data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <weft/ops/common.hpp>
#include <weft/ops/random.hpp>

namespace weft::data {

/// Random windows of a token sequence: inputs and next-token targets.
class TokenStream {
 public:
  /// Windows of `seq` inputs (and `seq` targets shifted by one) over `tokens`.
  /// Throws ConfigError when the corpus is shorter than seq + 1 tokens.
  TokenStream(std::vector<int> tokens, std::size_t seq, std::uint64_t seed)
      : tokens_(std::move(tokens)), seq_(seq), seed_(seed) {
    WEFT_REQUIRE(seq > 0, ConfigError, "--seq is 0; expected a positive integer");
    WEFT_REQUIRE(tokens_.size() >= seq + 1, ConfigError, "the corpus has ", tokens_.size(),
                 " tokens, fewer than --seq + 1 = ", seq + 1, "; use a longer file or a shorter --seq");
  }
  /// Byte tokens of a corpus.
  TokenStream(const std::vector<std::uint8_t>& bytes, std::size_t seq, std::uint64_t seed)
      : TokenStream(std::vector<int>(bytes.begin(), bytes.end()), seq, seed) {}

  /// Start of sequence `index` (0 <= index < global_batch) of step `step`'s global batch.
  std::size_t offset(std::uint64_t step, std::size_t global_batch, std::size_t index) const {
    const std::uint64_t counter = step * std::uint64_t(global_batch) + index;
    const std::size_t windows = tokens_.size() - seq_;  // valid starts: [0, windows)
    return std::size_t(ops::Philox(seed_, ops::name_hash("weft.data"), counter).uniform() * double(windows)) % windows;
  }

  /// Fills ids and targets ([count * seq], any memory space) with sequences
  /// [first, first + count) of step `step`'s global batch of `global_batch` sequences.
  template <class IV, class TV>
  void fill(std::uint64_t step, std::size_t global_batch, std::size_t first, std::size_t count, const IV& ids,
            const TV& targets) const {
    WEFT_REQUIRE(first + count <= global_batch, ConfigError, "data slice [", first, ", ", first + count,
                 ") lies outside the global batch of ", global_batch, " sequences");
    ops::detail::require_extent("data::TokenStream::fill", "ids", ids, 0, count * seq_);
    ops::detail::require_extent("data::TokenStream::fill", "targets", targets, 0, count * seq_);
    auto hi = Kokkos::create_mirror_view(ids);
    auto ht = Kokkos::create_mirror_view(targets);
    for (std::size_t s = 0; s < count; ++s) {
      const std::size_t o = offset(step, global_batch, first + s);
      for (std::size_t t = 0; t < seq_; ++t) {
        hi(s * seq_ + t) = tokens_[o + t];
        ht(s * seq_ + t) = tokens_[o + t + 1];
      }
    }
    Kokkos::deep_copy(ids, hi);
    Kokkos::deep_copy(targets, ht);
  }

  /// Tokens in the corpus.
  std::size_t size() const { return tokens_.size(); }
  /// Sequence length.
  std::size_t seq() const { return seq_; }
  /// Largest token id + 1 (the smallest vocabulary that covers the corpus).
  int min_vocab() const {
    int m = 0;
    for (int t : tokens_) m = t + 1 > m ? t + 1 : m;
    return m;
  }

 private:
  std::vector<int> tokens_;
  std::size_t seq_;
  std::uint64_t seed_;
};

}  // namespace weft::data
