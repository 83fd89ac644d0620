// How many in-flight input-gradient sends a pipeline rank may hold after
// their microbatch's activations are freed, and the proof that the limit
// cannot deadlock a schedule; and replay_executor, the executor's order of
// events from a plan alone, which this proof and the planner's count of
// activation slots share. Kokkos-free: the planner uses it too.
//
// The executor frees a microbatch's activations (its slot) once the backward
// is complete and the input gradient has been sent. The send may still be in
// flight then; its buffer moves to one of `cap` preallocated send buffers.
// When all of them are in flight, the executor waits until one of them (or the
// new send) completes. Waiting on a send can deadlock: the send completes only
// once the receiver has posted the matching receive, and the receiver may
// first need a message that this rank sends only after the wait.
//
// smallest_send_cap() decides that from the plans alone. It replays every
// rank's plan under the executor's rules in the pessimistic model of a
// message-passing run: a receive completes once its send is posted, and a
// send completes only once its receive is posted (no eager delivery), and
// the d-th buffered send of a rank waits, at its detach, for send d - cap of
// that rank. The replay is a monotone system (a condition, once true, stays
// true), so whether it completes does not depend on the order in which the
// ranks advance. If it completes, a real run cannot deadlock on the limit:
// when a rank's `cap` buffers are all in flight at its d-th detach, one of the
// cap + 1 sends it may wait for has index at most d - cap, and the replay
// shows that its receive gets posted without this rank going further.
//
// Activation sends need no buffer: a slot retires after its backward, which
// consumed the output gradient that the receiver of the activation sent after
// using it, so the executor waits for them in place.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/vocabulary/schedule.hpp>

namespace weft::pipeline {

/// Replays the order in which Executor::run handles one rank's plan, from the
/// plan alone, for the models that must follow it (the planner's slot count,
/// the send-cap check): before each action the slots whose backward is
/// complete and whose input gradient was sent (at once on virtual stage 0)
/// retire, in the order their backwards ran (`v.retire(microbatch, chunk)`);
/// before a receive, and before a compute up to the compute after it, the
/// plan's receives are posted in plan order (`v.post(index)`); then the
/// action itself (`v.action(index)`). At the end, the slots still retiring
/// (`v.flush(microbatch, chunk)`, in order). p: pipeline ranks (virtual
/// stage of chunk c on `rank` is c * p + rank).
template <class Visitor>
void replay_executor(const std::vector<PipeAction>& plan, std::size_t p, std::size_t rank, Visitor&& v) {
  std::vector<std::size_t> recvs, next_compute(plan.size() + 1, plan.size());
  for (std::size_t k = 0; k < plan.size(); ++k)
    if (plan[k].op == PipeOp::recv_activation || plan[k].op == PipeOp::recv_gradient) recvs.push_back(k);
  for (std::size_t k = plan.size(); k-- > 0;) next_compute[k] = is_compute(plan[k].op) ? k : next_compute[k + 1];
  std::size_t next_post = 0;
  auto post_until = [&](std::size_t limit) {
    for (; next_post < recvs.size() && recvs[next_post] < limit; ++next_post) v.post(recvs[next_post]);
  };
  std::set<std::pair<int, int>> grad_sent;
  std::vector<std::pair<int, int>> retiring;
  for (std::size_t k = 0; k < plan.size(); ++k) {
    for (std::size_t i = 0; i < retiring.size();) {
      const auto key = retiring[i];
      if (std::size_t(key.second) * p + rank == 0 || grad_sent.count(key) != 0) {
        v.retire(key.first, key.second);
        retiring.erase(retiring.begin() + long(i));
      } else {
        ++i;
      }
    }
    const PipeAction& a = plan[k];
    switch (a.op) {
      case PipeOp::recv_activation:
      case PipeOp::recv_gradient: post_until(k + 1); break;
      case PipeOp::send_activation: break;
      case PipeOp::send_gradient: grad_sent.insert({a.microbatch, a.chunk}); break;
      case PipeOp::forward:
      case PipeOp::backward_input:
      case PipeOp::backward:
      case PipeOp::backward_weight: post_until(next_compute[k + 1]); break;
    }
    v.action(k);
    if (a.op == PipeOp::backward || a.op == PipeOp::backward_weight) retiring.push_back({a.microbatch, a.chunk});
  }
  for (const auto& key : retiring) v.flush(key.first, key.second);
}

namespace send_model {

/// One step of a rank's message program in the replay.
struct MessageStep {
  enum Kind : unsigned char { post_recv, post_send, wait_recv, wait_send } kind;
  int src, dst, tag;  ///< the channel (MPI matches its messages in order)
  std::size_t n;      ///< the message's position on its channel
};

/// The message program of pipeline rank `rank` of p running `plan` under the
/// executor's rules (replay_executor), with at most `cap` detached gradient
/// sends and the numbering of messages per channel.
inline std::vector<MessageStep> message_program(const std::vector<PipeAction>& plan, int p, int rank, std::size_t cap) {
  constexpr int act = 0, grad = 1;
  std::map<std::tuple<int, int, int, bool>, std::size_t> count;  // messages so far per channel, sends and receives apart
  std::vector<MessageStep> msg(plan.size());
  for (std::size_t k = 0; k < plan.size(); ++k) {
    const PipeAction& a = plan[k];
    const bool send = a.op == PipeOp::send_activation || a.op == PipeOp::send_gradient;
    const bool recv = a.op == PipeOp::recv_activation || a.op == PipeOp::recv_gradient;
    if (!send && !recv) continue;
    const int tag = (a.op == PipeOp::send_activation || a.op == PipeOp::recv_activation) ? act : grad;
    const int src = send ? rank : a.peer, dst = send ? a.peer : rank;
    const std::size_t n = count[{src, dst, tag, send}]++;
    msg[k] = MessageStep{send ? MessageStep::post_send : MessageStep::wait_recv, src, dst, tag, n};
  }
  struct Program {
    const std::vector<PipeAction>& plan;
    const std::vector<MessageStep>& msg;
    std::size_t cap;
    std::vector<MessageStep> out;
    std::map<std::pair<int, int>, MessageStep> act_send, grad_send;  // per (microbatch, chunk)
    std::vector<MessageStep> detached;
    void wait_send(MessageStep s) {
      s.kind = MessageStep::wait_send;
      out.push_back(s);
    }
    void post(std::size_t k) {
      MessageStep s = msg[k];
      s.kind = MessageStep::post_recv;
      out.push_back(s);
    }
    void action(std::size_t k) {
      const PipeAction& a = plan[k];
      const auto key = std::make_pair(a.microbatch, a.chunk);
      if (a.op == PipeOp::recv_activation || a.op == PipeOp::recv_gradient) out.push_back(msg[k]);
      if (a.op == PipeOp::send_activation) out.push_back(act_send[key] = msg[k]);
      if (a.op == PipeOp::send_gradient) out.push_back(grad_send[key] = msg[k]);
    }
    // The activation send is waited for in place; the gradient send is
    // detached, first waiting for send d - cap when all buffers are in flight.
    void retire(int mb, int c) {
      const auto key = std::make_pair(mb, c);
      if (auto it = act_send.find(key); it != act_send.end()) wait_send(it->second);
      if (auto it = grad_send.find(key); it != grad_send.end()) {
        detached.push_back(it->second);
        if (detached.size() > cap) wait_send(detached[detached.size() - 1 - cap]);
      }
    }
    void flush(int mb, int c) {
      const auto key = std::make_pair(mb, c);
      if (auto it = act_send.find(key); it != act_send.end()) wait_send(it->second);
      if (auto it = grad_send.find(key); it != grad_send.end()) wait_send(it->second);
    }
  } prog{plan, msg, cap, {}, {}, {}, {}};
  replay_executor(plan, std::size_t(p), std::size_t(rank), prog);
  for (const auto& s : prog.detached) prog.wait_send(s);  // the flush waits for every detached send last
  return std::move(prog.out);
}

}  // namespace send_model

/// Whether every rank can finish its plan (`plans[r]` for pipeline rank r)
/// under the executor's rules with at most `cap` detached gradient sends per
/// rank, in the pessimistic model described at the top of this header.
inline bool send_cap_is_deadlock_free(const std::vector<std::vector<PipeAction>>& plans, std::size_t cap) {
  using Step = send_model::MessageStep;
  const int p = int(plans.size());
  std::vector<std::vector<Step>> prog;
  for (int r = 0; r < p; ++r) prog.push_back(send_model::message_program(plans[std::size_t(r)], p, r, cap));
  std::map<std::tuple<int, int, int>, std::size_t> sent, received;  // posted per channel
  std::vector<std::size_t> pc(std::size_t(p), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t r = 0; r < std::size_t(p); ++r) {
      for (; pc[r] < prog[r].size(); ++pc[r]) {
        const Step& s = prog[r][pc[r]];
        const auto ch = std::make_tuple(s.src, s.dst, s.tag);
        if (s.kind == Step::post_send) ++sent[ch];
        else if (s.kind == Step::post_recv) ++received[ch];
        else if (s.kind == Step::wait_recv && sent[ch] <= s.n) break;
        else if (s.kind == Step::wait_send && received[ch] <= s.n) break;
        moved = true;
      }
    }
  }
  for (std::size_t r = 0; r < std::size_t(p); ++r)
    if (pc[r] < prog[r].size()) return false;
  return true;
}

/// Gradient sends of rank `rank`'s plan (an upper bound for any useful cap).
inline std::size_t gradient_sends(const std::vector<PipeAction>& plan) {
  return std::size_t(std::count_if(plan.begin(), plan.end(), [](const PipeAction& a) { return a.op == PipeOp::send_gradient; }));
}

/// The smallest cap of at least `at_least` under which `plans` cannot
/// deadlock. A cap as large as the most gradient sends of a rank never
/// waits, so the search ends there; if even that deadlocks, the plans
/// themselves do, which is an Error.
inline std::size_t smallest_send_cap(const std::vector<std::vector<PipeAction>>& plans, std::size_t at_least = 0) {
  std::size_t most = 0;
  for (const auto& plan : plans) most = std::max(most, gradient_sends(plan));
  for (std::size_t cap = at_least; cap <= std::max(most, at_least); ++cap)
    if (send_cap_is_deadlock_free(plans, cap)) return cap;
  weft::detail::throw_error<Error>("pipeline: the schedule's plans for ", plans.size(),
                                   " ranks deadlock even with every send buffered; the schedule is wrong");
}

/// The executor's default cap: the smallest safe one, but at least one, so
/// that a rank does not wait on its newest gradient send before going on.
inline std::size_t default_send_cap(const std::vector<std::vector<PipeAction>>& plans) {
  return smallest_send_cap(plans, 1);
}

}  // namespace weft::pipeline
