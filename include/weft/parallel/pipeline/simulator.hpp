// Executes pipeline plans without MPI: checks that every send meets its receive
// in order (no deadlock), that every backward follows its forward, measures the
// activation memory and the idle fraction, and exports the timeline as text or
// as a Chrome trace (chrome://tracing, Perfetto).
#pragma once

#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/vocabulary/schedule.hpp>

namespace weft {

/// A plan that cannot run as written: a deadlock, a receive that meets another
/// message than it expects, a backward before its forward, missing work.
class PlanError : public Error {
 public:
  using Error::Error;
};

/// One compute operation as the simulator timed it.
struct PipeEvent {
  int rank = 0;          ///< pipeline rank that ran it
  PipeOp op = PipeOp::forward;
  int microbatch = 0;
  int chunk = 0;
  double start = 0.0;    ///< in cost units
  double end = 0.0;
};

/// What simulate_pipeline measured.
struct PipeSimulation {
  int stages = 0;
  int microbatches = 0;
  int chunks = 1;
  double makespan = 0.0;            ///< end of the last operation on any rank
  std::vector<double> busy;         ///< compute time per rank
  std::vector<int> peak_in_flight;  ///< most activations held at once per rank (chunk-microbatches)
  std::vector<PipeEvent> events;    ///< every compute operation, in execution order per rank

  /// Idle share of all rank-time, 1 - sum(busy) / (stages * makespan).
  double idle_fraction() const {
    double total = 0;
    for (double b : busy) total += b;
    return makespan > 0 ? 1.0 - total / (stages * makespan) : 0.0;
  }
  /// Idle share of one rank's time, 1 - busy[rank] / makespan.
  double idle_fraction(int rank) const { return makespan > 0 ? 1.0 - busy.at(rank) / makespan : 0.0; }
};

namespace detail {

inline std::string describe(const PipeAction& a) {
  std::ostringstream os;
  os << to_string(a.op) << " of microbatch " << a.microbatch << " chunk " << a.chunk;
  if (a.peer >= 0) os << (a.op == PipeOp::send_activation || a.op == PipeOp::send_gradient ? " to rank " : " from rank ")
                      << a.peer;
  return os.str();
}

// Per (microbatch, chunk) progress on one rank.
struct PipeItemState {
  bool received_activation = false, forward = false, received_gradient = false;
  bool backward_input = false, backward_weight = false, sent_activation = false, sent_gradient = false;
};

}  // namespace detail

/// Runs `plans` (one per rank; rank r's chunk c is virtual stage c*p + r) with
/// the given costs. Sends never block (they are posted non-blocking); a receive
/// blocks until the matching send has run plus costs.transfer. Messages between
/// two ranks travel in two FIFO channels (activations, gradients), as MPI's
/// non-overtaking rule orders messages with one tag, so each receive must meet
/// exactly the message it names. Throws PlanError naming the rank, the step and
/// what went wrong when a plan is inconsistent, incomplete or deadlocks.
inline PipeSimulation simulate_pipeline(const std::vector<std::vector<PipeAction>>& plans, int microbatches,
                                        int chunks = 1, const PipeCosts& costs = {}) {
  const int p = int(plans.size());
  WEFT_REQUIRE(p >= 1 && microbatches >= 1 && chunks >= 1, ConfigError, "simulate_pipeline: ", p, " plans, ",
               microbatches, " microbatches, ", chunks, " chunks; each must be at least 1.");
  const int last_vs = p * chunks - 1;
  PipeSimulation sim;
  sim.stages = p;
  sim.microbatches = microbatches;
  sim.chunks = chunks;
  sim.busy.assign(p, 0.0);
  sim.peak_in_flight.assign(p, 0);

  struct Message {
    int microbatch;
    int dest_chunk;
    double ready;
  };
  // (source, destination, is_gradient) -> messages in flight, oldest first.
  std::map<std::tuple<int, int, bool>, std::deque<Message>> channels;
  std::vector<std::vector<detail::PipeItemState>> state(
      p, std::vector<detail::PipeItemState>(std::size_t(microbatches) * chunks));
  std::vector<double> clock(p, 0.0);
  std::vector<std::size_t> next(p, 0);
  std::vector<int> in_flight(p, 0);
  std::vector<int> split_mode(p, -1);  // -1 unknown, 0 full backward, 1 split

  auto fail = [&](int r, const std::string& what) {
    detail::throw_error<PlanError>("pipeline plan: rank ", r, " step ", next[r], " (",
                                   detail::describe(plans[r][next[r]]), "): ", what);
  };

  bool progressed = true;
  std::size_t done = 0;
  std::size_t total_steps = 0;
  for (const auto& pl : plans) total_steps += pl.size();
  while (done < total_steps) {
    if (!progressed) {
      std::ostringstream os;
      os << "pipeline plan deadlocks: every unfinished rank waits for a message that is never sent.";
      for (int r = 0; r < p; ++r)
        if (next[r] < plans[r].size())
          os << " Rank " << r << " waits at step " << next[r] << " (" << detail::describe(plans[r][next[r]]) << ").";
      throw PlanError(os.str());
    }
    progressed = false;
    for (int r = 0; r < p; ++r) {
      while (next[r] < plans[r].size()) {
        const PipeAction& a = plans[r][next[r]];
        WEFT_REQUIRE(a.microbatch >= 0 && a.microbatch < microbatches && a.chunk >= 0 && a.chunk < chunks,
                     PlanError, "pipeline plan: rank ", r, " step ", next[r], " names microbatch ", a.microbatch,
                     " chunk ", a.chunk, ", outside ", microbatches, " microbatches and ", chunks, " chunks.");
        auto& st = state[r][std::size_t(a.microbatch) * chunks + a.chunk];
        const int vs = a.chunk * p + r;
        const bool is_send = a.op == PipeOp::send_activation || a.op == PipeOp::send_gradient;
        const bool is_recv = a.op == PipeOp::recv_activation || a.op == PipeOp::recv_gradient;
        const bool gradient = a.op == PipeOp::send_gradient || a.op == PipeOp::recv_gradient;
        if (is_send || is_recv) {
          // The neighbour virtual stage this message crosses to (sends) or comes from (receives).
          const bool towards_next = (a.op == PipeOp::send_activation) || (a.op == PipeOp::recv_gradient);
          const int other_vs = towards_next ? vs + 1 : vs - 1;
          if (other_vs < 0 || other_vs > last_vs) fail(r, "there is no virtual stage on that side of this one");
          const int other_rank = other_vs % p;
          if (a.peer != other_rank)
            fail(r, "the neighbouring virtual stage lives on rank " + std::to_string(other_rank) + ", not rank " +
                        std::to_string(a.peer));
          const int other_chunk = other_vs / p;
          if (is_send) {
            if (!gradient && !st.forward) fail(r, "sends an activation before computing its forward");
            if (gradient && !st.backward_input) fail(r, "sends a gradient before computing its backward");
            bool& sent = gradient ? st.sent_gradient : st.sent_activation;
            if (sent) fail(r, "sends the same message twice");
            sent = true;
            channels[{r, other_rank, gradient}].push_back({a.microbatch, other_chunk, clock[r] + costs.transfer});
          } else {
            auto& ch = channels[{other_rank, r, gradient}];
            if (ch.empty()) break;  // blocked: try the other ranks
            const Message msg = ch.front();
            if (msg.microbatch != a.microbatch || msg.dest_chunk != a.chunk)
              fail(r, "the next message from rank " + std::to_string(other_rank) + " on that channel is for microbatch " +
                          std::to_string(msg.microbatch) + " chunk " + std::to_string(msg.dest_chunk) +
                          "; sends and receives between two ranks must come in the same order");
            ch.pop_front();
            clock[r] = std::max(clock[r], msg.ready);
            (gradient ? st.received_gradient : st.received_activation) = true;
          }
        } else {
          double cost = 0;
          switch (a.op) {
            case PipeOp::forward:
              if (st.forward) fail(r, "runs the same forward twice");
              if (vs > 0 && !st.received_activation) fail(r, "runs a forward before receiving its input activation");
              st.forward = true;
              cost = costs.forward;
              if (++in_flight[r] > sim.peak_in_flight[r]) sim.peak_in_flight[r] = in_flight[r];
              break;
            case PipeOp::backward:
            case PipeOp::backward_input: {
              const int split = a.op == PipeOp::backward_input ? 1 : 0;
              if (split_mode[r] >= 0 && split_mode[r] != split)
                fail(r, "mixes full backwards with split (input/weight) backwards");
              split_mode[r] = split;
              if (!st.forward) fail(r, "runs a backward before its forward");
              if (st.backward_input) fail(r, "runs the same backward twice");
              if (vs < last_vs && !st.received_gradient)
                fail(r, "runs a backward before receiving its output gradient");
              st.backward_input = true;
              cost = costs.backward_input;
              if (!split) {
                st.backward_weight = true;
                cost += costs.backward_weight;
                --in_flight[r];  // activations are freed once the backward is complete
              }
              break;
            }
            case PipeOp::backward_weight:
              if (split_mode[r] != 1 || !st.backward_input) fail(r, "runs a weight gradient before its input gradient");
              if (st.backward_weight) fail(r, "runs the same weight gradient twice");
              st.backward_weight = true;
              cost = costs.backward_weight;
              --in_flight[r];
              break;
            default: break;
          }
          sim.events.push_back({r, a.op, a.microbatch, a.chunk, clock[r], clock[r] + cost});
          clock[r] += cost;
          sim.busy[r] += cost;
        }
        ++next[r];
        ++done;
        progressed = true;
      }
    }
  }

  for (int r = 0; r < p; ++r) {
    for (int mb = 0; mb < microbatches; ++mb)
      for (int c = 0; c < chunks; ++c) {
        const auto& st = state[r][std::size_t(mb) * chunks + c];
        WEFT_REQUIRE(st.forward && st.backward_input && st.backward_weight, PlanError, "pipeline plan: rank ", r,
                     " never completes the ", !st.forward ? "forward" : "backward", " of microbatch ", mb, " chunk ",
                     c, "; every rank must run forward and backward of every microbatch on every chunk.");
      }
    sim.makespan = std::max(sim.makespan, clock[r]);
  }
  for (const auto& [key, ch] : channels)
    WEFT_REQUIRE(ch.empty(), PlanError, "pipeline plan: rank ", std::get<0>(key), " sends ", ch.size(), " ",
                 std::get<2>(key) ? "gradient" : "activation", " message(s) to rank ", std::get<1>(key),
                 " that are never received (first: microbatch ", ch.front().microbatch, ").");
  return sim;
}

/// Builds the plans of `pipe` and simulates them.
template <class Schedule, std::size_t P, std::size_t M>
PipeSimulation simulate_pipeline(const Pipeline<Schedule, P, M>& pipe, const PipeCosts& costs = {}) {
  return simulate_pipeline(pipe.plans(), pipe.microbatches(), Schedule::chunks, costs);
}

namespace detail {
inline std::string event_label(const PipeEvent& e, int chunks) {
  const char letter = e.op == PipeOp::forward ? 'F' : e.op == PipeOp::backward_weight ? 'W' : 'B';
  std::string s(1, letter);
  s += std::to_string(e.microbatch);
  if (chunks > 1) {
    s += '.';  // appended piecewise: gcc 12 at -O3 warns (-Wrestrict) on "." + std::string here
    s += std::to_string(e.chunk);
  }
  return s;
}
}  // namespace detail

/// The timeline as text: one row per rank, `width` characters per cost unit;
/// each operation shows as F/B/W, its microbatch (and .chunk when interleaved),
/// idle time as dots. Operations shorter than their label are cut.
inline std::string pipeline_timeline_text(const PipeSimulation& sim, int width = 3) {
  const int columns = int(sim.makespan * width + 0.5);
  std::vector<std::string> rows(sim.stages, std::string(std::size_t(columns), '.'));
  for (const PipeEvent& e : sim.events) {
    const int a = int(e.start * width + 0.5), b = int(e.end * width + 0.5);
    if (b <= a) continue;
    std::string label = detail::event_label(e, sim.chunks);
    for (int i = a; i < b; ++i)
      rows[e.rank][i] = (i == b - 1 && b - a > 1) ? '|' : (i - a < int(label.size()) ? label[i - a] : ' ');
  }
  std::ostringstream os;
  for (int r = 0; r < sim.stages; ++r) os << "rank " << r << " |" << rows[r] << "|\n";
  os << "idle fraction " << sim.idle_fraction() << ", makespan " << sim.makespan << '\n';
  return os.str();
}

/// The timeline as Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one
/// complete event ("ph": "X") per operation, pid 0, tid = rank, with
/// `us_per_unit` microseconds per cost unit.
inline std::string pipeline_chrome_trace(const PipeSimulation& sim, double us_per_unit = 1000.0) {
  std::ostringstream os;
  os.precision(12);  // long runs in microseconds must not turn into 1.2e+08, which loses the order of events
  os << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  bool first = true;
  for (int r = 0; r < sim.stages; ++r) {
    os << (first ? "" : ",") << "\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " << r
       << ", \"args\": {\"name\": \"rank " << r << "\"}}";
    first = false;
  }
  for (const PipeEvent& e : sim.events) {
    os << ",\n{\"name\": \"" << detail::event_label(e, sim.chunks) << "\", \"cat\": \"" << to_string(e.op)
       << "\", \"ph\": \"X\", \"ts\": " << e.start * us_per_unit << ", \"dur\": " << (e.end - e.start) * us_per_unit
       << ", \"pid\": 0, \"tid\": " << e.rank << ", \"args\": {\"microbatch\": " << e.microbatch
       << ", \"chunk\": " << e.chunk << "}}";
  }
  os << "\n]}\n";
  return os.str();
}

/// Writes pipeline_chrome_trace(sim) to `path`; throws ConfigError if it cannot.
inline void write_pipeline_chrome_trace(const PipeSimulation& sim, const std::string& path,
                                        double us_per_unit = 1000.0) {
  std::ofstream f(path);
  WEFT_REQUIRE(f.good(), ConfigError, "write_pipeline_chrome_trace: cannot open '", path,
               "' for writing; check that its directory exists and is writable.");
  f << pipeline_chrome_trace(sim, us_per_unit);
}

}  // namespace weft
