// Attribution of every allocation of a model run to one category --
// parameters, gradients, optimizer state, activations, buffers -- so a run
// record reports memory the way the training-memory budget is written.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace weft::metrics {

/// The categories of the training-memory budget.
enum class MemoryCategory { parameters, gradients, optimizer_state, activations, buffers };

/// The name a category has in run records.
inline const char* category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters: return "parameters";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::optimizer_state: return "optimizer_state";
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::buffers: return "buffers";
  }
  return "unknown";
}

/// Bytes by category, with the labelled items that make them up. weft's
/// models allocate everything at construction and keep it for the run, so the
/// sum is also the peak of what weft allocates (the BLAS library's own
/// workspace and the MPI buffers are not included).
class MemoryLedger {
 public:
  /// One labelled allocation.
  struct Item {
    MemoryCategory category;
    std::string label;
    std::size_t bytes;
  };

  /// Records `bytes` under category and label.
  void add(MemoryCategory c, std::string label, std::size_t bytes) { items_.push_back({c, std::move(label), bytes}); }
  /// Total bytes of one category.
  std::size_t bytes(MemoryCategory c) const {
    std::size_t s = 0;
    for (const auto& i : items_)
      if (i.category == c) s += i.bytes;
    return s;
  }
  /// Total bytes recorded under `label` (0 when none is).
  std::size_t bytes(const std::string& label) const {
    std::size_t s = 0;
    for (const auto& i : items_)
      if (i.label == label) s += i.bytes;
    return s;
  }
  /// Total bytes of all categories.
  std::size_t total() const {
    std::size_t s = 0;
    for (const auto& i : items_) s += i.bytes;
    return s;
  }
  /// Every recorded allocation.
  const std::vector<Item>& items() const { return items_; }
  /// Appends another ledger's items (a model's and its optimizer's).
  void merge(const MemoryLedger& o) { items_.insert(items_.end(), o.items_.begin(), o.items_.end()); }

 private:
  std::vector<Item> items_;
};

}  // namespace weft::metrics
