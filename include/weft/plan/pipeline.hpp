// The planner's view of a pipeline: which schedule, which units (embedding,
// blocks, head) each rank holds, how many microbatch activation slots each of
// its chunks allocates in a step, and the schedule's bubble. Plain C++ (no
// Kokkos, no MPI): it reuses the schedules' plans and the runtime's equal
// partition, so the planner predicts what weft's pipeline executor does.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/parallel/pipeline/partition.hpp>
#include <weft/parallel/pipeline/send_cap.hpp>
#include <weft/vocabulary/schedule.hpp>

namespace weft::plan {

/// A pipeline schedule (weft/vocabulary/schedule.hpp): GPipe, 1F1B, interleaved
/// 1F1B with `chunks` virtual stages per rank, or zero-bubble ZB-H1.
enum class Schedule { gpipe, one_f_one_b, interleaved, zero_bubble };

/// The command-line name of a schedule ("interleaved:V" needs V).
inline std::string schedule_name(Schedule s, std::size_t chunks) {
  switch (s) {
    case Schedule::gpipe: return "gpipe";
    case Schedule::one_f_one_b: return "1f1b";
    case Schedule::interleaved: return std::string("interleaved:").append(std::to_string(chunks));
    case Schedule::zero_bubble: return "zb";
  }
  return "?";
}

/// Parses gpipe|1f1b|interleaved:V|zb (V from 2 to 8) into (schedule, chunks).
inline std::pair<Schedule, std::size_t> parse_schedule_name(std::string_view v) {
  if (v == "gpipe") return {Schedule::gpipe, 1};
  if (v == "1f1b") return {Schedule::one_f_one_b, 1};
  if (v == "zb") return {Schedule::zero_bubble, 1};
  if (v.rfind("interleaved:", 0) == 0) {
    const std::string n(v.substr(12));
    if (n.size() == 1 && n[0] >= '2' && n[0] <= '8') return {Schedule::interleaved, std::size_t(n[0] - '0')};
  }
  weft::detail::throw_error<ConfigError>("schedule \"", v, "\": expected gpipe, 1f1b, interleaved:V (V = 2..8) or zb");
}

namespace detail {
// Calls f(Schedule type) for the runtime choice (s, chunks).
template <int V = 2, class F>
auto with_schedule(Schedule s, std::size_t chunks, F&& f) {
  if (s == Schedule::gpipe) return f(GPipe{});
  if (s == Schedule::one_f_one_b) return f(OneFOneB{});
  if (s == Schedule::zero_bubble) return f(ZeroBubble{});
  if constexpr (V <= 8) {
    if (std::size_t(V) == chunks) return f(Interleaved1F1B<V>{});
    return with_schedule<V + 1>(s, chunks, std::forward<F>(f));
  } else {
    weft::detail::throw_error<ConfigError>("schedule interleaved:", chunks, ": V must be between 2 and 8");
  }
}
}  // namespace detail

/// The plan of `rank` for schedule s with `chunks` virtual stages per rank on
/// p stages and m microbatches (the schedule's own check applies).
inline std::vector<PipeAction> schedule_plan(Schedule s, std::size_t chunks, int p, int m, int rank) {
  return detail::with_schedule(s, chunks, [&](auto sched) {
    using S = decltype(sched);
    return Pipeline<S>(p, m).plan(rank);
  });
}

/// The schedule's analytic idle fraction on p stages and m microbatches, with
/// a backward costing twice a forward (its input- and weight-gradient halves
/// one forward each) and no transfer time.
inline double schedule_bubble(Schedule s, std::size_t chunks, int p, int m) {
  if (p <= 1) return 0.0;
  return detail::with_schedule(s, chunks, [&](auto sched) {
    using S = decltype(sched);
    return S::bubble_fraction(p, m, PipeCosts{});
  });
}

/// Why schedule s cannot run p stages with m microbatches (empty: it can).
inline std::string schedule_rejection(Schedule s, std::size_t chunks, int p, int m) {
  try {
    detail::with_schedule(s, chunks, [&](auto sched) {
      decltype(sched)::check(p, m);
      return 0;
    });
  } catch (const ConfigError& e) {
    return e.what();
  }
  return {};
}

/// What one chunk (virtual stage) of a pipeline rank holds.
struct ChunkLayout {
  std::size_t virtual_stage = 0;  ///< c * pp + rank for chunk c
  std::size_t blocks = 0;    ///< transformer blocks
  bool embedding = false;    ///< holds the embedding (unit 0): its input is token ids, it sends no gradient
  bool head = false;         ///< holds the final norm and LM head: it computes the loss, receives no gradient
  std::size_t slots = 0;     ///< activation slots (one per in-flight microbatch) it allocates in a step
};

/// The chunks of pipeline rank `rank` of p, with `chunks` virtual stages per
/// rank over weft's equal partition of layers (the runtime's default).
inline std::vector<ChunkLayout> chunk_layouts(std::size_t layers, std::size_t p, std::size_t chunks, std::size_t rank) {
  const auto part = pipeline::equal_partition(layers, p * chunks);
  std::vector<ChunkLayout> out;
  for (std::size_t c = 0; c < chunks; ++c) {
    ChunkLayout k;
    k.virtual_stage = c * p + rank;
    k.blocks = part.blocks(k.virtual_stage, layers);
    k.embedding = part.begin(k.virtual_stage) == 0;
    k.head = part.end(k.virtual_stage) == pipeline::unit_count(layers);
    out.push_back(k);
  }
  return out;
}

/// Activation slots per chunk that weft's pipeline executor allocates on
/// `rank` in one step of `plan`: it replays the executor's rules. A slot is
/// taken when a forward, backward, send or receive of (microbatch, chunk)
/// first touches it; receives are posted ahead, up to the compute after the
/// next one; a slot returns to its chunk's pool before the next action once
/// its backward (the weight half, for split backwards) is complete and its
/// input gradient has been sent (on virtual stage 0, at once). A chunk
/// allocates the most slots it held at one time.
inline std::vector<std::size_t> executor_slots(const std::vector<PipeAction>& plan, std::size_t chunks, std::size_t p,
                                               std::size_t rank) {
  struct Slots {
    const std::vector<PipeAction>& plan;
    std::set<std::pair<int, int>> live;
    std::vector<std::size_t> held, peak;
    void touch(const PipeAction& a) {
      if (live.insert({a.microbatch, a.chunk}).second) {
        auto c = std::size_t(a.chunk);
        peak[c] = std::max(peak[c], ++held[c]);
      }
    }
    void post(std::size_t k) { touch(plan[k]); }
    void action(std::size_t k) { touch(plan[k]); }
    void retire(int mb, int c) {
      live.erase({mb, c});
      --held[std::size_t(c)];
    }
    void flush(int, int) {}
  } v{plan, {}, std::vector<std::size_t>(chunks, 0), std::vector<std::size_t>(chunks, 0)};
  pipeline::replay_executor(plan, p, rank, v);
  return v.peak;
}

/// The send buffers (one input-gradient message each) the executor
/// preallocates on every pipeline rank that sends gradients, for schedule s
/// with `chunks` virtual stages per rank on p ranks and m microbatches:
/// pipeline::default_send_cap() of the plans (1 for every schedule weft
/// ships, on the sizes test_schedule checks), 0 without a pipeline.
/// Remembered per arguments: the replay visits every rank's plan.
inline std::size_t pipeline_send_cap(Schedule s, std::size_t chunks, std::size_t p, std::size_t m) {
  if (p <= 1) return 0;
  const std::size_t v = s == Schedule::interleaved ? chunks : 1;
  static std::mutex mutex;
  static std::map<std::tuple<Schedule, std::size_t, std::size_t, std::size_t>, std::size_t> known;
  const auto key = std::make_tuple(s, v, p, m);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = known.find(key); it != known.end()) return it->second;
  }
  std::vector<std::vector<PipeAction>> plans;
  for (std::size_t r = 0; r < p; ++r) plans.push_back(schedule_plan(s, v, int(p), int(m), int(r)));
  const std::size_t cap = pipeline::default_send_cap(plans);
  std::lock_guard<std::mutex> lock(mutex);
  known[key] = cap;
  return cap;
}

/// The chunks of pipeline rank `rank` with the slots the executor allocates
/// for schedule s on m microbatches (m >= 1). With p = 1 and one chunk, a
/// single slot: the one microbatch of a plain training step.
inline std::vector<ChunkLayout> pipeline_rank_layout(std::size_t layers, Schedule s, std::size_t chunks, std::size_t p,
                                                     std::size_t m, std::size_t rank) {
  const std::size_t v = s == Schedule::interleaved && p > 1 ? chunks : 1;  // no pipeline: one chunk
  auto out = chunk_layouts(layers, p, v, rank);
  if (p <= 1) {
    for (auto& k : out) k.slots = 1;
    return out;
  }
  const auto slots = executor_slots(schedule_plan(s, v, int(p), int(m), int(rank)), v, p, rank);
  for (std::size_t c = 0; c < v; ++c) out[c].slots = slots[c];
  return out;
}

}  // namespace weft::plan
