// The serving engine: requests in, generated tokens out, one step at a
// time. Each step asks the scheduler (a pure function of the queues) for a
// plan, applies it -- preempted requests give their KV blocks back, admitted
// ones start, new blocks are allocated -- runs the plan's tokens through the
// ModelRunner in one pass, and samples the next token of every request whose
// chunk reached its last known token. Requests are validated on submission:
// one that cannot be served (empty, too long for the context or the KV pool,
// token ids outside the vocabulary, bad sampling parameters) is rejected
// with a message and the engine keeps serving the others. Under tensor
// parallelism every TP rank submits the same requests and runs the same
// steps; the sampled tokens are broadcast from TP rank 0, so the ranks can
// never disagree on a tie.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <weft/serve/runner.hpp>
#include <weft/serve/sampler.hpp>
#include <weft/serve/scheduler.hpp>

namespace weft::serve {

/// A generation request.
struct Request {
  std::vector<int> prompt;          ///< prompt token ids (at least one)
  std::size_t max_new_tokens = 16;  ///< tokens to generate (at least one)
  SamplingParams sampling{};        ///< greedy by default
  int eos = -1;                     ///< a token that ends the request early (-1: none)
};

/// The answer to a submission: an id, or the reason the request was rejected.
struct Submission {
  bool accepted = false;   ///< whether the request was queued
  std::uint64_t id = 0;    ///< its id (when accepted)
  std::string error;       ///< why not (when rejected)
};

/// A finished request.
struct Completion {
  std::uint64_t id = 0;             ///< the request
  std::vector<int> tokens;          ///< the generated tokens
  std::size_t preemptions = 0;      ///< times its KV blocks were taken back and it was recomputed
  double submitted = 0;             ///< seconds (engine clock) at submission
  std::vector<double> token_times;  ///< seconds at which each token was produced
};

/// What one step did.
struct StepStats {
  std::size_t tokens = 0;         ///< tokens through the model
  std::size_t sequences = 0;      ///< sequences in the pass
  std::size_t sampled = 0;        ///< tokens generated
  std::size_t preempted = 0;      ///< sequences preempted
  std::size_t blocks_used = 0;    ///< KV blocks held after the step
  std::size_t running = 0;        ///< sequences holding blocks after the step
  std::size_t waiting = 0;        ///< sequences waiting after the step
};

/// Sizes and policy of an engine.
struct EngineConfig {
  std::size_t block_size = 16;    ///< tokens per KV block
  std::size_t blocks = 64;        ///< KV blocks in the pool
  std::size_t token_budget = 256; ///< tokens per step
  std::size_t max_seqs = 16;      ///< sequences per step
  Batching batching = Batching::continuous;  ///< how requests join a batch
};

/// A serving engine over an nn::GPTModel's weights (see the file comment).
/// Prec, a weft::Precision, is the runner's (ModelRunner): Precision<> serves
/// the model's own weights, Precision<BF16> a bf16 copy with a bf16 KV cache.
template <class T, class Space = Kokkos::DefaultExecutionSpace, class LayerPolicy = NoPolicy,
          class Prec = Precision<>>
class Engine {
 public:
  /// The model type.
  using Model = nn::GPTModel<T, Space, LayerPolicy>;

  /// An engine over `model` (kept by reference). Throws ConfigError for zero sizes.
  Engine(Model& model, const EngineConfig& c)
      : cfg_(c),
        runner_(model, c.blocks, c.block_size, c.token_budget, c.max_seqs),
        pool_(c.blocks),
        tp_(model.tensor_parallel()),
        start_(std::chrono::steady_clock::now()) {
    WEFT_REQUIRE(c.block_size > 0 && c.blocks > 0 && c.token_budget > 0 && c.max_seqs > 0, ConfigError,
                 "serve::Engine: block size, blocks, token budget and max sequences must be positive");
  }

  /// Validates and queues r. A request that cannot be served is rejected
  /// with the reason, and nothing else changes.
  Submission submit(Request r) {
    const auto& m = runner_.config();
    Submission s;
    auto reject = [&](std::string why) {
      s.error = std::move(why);
      ++rejected_;
      return s;
    };
    if (r.prompt.empty()) return reject("the prompt has no tokens; give at least one");
    if (r.max_new_tokens == 0) return reject("max_new_tokens is 0; ask for at least one token");
    for (std::size_t i = 0; i < r.prompt.size(); ++i)
      if (r.prompt[i] < 0 || std::size_t(r.prompt[i]) >= m.vocab)
        return reject("prompt token " + std::to_string(i) + " is " + std::to_string(r.prompt[i]) +
                      ", outside the vocabulary [0, " + std::to_string(m.vocab) + ")");
    const std::size_t total = r.prompt.size() + r.max_new_tokens;
    if (total > m.seq)
      return reject("the prompt's " + std::to_string(r.prompt.size()) + " tokens + " + std::to_string(r.max_new_tokens) +
                    " new tokens exceed the context of " + std::to_string(m.seq) + " tokens");
    // The last generated token's keys and values are never needed: total - 1 tokens are cached at most.
    if (blocks_for(total - 1, cfg_.block_size) > pool_.total())
      return reject("the request needs " + std::to_string(blocks_for(total - 1, cfg_.block_size)) +
                    " KV blocks but the pool has " + std::to_string(pool_.total()));
    if (!(r.sampling.temperature >= 0)) return reject("temperature must be 0 (greedy) or positive");
    s.accepted = true;
    s.id = next_id_++;
    Seq q;
    q.id = s.id;
    q.tokens = r.prompt;
    q.prompt = r.prompt.size();
    q.req = std::move(r);
    q.done.id = s.id;
    q.done.submitted = now();
    waiting_.push_back(std::move(q));
    return s;
  }

  /// Whether nothing is running or waiting.
  bool idle() const { return running_.empty() && waiting_.empty(); }

  /// One iteration: plan, apply, run, sample. Does nothing when idle.
  StepStats step() {
    StepStats st;
    if (idle()) return st;
    QueueState qs;
    for (const auto& s : running_) qs.running.push_back(state(s));
    for (const auto& s : waiting_) qs.waiting.push_back(state(s));
    qs.free_blocks = pool_.free();
    const StepLimits lim{cfg_.token_budget, cfg_.max_seqs, cfg_.block_size, cfg_.batching};
    const StepPlan plan = schedule(qs, lim);
    for (std::uint64_t id : plan.preempted) {
      auto it = find(running_, id);
      pool_.release(it->table);
      it->computed = 0;
      ++it->done.preemptions;
      ++preemptions_;
      waiting_.push_back(std::move(*it));
      running_.erase(it);
    }
    for (std::uint64_t id : plan.admitted) {
      auto it = find(waiting_, id);
      running_.push_back(std::move(*it));
      waiting_.erase(it);
    }
    by_id(running_);
    by_id(waiting_);
    StepBatch b;
    std::vector<Seq*> sampled;
    for (const ScheduledSeq& e : plan.batch) {
      Seq& s = *find(running_, e.id);
      pool_.allocate(e.new_blocks, s.table);
      b.add(s.tokens, e.first, e.count, s.table, e.samples);
      s.computed += e.count;
      if (e.samples) sampled.push_back(&s);
    }
    st.tokens = b.tokens.size();
    st.sequences = plan.batch.size();
    st.preempted = plan.preempted.size();
    if (!b.tokens.empty()) {
      const auto logits = runner_.forward(b);
      std::vector<int> next(sampled.size());
      for (std::size_t i = 0; i < sampled.size(); ++i) {
        Seq& s = *sampled[i];
        // The stream is the request's seed alone (not its id here), so a request samples the same tokens on any engine.
        next[i] = sample_token(&logits(i, 0), logits.extent(1), s.req.sampling, 0, s.tokens.size() - s.prompt);
      }
      if (tp_.active() && !next.empty()) {
        Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(next.data(), next.size());
        tp_.comm->broadcast(v, 0);
      }
      const double t = now();
      for (std::size_t i = 0; i < sampled.size(); ++i) {
        Seq& s = *sampled[i];
        s.tokens.push_back(next[i]);
        s.done.token_times.push_back(t);
      }
      st.sampled = sampled.size();
      generated_ += sampled.size();
    }
    // Requests that are done give their blocks back.
    for (auto it = running_.begin(); it != running_.end();) {
      const std::size_t gen = it->tokens.size() - it->prompt;
      if (gen > 0 && (gen == it->req.max_new_tokens || it->tokens.back() == it->req.eos)) {
        pool_.release(it->table);
        it->done.tokens.assign(it->tokens.begin() + long(it->prompt), it->tokens.end());
        finished_.push_back(std::move(it->done));
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
    st.blocks_used = pool_.used();
    st.running = running_.size();
    st.waiting = waiting_.size();
    ++steps_;
    return st;
  }

  /// Steps until idle; returns the number of steps.
  std::size_t run_until_idle() {
    std::size_t n = 0;
    while (!idle()) {
      step();
      ++n;
    }
    return n;
  }

  /// Takes the requests finished so far (in the order they finished).
  std::vector<Completion> take_finished() {
    std::vector<Completion> out;
    out.swap(finished_);
    return out;
  }

  /// The runner (its cache, its memory).
  const ModelRunner<T, Space, LayerPolicy, Prec>& runner() const { return runner_; }
  /// The KV block pool.
  const BlockAllocator& pool() const { return pool_; }
  /// Seconds since the engine was built (the clock of Completion's times).
  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  /// Steps run so far.
  std::size_t steps() const { return steps_; }
  /// Preemptions so far.
  std::size_t preemptions() const { return preemptions_; }
  /// Requests rejected so far.
  std::size_t rejected() const { return rejected_; }
  /// Tokens generated so far.
  std::size_t generated() const { return generated_; }

 private:
  struct Seq {
    std::uint64_t id = 0;
    Request req;
    std::vector<int> tokens;  // prompt, then the generated tokens
    std::size_t prompt = 0;
    std::size_t computed = 0;
    std::vector<int> table;
    Completion done;
  };
  SeqState state(const Seq& s) const { return {s.id, s.tokens.size(), s.computed, s.table.size()}; }
  static typename std::vector<Seq>::iterator find(std::vector<Seq>& v, std::uint64_t id) {
    auto it = std::find_if(v.begin(), v.end(), [&](const Seq& s) { return s.id == id; });
    WEFT_REQUIRE(it != v.end(), Error, "serve::Engine: the plan names request ", id, ", which is not in its queue");
    return it;
  }
  static void by_id(std::vector<Seq>& v) {
    std::sort(v.begin(), v.end(), [](const Seq& a, const Seq& b) { return a.id < b.id; });
  }

  EngineConfig cfg_;
  ModelRunner<T, Space, LayerPolicy, Prec> runner_;
  BlockAllocator pool_;
  nn::TensorSplit tp_;
  std::chrono::steady_clock::time_point start_;
  std::vector<Seq> running_, waiting_;
  std::vector<Completion> finished_;
  std::uint64_t next_id_ = 0;
  std::size_t steps_ = 0, preemptions_ = 0, rejected_ = 0, generated_ = 0;
};

}  // namespace weft::serve
