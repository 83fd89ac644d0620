// The key/value cache of a serving runtime, in fixed-size blocks: one pool
// of blocks per layer for keys and one for values, a free list that hands
// blocks out and takes them back, and a block table per request that maps its
// token positions to blocks. A request holds only the blocks its tokens use,
// so memory follows the tokens actually in flight, not batch x context.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <weft/core/allocation.hpp>
#include <weft/core/error.hpp>
#include <weft/ops/common.hpp>

namespace weft::serve {

/// Blocks needed to hold `tokens` tokens in blocks of `block_size`.
constexpr std::size_t blocks_for(std::size_t tokens, std::size_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

/// The free list of a pool of blocks (host bookkeeping only; no device data).
/// allocate() throws rather than hand out a block that is not free, so the
/// pool can never run out silently: the scheduler plans within free().
class BlockAllocator {
 public:
  /// A pool of `blocks` blocks, all free.
  explicit BlockAllocator(std::size_t blocks) : total_(blocks), used_(blocks, false) {
    free_.reserve(blocks);
    for (std::size_t b = blocks; b-- > 0;) free_.push_back(int(b));  // hand out low ids first
  }
  /// Blocks in the pool.
  std::size_t total() const { return total_; }
  /// Blocks free now.
  std::size_t free() const { return free_.size(); }
  /// Blocks held by requests now.
  std::size_t used() const { return total_ - free_.size(); }
  /// Appends `n` free blocks to `table`. Throws weft::Error when fewer are free.
  void allocate(std::size_t n, std::vector<int>& table) {
    WEFT_REQUIRE(n <= free_.size(), Error, "serve::BlockAllocator: ", n, " blocks requested but only ", free_.size(),
                 " of ", total_, " are free (the scheduler must plan within the free blocks)");
    for (std::size_t i = 0; i < n; ++i) {
      const int b = free_.back();
      free_.pop_back();
      used_[std::size_t(b)] = true;
      table.push_back(b);
    }
  }
  /// Returns every block of `table` to the pool and clears it. Throws
  /// weft::Error for a block that is not held (a double free).
  void release(std::vector<int>& table) {
    for (int b : table) {
      WEFT_REQUIRE(b >= 0 && std::size_t(b) < total_ && used_[std::size_t(b)], Error, "serve::BlockAllocator: block ",
                   b, " released but not held");
      used_[std::size_t(b)] = false;
      free_.push_back(b);
    }
    table.clear();
  }

 private:
  std::size_t total_;
  std::vector<bool> used_;
  std::vector<int> free_;
};

/// Keys and values of every layer in blocks: K and V are [layers, blocks,
/// block_size, width] where width = (key/value heads on this rank) x head_dim.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
struct KVCache {
  /// The storage of one of K or V.
  using Pool = Kokkos::View<T****, Kokkos::LayoutRight, Space>;
  Pool k, v;                   ///< keys and values
  std::size_t block_size = 0;  ///< tokens per block
  /// A cache of `blocks` blocks of `block_size` tokens for `layers` layers of `width` features.
  KVCache(std::size_t layers, std::size_t blocks, std::size_t block_size_, std::size_t width)
      : k(allocate_view<Pool>("serve.kv_cache.k", layers, blocks, block_size_, width)),
        v(allocate_view<Pool>("serve.kv_cache.v", layers, blocks, block_size_, width)),
        block_size(block_size_) {
    WEFT_REQUIRE(block_size_ > 0 && blocks > 0, ConfigError, "serve::KVCache: ", blocks, " blocks of ", block_size_,
                 " tokens; both must be positive");
  }
  /// Blocks in the pool.
  std::size_t blocks() const { return k.extent(1); }
  /// Tokens the whole pool holds.
  std::size_t capacity_tokens() const { return blocks() * block_size; }
  /// Bytes of K and V together.
  std::size_t bytes() const { return 2 * k.span() * sizeof(T); }
};

}  // namespace weft::serve
