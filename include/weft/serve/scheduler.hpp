// The batching scheduler of the serving runtime as a pure function: the
// state of the queues and the step's limits in, the step plan out. It runs
// no model and touches no memory, so every policy decision (which sequences
// run, how many prompt tokens each gets, who is preempted, who is admitted)
// is testable on its own, and every tensor-parallel rank computes the same
// plan from the same state.
//
// Continuous (iteration-level) batching: every step, running sequences go
// first in arrival order (a decode takes one token, a prompt being prefilled
// takes what is left of the token budget: chunked prefill beside the
// decodes); then waiting sequences are admitted in arrival order while the
// sequence limit, the token budget and the free blocks allow. When a running
// sequence needs a block and none is free, the youngest running sequence is
// preempted: its blocks are freed and it waits to be recomputed from its
// tokens so far. The oldest sequence is never preempted for a younger one,
// so the oldest always makes progress and every request completes.
// Static batching (the baseline of bench_serve) admits only when nothing
// runs: a batch is formed once and runs until all its sequences end.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <weft/serve/kv_cache.hpp>

namespace weft::serve {

/// How sequences join a batch.
enum class Batching {
  continuous,  ///< iteration-level: waiting sequences join whenever there is room
  static_batch ///< a batch is formed when nothing runs and runs until every sequence in it ends
};

/// The limits of one step.
struct StepLimits {
  std::size_t token_budget = 256;  ///< tokens one forward pass may process
  std::size_t max_seqs = 16;       ///< sequences one step may hold (running)
  std::size_t block_size = 16;     ///< tokens per KV block
  Batching batching = Batching::continuous;
};

/// What the scheduler knows of one sequence.
struct SeqState {
  std::uint64_t id = 0;      ///< arrival order: lower ids arrived earlier
  std::size_t known = 0;     ///< tokens known: prompt + generated so far
  std::size_t computed = 0;  ///< tokens whose keys and values are in the cache
  std::size_t blocks = 0;    ///< KV blocks the sequence holds
};

/// The queues and the free blocks at the start of a step.
struct QueueState {
  std::vector<SeqState> running;  ///< sequences holding blocks, in arrival order
  std::vector<SeqState> waiting;  ///< sequences holding none (new, or preempted), in arrival order
  std::size_t free_blocks = 0;    ///< blocks free in the pool
};

/// One sequence's share of a step: tokens [first, first + count) of its known tokens.
struct ScheduledSeq {
  std::uint64_t id = 0;          ///< the sequence
  std::size_t first = 0;         ///< first token of the chunk (= computed)
  std::size_t count = 0;         ///< tokens processed this step (at least 1)
  std::size_t new_blocks = 0;    ///< blocks to allocate for it before the step
  bool samples = false;          ///< the chunk ends at its last known token: sample the next one
};

/// What one step does.
struct StepPlan {
  std::vector<ScheduledSeq> batch;        ///< sequences that run, running ones first
  std::vector<std::uint64_t> preempted;   ///< running sequences that lose their blocks (recomputed later)
  std::vector<std::uint64_t> admitted;    ///< waiting sequences that start running (possibly with no tokens yet)
  std::size_t tokens = 0;                 ///< tokens in the batch (<= token_budget)
  std::size_t blocks_after = 0;           ///< free blocks left after the step's allocations
};

/// The step plan for queue state q under limits l. A pure function: the
/// same inputs give the same plan. Guarantees: tokens <= token_budget;
/// running + admitted - preempted <= max_seqs; the new blocks never exceed
/// the free blocks (with the preempted sequences' blocks returned).
inline StepPlan schedule(const QueueState& q, const StepLimits& l) {
  StepPlan plan;
  const std::size_t bs = l.block_size;
  std::size_t free = q.free_blocks, budget = l.token_budget;
  std::vector<SeqState> run = q.running;
  std::sort(run.begin(), run.end(), [](const SeqState& a, const SeqState& b) { return a.id < b.id; });
  std::size_t end = run.size();  // run[end, ...) are preempted
  for (std::size_t i = 0; i < end; ++i) {
    const SeqState& s = run[i];
    std::size_t count = std::min(s.known - s.computed, budget);
    if (count == 0) continue;  // nothing to do, or no budget left: it waits this step holding its blocks
    // Without preempting, a prompt chunk may shrink to the blocks it can get.
    const std::size_t room = (s.blocks + free) * bs - s.computed;
    if (room == 0) {
      // One token needs a block none has free: preempt the youngest, down to this one.
      while (end > i + 1 && (s.blocks + free) * bs <= s.computed) {
        --end;
        free += run[end].blocks;
        plan.preempted.push_back(run[end].id);
      }
      if ((s.blocks + free) * bs <= s.computed) {  // alone and still no room: preempt itself
        free += s.blocks;
        plan.preempted.push_back(s.id);
        end = i;
        break;
      }
    }
    count = std::min(count, (s.blocks + free) * bs - s.computed);
    const std::size_t need = blocks_for(s.computed + count, bs);
    const std::size_t add = need > s.blocks ? need - s.blocks : 0;
    free -= add;
    budget -= count;
    plan.batch.push_back({s.id, s.computed, count, add, s.computed + count == s.known});
    plan.tokens += count;
  }
  std::size_t seqs = end;
  // Admission: never while this step preempts (the preempted would be readmitted at once and thrash).
  const bool may_admit = plan.preempted.empty() && (l.batching == Batching::continuous || q.running.empty());
  if (may_admit) {
    std::vector<SeqState> wait = q.waiting;
    std::sort(wait.begin(), wait.end(), [](const SeqState& a, const SeqState& b) { return a.id < b.id; });
    for (const SeqState& w : wait) {
      if (seqs >= l.max_seqs) break;
      std::size_t count = std::min({w.known, budget, free * bs});
      if (count == 0) {
        // Static batching forms its whole batch now; members without budget yet run from the next step.
        if (l.batching == Batching::static_batch) {
          plan.admitted.push_back(w.id);
          ++seqs;
          continue;
        }
        break;  // first come, first served: later arrivals do not overtake
      }
      const std::size_t add = blocks_for(count, bs);
      free -= add;
      budget -= count;
      plan.admitted.push_back(w.id);
      plan.batch.push_back({w.id, 0, count, add, count == w.known});
      plan.tokens += count;
      ++seqs;
    }
  }
  plan.blocks_after = free;
  return plan;
}

}  // namespace weft::serve
