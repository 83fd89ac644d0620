// What every pipeline stage keeps the same way, whatever its layers: the
// activation slots of in-flight microbatches, pooled per chunk so that a step
// allocates nothing after the first, and the spare buffers of input-gradient
// sends that outlive their slot. Used by pipeline::Stage and LayerStage.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <weft/nn/parameter.hpp>

namespace weft::pipeline::detail {

/// Slots keyed by (microbatch, chunk): live ones, and per chunk a pool of
/// released ones for reuse. Slot must have a `deferred` member (nn::DeferredWork).
template <class Slot>
class SlotPool {
 public:
  /// The slot of (mb, c): the live one, a pooled one of chunk c, or make().
  template <class Make>
  Slot& get(int mb, int c, Make&& make) {
    const auto key = std::make_pair(mb, c);
    auto it = live_.find(key);
    if (it != live_.end()) return *it->second;
    auto& pool = pool_[std::size_t(c)];
    std::unique_ptr<Slot> s;
    if (!pool.empty()) {
      s = std::move(pool.back());
      pool.pop_back();
    } else {
      s = make();
    }
    Slot& ref = *s;
    live_.emplace(key, std::move(s));
    peak_ = std::max(peak_, live_.size());
    return ref;
  }
  /// Whether (mb, c) has a live slot.
  bool has(int mb, int c) const { return live_.count(std::make_pair(mb, c)) != 0; }
  /// Returns the slot of (mb, c) to its chunk's pool (its deferred work dropped).
  void release(int mb, int c) {
    auto it = live_.find(std::make_pair(mb, c));
    if (it == live_.end()) return;
    it->second->deferred.clear();
    pool_[std::size_t(c)].push_back(std::move(it->second));
    live_.erase(it);
  }
  /// Returns every live slot to the pools (after a failed step).
  void release_all() {
    std::vector<std::pair<int, int>> keys;
    for (auto& [k, s] : live_) keys.push_back(k);
    for (auto& k : keys) release(k.first, k.second);
  }
  /// Most slots live at once so far.
  std::size_t peak() const { return peak_; }
  /// Slots live now.
  std::size_t live() const { return live_.size(); }
  /// Calls f(slot, chunk) for every slot allocated so far, live and pooled.
  template <class F>
  void for_each(F&& f) const {
    for (auto& [k, s] : live_) f(*s, std::size_t(k.second));
    for (auto& [c, pool] : pool_)
      for (auto& s : pool) f(*s, c);
  }

 private:
  std::map<std::pair<int, int>, std::unique_ptr<Slot>> live_;
  std::map<std::size_t, std::vector<std::unique_ptr<Slot>>> pool_;
  std::size_t peak_ = 0;
};

/// Buffers of one input-gradient message ([rows, cols]) for sends that
/// outlive their slot: reserved up front by the executor's cap, taken and
/// returned as sends start and complete, counted for the memory ledger.
template <class Matrix>
class SendBuffers {
 public:
  /// Allocates spares until `n` buffers exist in all.
  void reserve(std::size_t n, std::size_t rows, std::size_t cols) {
    for (; count_ < n; ++count_) spare_.emplace_back("pipeline.send_buffer", rows, cols);
  }
  /// A spare buffer, or a new one when none is spare.
  Matrix take(std::size_t rows, std::size_t cols) {
    if (spare_.empty()) {
      ++count_;
      return Matrix("pipeline.send_buffer", rows, cols);
    }
    Matrix m = spare_.back();
    spare_.pop_back();
    return m;
  }
  /// Returns a buffer whose send has completed.
  void give(const Matrix& m) { spare_.push_back(m); }
  /// Buffers allocated so far.
  std::size_t count() const { return count_; }

 private:
  std::vector<Matrix> spare_;
  std::size_t count_ = 0;
};

/// Tells the group hooks, after a chunk's last action of the step that adds
/// weight gradients, which groups' weight gradients are complete: the
/// chunk's block groups at once, the root group (whose parameters the chunks
/// holding the model's first and last layers share) once every chunk that
/// holds part of it is done.
class WeightsDone {
 public:
  void operator()(nn::GroupHooks* hooks, const std::vector<std::size_t>& block_groups, bool holds_root,
                  std::size_t root_holders, std::size_t root_group) {
    if (!hooks) return;
    for (std::size_t g : block_groups) hooks->after_weight_gradients(g);
    if (!holds_root) return;
    if (++done_ == root_holders) {
      done_ = 0;
      hooks->after_weight_gradients(root_group);
    }
  }

 private:
  std::size_t done_ = 0;  // chunks holding root parameters whose weights are done this step
};

}  // namespace weft::pipeline::detail
