// serve_gpt: serves the reference GPT -- initialised from --seed as
// train_gpt initialises it, or loaded from a train_gpt --checkpoint -- under
// a traffic model: Poisson arrivals at --rate requests per second, or a
// closed loop of --concurrency clients that each send the next request when
// their last one ends. Prompt and output lengths are drawn from the
// --prompt-len and --output-len ranges, uniformly or with a long tail
// (--prompt-dist, --output-dist: exponential or log-normal; prompt tokens uniformly from the
// vocabulary, all from --seed), or the prompts are a user's file (--prompts
// FILE: one request per line, token ids or bytes; the format in
// docs/serving.md). It prints the latency and throughput summary, and with
// --record FILE writes a JSON record (every request's prompt under "prompts"
// and its generated tokens under "outputs"; fields in docs/serving.md,
// schema in docs/schema/serve_record.schema.json). --baseline FILE compares
// every request's tokens with another run's record and fails on the first
// difference.
//
//   mpirun -n 1 serve_gpt --layers 2 --d-model 64 --heads 4 --seq 128 --requests 32 --rate 20 --record serve.json
//   mpirun -n 2 serve_gpt --mesh tp=2 --requests 32 --concurrency 8 --record serve.json
//
// --mesh dp=A,tp=B runs A independent replicas of B tensor-parallel ranks
// each; request i goes to replica i mod A (each replica has its own traffic
// clock), and the record gathers every replica's requests.
//
// --precision bf16 serves a bf16 copy of the weights with a bf16 KV cache
// (weft::Precision<weft::BF16>, computing in float); fp32 (the default) the
// float weights as they are.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <weft/config.hpp>
#include <weft/checkpoint/checkpoint.hpp>
#include <weft/comm/environment.hpp>
#include <weft/metrics/json.hpp>
#include <weft/metrics/counters.hpp>
#include <weft/comm/node.hpp>
#include <weft/core/flags.hpp>
#include <weft/core/measure.hpp>
#include <weft/core/parse.hpp>
#include <weft/ops/blas_threads.hpp>
#include <weft/parity.hpp>
#include <weft/plan/json_read.hpp>
#include <weft/serve/serve.hpp>

#include "record_identity.hpp"

namespace {

using weft::ConfigError;
using Json = weft::metrics::Json;
using Model = weft::nn::GPT<float, weft::Strategy<weft::On<weft::TP, weft::TensorParallel<>>>>;
using Engine = weft::serve::Engine<float, Kokkos::DefaultExecutionSpace, weft::TensorParallel<>>;
using EngineBF16 =
    weft::serve::Engine<float, Kokkos::DefaultExecutionSpace, weft::TensorParallel<>, weft::Precision<weft::BF16>>;

// The engine of --precision: the run-time flag picks one of the two
// compiled engine types here, at the edge, and the serving loop below talks
// to this alone.
class Server {
 public:
  Server(Model& model, const weft::serve::EngineConfig& ec, bool bf16) {
    if (bf16)
      b_ = std::make_unique<EngineBF16>(model, ec);
    else
      f_ = std::make_unique<Engine>(model, ec);
  }
  weft::serve::Submission submit(weft::serve::Request r) { return f_ ? f_->submit(std::move(r)) : b_->submit(std::move(r)); }
  bool idle() const { return f_ ? f_->idle() : b_->idle(); }
  weft::serve::StepStats step() { return f_ ? f_->step() : b_->step(); }
  std::vector<weft::serve::Completion> take_finished() { return f_ ? f_->take_finished() : b_->take_finished(); }
  double now() const { return f_ ? f_->now() : b_->now(); }
  std::size_t preemptions() const { return f_ ? f_->preemptions() : b_->preemptions(); }
  weft::serve::ServeMemory memory() const { return f_ ? f_->runner().memory() : b_->runner().memory(); }

 private:
  std::unique_ptr<Engine> f_;
  std::unique_ptr<EngineBF16> b_;
};

const char* kUsage =
    "usage: serve_gpt [flags]\n"
    "Model (train_gpt's flags; with --checkpoint they must be the checkpoint's):\n"
    "  --layers N --d-model N --heads N --kv-heads N --seq N (the context) --vocab N --seed N\n"
    "  --norm layernorm|rmsnorm --mlp gelu|swiglu --pos learned|rotary\n"
    "  --experts N --moe-top-k K --router softmax|sigmoid --moe-every K --shared-experts N --expert-hidden N\n"
    "                    mixture-of-experts blocks (train_gpt's --top-k is --moe-top-k here: --top-k samples);\n"
    "                    served dropless: every token goes to its top K experts, whatever its batch\n"
    "  --checkpoint DIR  load the weights from a train_gpt checkpoint (a root: its latest complete one)\n"
    "  --precision fp32|bf16  weights and KV cache as served (default fp32); bf16: a bf16 copy of the weights,\n"
    "                    rounded once, and a bf16 KV cache, computing in float\n"
    "Mesh:\n"
    "  --mesh tp=N[,dp=M]  tensor-parallel ranks per replica, independent replicas (default tp=world)\n"
    "Traffic:\n"
    "  --requests N        requests in all (default 32)\n"
    "  --prompts FILE      the prompts from FILE, one request per line, instead of drawn: token ids separated by\n"
    "                      spaces, or 'bytes:' and text (each byte after the colon is one token); blank lines and\n"
    "                      lines starting with # are skipped. Replaces --requests and the --prompt-* flags\n"
    "  --rate R            Poisson arrivals at R requests per second\n"
    "  --concurrency C     closed loop: C clients, each sends its next request when its last ends (default 4)\n"
    "  --prompt-len A[-B]  prompt tokens, in [A, B] (default 8-32)\n"
    "  --output-len A[-B]  tokens to generate, in [A, B] (default 8-32)\n"
    "  --prompt-dist uniform|exponential|lognormal, --output-dist (the same)\n"
    "                      the lengths' shape in their range (default uniform); exponential, lognormal: the low\n"
    "                      end plus a random excess, cut at the high end (most short, a few long)\n"
    "  --prompt-scale S, --output-scale S  the excess' mean (exponential; default a quarter of the range)\n"
    "                      or median (lognormal; default an eighth of the range)\n"
    "  --prompt-sigma G, --output-sigma G  lognormal: deviation of the excess' logarithm (default 1)\n"
    "  --temperature T --top-k K  sampling (default greedy); each request samples from its own seed\n"
    "Engine:\n"
    "  --block-size N      tokens per KV block (default 16)\n"
    "  --kv-blocks N       KV blocks per rank (default: max-seqs x seq / block-size)\n"
    "  --token-budget N    tokens per step (default: --seq)\n"
    "  --max-seqs N        sequences per step (default 16)\n"
    "  --batching continuous|static (default continuous)\n"
    "Output:\n"
    "  --record FILE       write the JSON record\n"
    "  --baseline FILE     output parity: fail unless every request's prompt and tokens are FILE's (a --record of\n"
    "                      another run of the same requests)\n"
    "  --help              this text\n"
    "Exit status: 0 done (rejected requests are reported, not fatal); 2 a bad flag or input; 3 the outputs differ\n"
    "from --baseline's.\n";

// A count flag: an integer from 1 (0 with allow_zero) to `max` (2^40 by
// default: no product of counts overflows), parsed strictly
// (weft::parse_integer: a value beyond the range is refused, never wrapped).
std::size_t parse_count(const std::string& flag, const std::string& v, bool allow_zero = false,
                        std::size_t max = std::size_t(1) << 40) {
  return weft::parse_integer<std::size_t>(flag, v, allow_zero ? 0 : 1, max);
}

struct Range {
  std::size_t lo = 8, hi = 32;
};
Range parse_range(const std::string& flag, const std::string& v) {
  const auto dash = v.find('-');
  Range r;
  r.lo = parse_count(flag, v.substr(0, dash), true);
  r.hi = dash == std::string::npos ? r.lo : parse_count(flag, v.substr(dash + 1), true);
  WEFT_REQUIRE(r.lo <= r.hi, ConfigError, flag, " ", v, ": the range's low end exceeds its high end");
  return r;
}

using weft::parse_choice;

struct Options {
  weft::nn::GPTConfig model;
  std::string checkpoint, record;
  std::string prompts;   ///< --prompts: the requests' prompts from this file instead of drawn
  std::string baseline;  ///< --baseline: a serve_gpt record whose outputs this run's must equal
  int tp = 0, dp = 1;
  std::size_t requests = 32, concurrency = 4, kv_blocks = 0;
  double rate = 0;
  Range prompt{8, 32}, output{8, 32};
  weft::serve::LengthShape prompt_shape = weft::serve::LengthShape::uniform, output_shape = weft::serve::LengthShape::uniform;
  double prompt_scale = 0, output_scale = 0, prompt_sigma = 1.0, output_sigma = 1.0;
  /// The prompts' and outputs' length distributions.
  weft::serve::LengthDist prompt_dist() const { return {prompt.lo, prompt.hi, prompt_shape, prompt_scale, prompt_sigma}; }
  weft::serve::LengthDist output_dist() const { return {output.lo, output.hi, output_shape, output_scale, output_sigma}; }
  double temperature = 0;
  std::size_t top_k = 0;
  weft::serve::EngineConfig engine;
  bool bf16 = false;  ///< --precision bf16
  /// The element widths the planner counts for --precision.
  weft::serve::ServeBytes bytes() const {
    return bf16 ? weft::serve::serve_bytes<float, weft::Precision<weft::BF16>>() : weft::serve::serve_bytes<float>();
  }
};

Options parse(int argc, char** argv) {
  Options o;
  o.model.layers = 2;
  o.model.d_model = 64;
  o.model.heads = 4;
  o.model.seq = 128;
  o.model.batch = 1;
  o.engine.block_size = 16;
  o.engine.token_budget = 0;  // --seq unless given
  o.engine.max_seqs = 16;
  using weft::RealSign;
  weft::FlagParser flags("serve_gpt");
  flags.usage_text(kUsage)
      .count("--layers", "N", "blocks", o.model.layers)
      .count("--d-model", "N", "model width", o.model.d_model)
      .count("--heads", "N", "attention heads", o.model.heads)
      .count("--kv-heads", "N", "key/value heads", o.model.kv_heads)
      .count("--seq", "N", "the context", o.model.seq)
      .count("--vocab", "N", "vocabulary", o.model.vocab)
      .count("--seed", "N", "seed", o.model.seed, 0)
      .choice<weft::nn::NormKind>("--norm", "normalization", o.model.norm,
                                  {{"layernorm", weft::nn::NormKind::layernorm}, {"rmsnorm", weft::nn::NormKind::rmsnorm}})
      .choice<weft::nn::MlpKind>("--mlp", "MLP", o.model.mlp, {{"gelu", weft::nn::MlpKind::gelu}, {"swiglu", weft::nn::MlpKind::swiglu}})
      .choice<weft::nn::PositionKind>("--pos", "positions", o.model.position,
                                      {{"learned", weft::nn::PositionKind::learned}, {"rotary", weft::nn::PositionKind::rotary}})
      .count("--experts", "N", "experts per MoE block", o.model.experts)
      .count("--moe-top-k", "K", "experts per token", o.model.top_k)
      .choice<weft::nn::RouterKind>("--router", "router", o.model.router,
                                    {{"softmax", weft::nn::RouterKind::softmax}, {"sigmoid", weft::nn::RouterKind::sigmoid}})
      .count("--moe-every", "K", "every K-th block is MoE", o.model.moe_every)
      .count("--shared-experts", "N", "shared experts", o.model.shared_experts, 0)
      .count("--expert-hidden", "N", "expert hidden width", o.model.expert_hidden)
      .text("--checkpoint", "DIR", "weights", o.checkpoint)
      .text("--record", "FILE", "JSON record", o.record)
      .text("--prompts", "FILE", "prompts", o.prompts)
      .text("--baseline", "FILE", "output parity", o.baseline)
      .value("--mesh", "tp=N[,dp=M]", "the mesh",
             [&](const std::string& v) {
               // Every axis name is known, so that pp=1 and the like are accepted; only tp and dp may exceed 1.
               const weft::AxisSizes m = weft::parse_mesh_spec("--mesh", v, {"tp", "dp", "pp", "cp", "ep"});
               for (const auto& [axis, n] : m) {
                 if (axis == "tp") o.tp = n;
                 else if (axis == "dp") o.dp = n;
                 else
                   WEFT_REQUIRE(n == 1, ConfigError, "--mesh ", v, ": ", axis, "=", n,
                                " is not available in serve_gpt (tensor parallelism and independent dp replicas only); use ",
                                axis, "=1 or leave it out");
               }
             })
      .count("--requests", "N", "requests in all", o.requests)
      .real("--rate", "R", "Poisson arrivals per second", o.rate, RealSign::positive)
      .count("--concurrency", "C", "closed-loop clients", o.concurrency)
      .value("--prompt-len", "A[-B]", "prompt tokens", [&](const std::string& v) { o.prompt = parse_range("--prompt-len", v); })
      .value("--output-len", "A[-B]", "tokens to generate", [&](const std::string& v) { o.output = parse_range("--output-len", v); })
      .value("--prompt-dist", "D", "prompt lengths' shape",
             [&](const std::string& v) { o.prompt_shape = weft::serve::parse_length_shape("--prompt-dist", v); })
      .value("--output-dist", "D", "output lengths' shape",
             [&](const std::string& v) { o.output_shape = weft::serve::parse_length_shape("--output-dist", v); })
      .real("--prompt-scale", "S", "prompt lengths' scale", o.prompt_scale)
      .real("--output-scale", "S", "output lengths' scale", o.output_scale)
      .real("--prompt-sigma", "G", "prompt lengths' sigma", o.prompt_sigma, RealSign::positive)
      .real("--output-sigma", "G", "output lengths' sigma", o.output_sigma, RealSign::positive)
      .real("--temperature", "T", "sampling temperature", o.temperature)
      .count("--top-k", "K", "sampling top-k", o.top_k, 0)
      .count("--block-size", "N", "tokens per KV block", o.engine.block_size)
      .count("--kv-blocks", "N", "KV blocks per rank", o.kv_blocks)
      .count("--token-budget", "N", "tokens per step", o.engine.token_budget)
      .count("--max-seqs", "N", "sequences per step", o.engine.max_seqs)
      .choice<bool>("--precision", "weights and KV cache", o.bf16, {{"fp32", false}, {"bf16", true}})
      .choice<weft::serve::Batching>(
          "--batching", "batching", o.engine.batching,
          {{"continuous", weft::serve::Batching::continuous}, {"static", weft::serve::Batching::static_batch}});
  flags.parse(argc, argv);  // run() answers --help before
  const bool rate = flags.given("--rate"), conc = flags.given("--concurrency");
  const auto seen = [&](const char* f) { return flags.given(f); };
  WEFT_REQUIRE(!(rate && conc), ConfigError, "--rate and --concurrency both given; choose Poisson arrivals (--rate) or a "
               "closed loop (--concurrency)");
  if (!rate && !conc) o.concurrency = 4;
  WEFT_REQUIRE(!seen("--prompts") || !o.prompts.empty(), ConfigError,
               "--prompts is given an empty file name; give the path of a prompts file");
  WEFT_REQUIRE(!seen("--baseline") || !o.baseline.empty(), ConfigError,
               "--baseline is given an empty file name; give the path of a serve_gpt record");
  // The file's lines are the requests: a flag that would draw them is refused, not ignored.
  if (!o.prompts.empty()) {
    WEFT_REQUIRE(!seen("--requests"), ConfigError, "--requests and --prompts both given: with --prompts every line "
                 "of ", o.prompts, " is one request; leave --requests out (or add or remove lines)");
    for (const char* f : {"--prompt-len", "--prompt-dist", "--prompt-scale", "--prompt-sigma"})
      WEFT_REQUIRE(!seen(f), ConfigError, f, " shapes drawn prompts, but --prompts ", o.prompts,
                   " gives them; leave ", f, " out");
  }
  if (o.model.experts == 0)
    for (const char* f : {"--moe-top-k", "--router", "--moe-every", "--shared-experts", "--expert-hidden"})
      WEFT_REQUIRE(!seen(f), ConfigError, f, " configures mixture-of-experts blocks, but --experts is not given; add --experts N");
  o.model.batch = 1;
  o.model.validate();
  WEFT_REQUIRE(o.prompt.lo > 0, ConfigError, "--prompt-len ", o.prompt.lo, ": prompts need at least one token");
  WEFT_REQUIRE(o.output.lo > 0, ConfigError, "--output-len ", o.output.lo, ": requests generate at least one token");
  if (o.engine.token_budget == 0) o.engine.token_budget = o.model.seq;
  o.engine.blocks = o.kv_blocks ? o.kv_blocks : weft::serve::blocks_for(o.engine.max_seqs * o.model.seq, o.engine.block_size);
  return o;
}

// Uniform 64-bit draws from (seed, stream, index): the traffic is the same on every rank and every run.
std::uint64_t draw(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const weft::ops::Philox p(seed, stream, index);
  return (std::uint64_t(p.x[0]) << 32) | p.x[1];
}

struct Traffic {
  std::vector<weft::serve::Request> requests;
  std::vector<double> arrival;  // seconds after the start (Poisson), 0 for the closed loop
};

// The requests: prompts drawn, or `given` (--prompts; then o.requests is
// their number). Output lengths, sampling seeds and arrivals are drawn the
// same way in both cases, so a file holding the drawn prompts gives the
// drawn run's requests.
Traffic traffic(const Options& o, const std::vector<std::vector<int>>& given) {
  Traffic t;
  const std::uint64_t seed = o.model.seed ^ 0x5e7e5e7eull;
  double clock = 0;
  for (std::size_t i = 0; i < o.requests; ++i) {
    weft::serve::Request r;
    r.max_new_tokens = o.output_dist().draw(draw(seed, 2, i));
    if (o.prompts.empty()) {
      const std::size_t np = o.prompt_dist().draw(draw(seed, 1, i));
      for (std::size_t k = 0; k < np; ++k) r.prompt.push_back(int(draw(seed, 3 + i, k) % o.model.vocab));
    } else {
      r.prompt = given.at(i);
    }
    r.sampling = {o.temperature, o.top_k, seed + i};
    if (o.rate > 0) clock += -std::log(weft::ops::Philox(seed, 4, i).uniform()) / o.rate;
    t.arrival.push_back(o.rate > 0 ? clock : 0.0);
    t.requests.push_back(std::move(r));
  }
  return t;
}

// A user's file, the same on every rank: world rank 0 reads it and
// broadcasts its bytes (ranks need not share a file system, and no rank can
// see another version of it); a failure to read is broadcast too, so every
// rank raises the same error and none is left waiting.
std::string read_shared(MPI_Comm world, const std::string& flag, const std::string& path, const std::string& expected) {
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  std::string text, why;
  if (rank == 0) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) why = std::strerror(errno);
    for (char buf[65536]; fd >= 0;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) why = std::strerror(errno);
      if (n <= 0) break;
      text.append(buf, std::size_t(n));
      if (text.size() > (std::size_t(1) << 30)) {
        why = "larger than 1 GiB";
        break;
      }
    }
    if (fd >= 0) ::close(fd);
    if (!why.empty()) text.clear();  // only the reason travels
  }
  long long n[2] = {static_cast<long long>(text.size()), static_cast<long long>(why.size())};
  MPI_Bcast(n, 2, MPI_LONG_LONG, 0, world);
  text.resize(std::size_t(n[0]));
  why.resize(std::size_t(n[1]));
  MPI_Bcast(text.data(), int(n[0]), MPI_CHAR, 0, world);
  MPI_Bcast(why.data(), int(n[1]), MPI_CHAR, 0, world);
  WEFT_REQUIRE(why.empty(), ConfigError, flag, " ", path, ": cannot read the file (", why, "); give the path of ", expected);
  return text;
}

// The --prompts format (docs/serving.md): one request per line ('\n', a
// '\r' before it dropped); a line that is blank or whose first non-blank
// character is '#' is skipped. A line starting with "bytes:" is text: every
// byte after the colon, to the end of the line, is one token (its value,
// 0-255). Any other line is token ids: decimal integers separated by spaces
// or tabs. Every token must lie in [0, vocab), and a prompt must leave room
// in the context for one new token. Errors name the line (1-based).
std::vector<std::vector<int>> parse_prompts(const std::string& text, const std::string& path,
                                            const weft::nn::GPTConfig& m) {
  std::vector<std::vector<int>> out;
  const std::string where = "--prompts " + path + " line ";
  std::size_t start = 0, line = 0;
  while (start < text.size()) {
    ++line;
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string s = text.substr(start, end - start);
    start = end + 1;
    if (!s.empty() && s.back() == '\r') s.pop_back();
    const std::size_t first = s.find_first_not_of(" \t");
    if (first == std::string::npos || s[first] == '#') continue;
    std::vector<int> p;
    if (s.rfind("bytes:", 0) == 0) {
      for (std::size_t k = 6; k < s.size(); ++k) {
        const unsigned v = static_cast<unsigned char>(s[k]);
        WEFT_REQUIRE(v < m.vocab, ConfigError, where, line, ": byte ", v, " (column ", k + 1,
                     ") is outside the vocabulary [0, ", m.vocab, "); a bytes: prompt of any text needs --vocab 256 "
                     "or more, or write the line as token ids below ", m.vocab);
        p.push_back(int(v));
      }
      WEFT_REQUIRE(!p.empty(), ConfigError, where, line, ": 'bytes:' with nothing after it; a prompt needs at least "
                   "one token (write the text right after the colon)");
    } else {
      for (std::size_t k = first; k < s.size();) {
        const std::size_t e = std::min(s.find_first_of(" \t", k), s.size());
        const std::string word = s.substr(k, e - k);
        k = std::min(s.find_first_not_of(" \t", e), s.size());
        const auto d = weft::detail::parse_decimal(word);
        WEFT_REQUIRE(d.has_value(), ConfigError, where, line, ": '", word, "' is not a token id; write token ids as "
                     "decimal integers in [0, ", m.vocab, ") separated by spaces, or start the line with bytes: for text");
        WEFT_REQUIRE(!d->negative || d->magnitude == 0, ConfigError, where, line, ": token id ", word,
                     " is negative; token ids count from 0: give ids in [0, ", m.vocab, ")");
        WEFT_REQUIRE(!d->overflow && d->magnitude < m.vocab, ConfigError, where, line, ": token id ", word,
                     " is outside the vocabulary [0, ", m.vocab, "); give ids below ", m.vocab,
                     " or serve a model with a larger --vocab");
        p.push_back(int(d->magnitude));
      }
    }
    WEFT_REQUIRE(p.size() < m.seq, ConfigError, where, line, ": the prompt has ", p.size(), " tokens, but the context (--seq) is ",
                 m.seq, " and must keep room for at least one new token; shorten the prompt to at most ", m.seq - 1,
                 " tokens or serve a model with a longer --seq");
    out.push_back(std::move(p));
  }
  WEFT_REQUIRE(!out.empty(), ConfigError, "--prompts ", path, " holds no prompts (",
               text.empty() ? "the file is empty" : "only blank and # lines",
               "); write one prompt per line: token ids separated by spaces, or bytes: and text");
  return out;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double x = p / 100.0 * double(v.size() - 1);
  const std::size_t i = std::size_t(x);
  return i + 1 < v.size() ? v[i] + (x - double(i)) * (v[i + 1] - v[i]) : v.back();
}

// Where each rank's n elements land in a gather onto rank 0 of comm: the
// counts and offsets MPI_Gatherv takes on the root, and the total.
struct GatherLayout {
  std::vector<int> counts, displs;
  int total = 0;
};
GatherLayout gather_layout(MPI_Comm comm, int n) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  GatherLayout g;
  g.counts.resize(static_cast<std::size_t>(size));
  g.displs.resize(static_cast<std::size_t>(size));
  MPI_Gather(&n, 1, MPI_INT, g.counts.data(), 1, MPI_INT, 0, comm);
  for (int r = 0; r < size; ++r) {
    g.displs[std::size_t(r)] = g.total;
    g.total += g.counts[std::size_t(r)];
  }
  return g;
}

// Gathers every rank's vector of doubles onto world rank 0 (concatenated in rank order).
std::vector<double> gather(MPI_Comm comm, const std::vector<double>& mine) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const GatherLayout g = gather_layout(comm, int(mine.size()));
  std::vector<double> all(rank == 0 ? std::size_t(g.total) : 0);
  MPI_Gatherv(mine.data(), int(mine.size()), MPI_DOUBLE, all.data(), g.counts.data(), g.displs.data(), MPI_DOUBLE, 0,
              comm);
  return all;
}

// Gathers every rank's text onto world rank 0 (concatenated in rank order; empty elsewhere).
std::string gather_text(MPI_Comm comm, const std::string& mine) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const GatherLayout g = gather_layout(comm, int(mine.size()));
  std::string all(rank == 0 ? std::size_t(g.total) : 0, '\0');
  MPI_Gatherv(mine.data(), int(mine.size()), MPI_CHAR, all.data(), g.counts.data(), g.displs.data(), MPI_CHAR, 0, comm);
  return all;
}

int run(int argc, char** argv, weft::Environment& env) {
  if (weft::FlagParser::help_requested(argc, argv)) {  // wherever it stands, before any flag is checked
    if (env.world().rank() == 0) std::fputs(kUsage, stdout);
    return 0;
  }
  Options o = parse(argc, argv);
  const int world = env.world().size();
  // The environment as strictly as the flags (WEFT_DEADLINE=5s is 5 s; a value that is no duration is refused).
  WEFT_REQUIRE(weft::detail::checked_defaults().env_error.empty(), ConfigError,
               weft::detail::checked_defaults().env_error, "; fix the variable or unset it");
  // An axis larger than the world is refused as such (and tp x dp cannot overflow).
  WEFT_REQUIRE(o.tp <= world && o.dp <= world, ConfigError, "--mesh tp=", o.tp, ",dp=", o.dp, " needs ",
               static_cast<long long>(std::max(o.tp, 1)) * o.dp, " ranks but the job has ", world,
               " (an axis is larger than the job); launch more ranks or give smaller axes");
  // The user's files before any work, and the same on every rank: the
  // prompts (--prompts) and the baseline (--baseline), read on world rank 0
  // and broadcast; every rank parses them and so raises the same error.
  std::vector<std::vector<int>> given;
  if (!o.prompts.empty()) {
    given = parse_prompts(read_shared(env.world().native(), "--prompts", o.prompts,
                                      "a prompts file (one prompt per line; docs/serving.md)"),
                          o.prompts, o.model);
    o.requests = given.size();
  }
  const Traffic all = traffic(o, given);
  weft::TokenRecord base;
  if (!o.baseline.empty()) {
    base = weft::TokenRecord::parse(read_shared(env.world().native(), "--baseline", o.baseline, "a serve_gpt --record file"),
                                    o.baseline);
    std::vector<std::vector<int>> prompts;
    for (const auto& q : all.requests) prompts.push_back(q.prompt);
    base.check_prompts(prompts);
  }
  // The record's directory before the first request, not after the last.
  if (!o.record.empty()) {
    weft::check_output_file("--record", o.record);
    // Nothing the user gave is overwritten: not a file of the checkpoint served
    // (--checkpoint names a root or one checkpoint; by device and inode).
    std::string served;
    if (!o.checkpoint.empty()) try {
        served = weft::checkpoint::resolve(o.checkpoint);
      } catch (const weft::IoError&) {  // no checkpoint there: the load names it
      }
    weft::check_outputs_not_inputs({{"--record", o.record}}, {{"--prompts", o.prompts}, {"--baseline", o.baseline}});
    std::error_code ec;
    if (!served.empty())
      for (const auto& e : std::filesystem::directory_iterator(served, ec))
        WEFT_REQUIRE(!weft::same_file(o.record, e.path().string()), ConfigError, "--record ", o.record,
                     " is the same file as ", e.path().string(), " of the checkpoint served (--checkpoint ", o.checkpoint,
                     "); writing it would destroy that checkpoint. Give --record another path");
  }
  {
    // BLAS threads so that the node's ranks x threads do not outnumber its cores, and what that gives.
    const int ranks_per_node = weft::ranks_on_node(MPI_COMM_WORLD);
    const auto bt = weft::ops::set_blas_threads(0, ranks_per_node);
    weft::ops::print_host_threads("serve_gpt", env.world().rank(), weft::ops::host_binding(bt.threads, ranks_per_node));
  }
  if (o.tp == 0) o.tp = world / o.dp;
  WEFT_REQUIRE(o.tp * o.dp == world, ConfigError, "--mesh tp=", o.tp, ",dp=", o.dp, " needs ", o.tp * o.dp,
               " ranks but the job has ", world, "; launch with mpirun -n ", o.tp * o.dp, " or change --mesh");
  o.model.validate_tensor_parallel(std::size_t(o.tp), false);
  const int replica = env.world().rank() / o.tp;
  weft::Comm tpc = env.world().split(replica, env.world().rank(), "tp");
  const bool leader = tpc.rank() == 0;

  // Memory before any allocation, as train_gpt checks it: the planner's
  // inference budget (weights, KV cache, workspace, buffers) per rank against
  // the node's MemAvailable shared by its ranks (host memory spaces; the
  // allocation names the tensor on a device).
  {
    const double pool_tokens = double(o.engine.blocks) * double(o.engine.block_size);
    WEFT_REQUIRE(pool_tokens <= 1099511627776.0, ConfigError, "--kv-blocks ", o.engine.blocks, " x --block-size ",
                 o.engine.block_size, " = ", pool_tokens, " tokens of KV cache, more than the 2^40 serve_gpt accepts; "
                 "give fewer --kv-blocks or a smaller --block-size");
    const auto plan = weft::serve::planned_memory(o.model, std::size_t(o.tp), o.engine, o.bytes());
    const double need = plan.weights + plan.kv_cache + plan.workspace + plan.buffers;
    const double avail_kb = weft::mem_available_bytes().value_or(-1024.0) / 1024.0;  // -1: unknown
    const int node_ranks = weft::ranks_on_node(MPI_COMM_WORLD);
    const double limit = avail_kb * 1024.0 / double(node_ranks);
    constexpr bool host = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Kokkos::DefaultExecutionSpace::memory_space>::accessible;
    auto gib = [](double b) {
      char t[32];
      std::snprintf(t, sizeof t, "%.2f GiB", b / 1073741824.0);
      return std::string(t);
    };
    WEFT_REQUIRE(!host || avail_kb < 0 || need <= limit, ConfigError, "the planned memory per rank, ", gib(need),
                 " (weights ", gib(plan.weights), ", KV cache ", gib(plan.kv_cache), ", workspace ", gib(plan.workspace),
                 ", buffers ", gib(plan.buffers), "), exceeds MemAvailable / ", node_ranks, " rank(s) on this node = ",
                 gib(limit), "; nothing was allocated. Give fewer --kv-blocks, a smaller --block-size or --max-seqs, "
                 "more tensor-parallel ranks (--mesh tp=N), or a smaller model");
  }
  Model model(o.model, tpc);
  double load_seconds = 0;
  if (!o.checkpoint.empty()) {
    weft::checkpoint::State<float, Kokkos::DefaultExecutionSpace> state;
    for (auto* p : model.parameters()) state.add(p->name(), weft::checkpoint::layout_of(*p), 0, p->value);
    // A failed load ends the program, so the weights need not survive a bad checksum: one pass.
    const auto st = weft::checkpoint::load(weft::checkpoint::resolve(o.checkpoint), state, env.world().native(),
                                           {.verify = weft::checkpoint::Verify::while_reading,
                                            // A train_gpt checkpoint: its optimizer state is not served.
                                            .ignore_suffixes = {".adam_m", ".adam_v", ".momentum"}});
    load_seconds = st.seconds;
    if (env.world().rank() == 0)
      std::printf("serve_gpt: weights from %s (step %zu, %.3f s)\n", st.path.c_str(), st.step, st.seconds);
  }
  Server engine(model, o.engine, o.bf16);
  // This replica's requests: i mod dp == replica.
  std::vector<std::size_t> mine;
  for (std::size_t i = 0; i < all.requests.size(); ++i)
    if (int(i % std::size_t(o.dp)) == replica) mine.push_back(i);

  std::map<std::uint64_t, std::size_t> global_of;  // engine id -> request index
  std::vector<double> arrival_of(all.requests.size(), -1);
  std::vector<std::string> rejected_why(all.requests.size());
  std::vector<std::vector<int>> outputs(all.requests.size());
  std::vector<double> ttft, itl, e2e;
  std::size_t next = 0, finished = 0, in_flight = 0, rejected = 0;
  double kv_sum = 0, kv_max = 0, occ_sum = 0, tok_sum = 0;
  std::size_t steps = 0;
  // Kokkos events per step (kernels, fences, deep copies, allocations):
  // the first step and up to `decode_counted_most` decode steps (every
  // sequence in the batch adds one token), then the callbacks go (on a
  // device, counting fences around every kernel).
  constexpr std::size_t decode_counted_most = 4;
  weft::metrics::KernelCounts first_counts, decode_counts;
  std::size_t decode_counted = 0, decode_sequences = 0;
  weft::metrics::KernelCounters::install();
  const double t_start = engine.now();
  std::size_t generated = 0;
  auto submit = [&](std::size_t k, double at) {
    const std::size_t i = mine[k];
    const auto s = engine.submit(all.requests[i]);
    arrival_of[i] = at;
    if (!s.accepted) {
      rejected_why[i] = s.error;
      ++rejected;
      ++finished;
      return;
    }
    global_of[s.id] = i;
    ++in_flight;
  };
  while (finished < mine.size()) {
    // How many requests to submit now: decided on the replica's TP rank 0 (its clock) and broadcast.
    std::size_t admit = 0;
    double now = engine.now() - t_start;
    if (o.rate > 0) {
      while (next + admit < mine.size() && all.arrival[mine[next + admit]] <= now) ++admit;
      if (admit == 0 && engine.idle() && next < mine.size()) {
        // Nothing to do until the next arrival.
        std::this_thread::sleep_for(std::chrono::duration<double>(all.arrival[mine[next]] - now));
        now = engine.now() - t_start;
        while (next + admit < mine.size() && all.arrival[mine[next + admit]] <= now) ++admit;
      }
    } else {
      while (next + admit < mine.size() && in_flight + admit < o.concurrency) ++admit;
    }
    long n = long(admit);
    Kokkos::View<long*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> nv(&n, 1);
    tpc.broadcast(nv, 0);
    for (long k = 0; k < n; ++k, ++next) submit(next, o.rate > 0 ? all.arrival[mine[next]] + t_start : engine.now());
    if (engine.idle()) continue;
    const auto k0 = weft::metrics::KernelCounters::snapshot();
    const auto st = engine.step();
    if (weft::metrics::KernelCounters::installed()) {
      const auto counts = weft::metrics::KernelCounters::snapshot() - k0;
      if (steps == 0) {
        first_counts = counts;
      } else if (st.sequences > 0 && st.tokens == st.sequences) {
        decode_counts = weft::metrics::max_of(decode_counts, counts);
        decode_sequences = std::max(decode_sequences, st.sequences);
        if (++decode_counted == decode_counted_most) weft::metrics::KernelCounters::uninstall();
      }
    }
    ++steps;
    kv_sum += double(st.blocks_used) / double(o.engine.blocks);
    kv_max = std::max(kv_max, double(st.blocks_used) / double(o.engine.blocks));
    occ_sum += double(st.sequences) / double(o.engine.max_seqs);
    tok_sum += double(st.tokens) / double(o.engine.token_budget);
    for (auto& c : engine.take_finished()) {
      const std::size_t i = global_of.at(c.id);
      outputs[i] = c.tokens;
      ttft.push_back(c.token_times.front() - arrival_of[i]);
      for (std::size_t k = 1; k < c.token_times.size(); ++k) itl.push_back(c.token_times[k] - c.token_times[k - 1]);
      e2e.push_back(c.token_times.back() - arrival_of[i]);
      generated += c.tokens.size();
      --in_flight;
      ++finished;
    }
  }
  const double seconds = engine.now() - t_start;
  weft::metrics::KernelCounters::uninstall();

  // Every replica's results onto world rank 0: its leader sends, the other TP ranks send nothing.
  auto share = [&](const std::vector<double>& v) { return gather(env.world().native(), leader ? v : std::vector<double>{}); };
  std::vector<double> flat;  // request index, count, tokens... for this replica's requests
  for (std::size_t i : mine) {
    flat.push_back(double(i));
    flat.push_back(double(outputs[i].size()));
    for (int t : outputs[i]) flat.push_back(double(t));
  }
  const auto outs = share(flat), ttft_all = share(ttft), itl_all = share(itl), e2e_all = share(e2e);
  const auto counts = share({double(generated), seconds, double(rejected), double(engine.preemptions()), double(steps),
                             kv_sum, kv_max, occ_sum, tok_sum});
  // Every replica's rejections onto world rank 0, which reports each of
  // them, whichever replica rejected it ("index replica reason" lines).
  std::string my_rejections;
  if (leader)
    for (std::size_t i : mine)
      if (!rejected_why[i].empty()) my_rejections += std::to_string(i) + ' ' + std::to_string(replica) + ' ' + rejected_why[i] + '\n';
  const std::string all_rejections = gather_text(env.world().native(), my_rejections);
  const auto mem = engine.memory();
  const auto plan = weft::serve::planned_memory(o.model, std::size_t(o.tp), o.engine, o.bytes());
  if (env.world().rank() != 0) return 0;
  {
    std::map<std::size_t, std::pair<int, std::string>> by_request;  // request -> (replica, reason)
    std::istringstream in(all_rejections);
    std::size_t i = 0;
    int from = 0;
    std::string why;
    while (in >> i >> from && std::getline(in >> std::ws, why)) by_request[i] = {from, why};
    for (const auto& [request, r] : by_request) {
      rejected_why[request] = r.second;
      std::printf("serve_gpt: request %zu rejected%s: %s\n", request,
                  o.dp > 1 ? (" by replica " + std::to_string(r.first)).c_str() : "", r.second.c_str());
    }
  }

  std::vector<std::vector<int>> all_out(all.requests.size());
  for (std::size_t k = 0; k < outs.size();) {
    const std::size_t i = std::size_t(outs[k]), n = std::size_t(outs[k + 1]);
    for (std::size_t j = 0; j < n; ++j) all_out[i].push_back(int(outs[k + 2 + j]));
    k += 2 + n;
  }
  double gen = 0, wall = 0, rej = 0, pre = 0, nsteps = 0, kvs = 0, kvm = 0, occ = 0, toks = 0;
  for (std::size_t k = 0; k < counts.size(); k += 9) {
    gen += counts[k];
    wall = std::max(wall, counts[k + 1]);
    rej += counts[k + 2];
    pre += counts[k + 3];
    nsteps += counts[k + 4];
    kvs += counts[k + 5];
    kvm = std::max(kvm, counts[k + 6]);
    occ += counts[k + 7];
    toks += counts[k + 8];
  }
  auto pct = [](const std::vector<double>& v) {
    Json j = Json::object();
    j.set("p50", percentile(v, 50));
    j.set("p90", percentile(v, 90));
    j.set("p99", percentile(v, 99));
    j.set("mean", v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()));
    j.set("count", v.size());
    return j;
  };
  const double tps = wall > 0 ? gen / wall : 0;
  std::printf("serve_gpt: %zu requests (%g rejected), %g tokens in %.3f s: %.1f tokens/s; %g steps, %g preemptions\n",
              all.requests.size(), rej, gen, wall, tps, nsteps, pre);
  std::printf("serve_gpt: TTFT p50 %.4f p90 %.4f p99 %.4f s; inter-token p50 %.4f p90 %.4f p99 %.4f s\n",
              percentile(ttft_all, 50), percentile(ttft_all, 90), percentile(ttft_all, 99), percentile(itl_all, 50),
              percentile(itl_all, 90), percentile(itl_all, 99));
  std::printf("serve_gpt: KV blocks used mean %.3f max %.3f of %zu; batch occupancy %.3f of %zu sequences, %.3f of %zu tokens\n",
              nsteps ? kvs / nsteps : 0.0, kvm, o.engine.blocks, nsteps ? occ / nsteps : 0.0, o.engine.max_seqs,
              nsteps ? toks / nsteps : 0.0, o.engine.token_budget);
  const double planned = plan.weights + plan.kv_cache + plan.workspace + plan.buffers;
  std::printf("serve_gpt: memory per rank %zu bytes (%s weights %zu, KV %zu, workspace %zu, buffers %zu); planned %.0f: %+.1f %%\n",
              mem.total(), o.bf16 ? "bf16" : "fp32", mem.weights, mem.kv_cache, mem.workspace, mem.buffers, planned,
              100.0 * (double(mem.total()) - planned) / planned);
  std::printf("serve_gpt: Kokkos events of world rank 0's first step: %s\n", first_counts.summary().c_str());
  if (decode_counted)
    std::printf("serve_gpt: per decode step (most of %zu, up to %zu sequences): %s\n", decode_counted, decode_sequences,
                decode_counts.summary().c_str());
  // Output parity against --baseline (its requests and prompts were checked
  // before any work): request by request, token by token; the first
  // difference is named. A rejected request has no tokens, in both records.
  const weft::TokenParity parity = o.baseline.empty() ? weft::TokenParity{} : weft::TokenParity::compare(all_out, base, rejected_why);
  const int status = parity.match ? 0 : 3;
  auto report_parity = [&] {
    if (o.baseline.empty()) return;
    std::fflush(stdout);
    std::fprintf(parity.match ? stdout : stderr, "%s\n", parity.line("serve_gpt", o.baseline).c_str());
  };
  if (o.record.empty()) {
    report_parity();
    return status;
  }

  Json r = Json::object();
  r.set("record_version", 1);
  r.set("program", "serve_gpt");
  r.set("weft_version", WEFT_VERSION_STRING);
  r.set("git_commit", WEFT_GIT_COMMIT);
  r.set("identity", record_identity::identity(weft::ops::float_gemm_provider_name<Kokkos::DefaultExecutionSpace>()));
  Json mj0 = Json::object();
  mj0.set("layers", o.model.layers);
  mj0.set("d_model", o.model.d_model);
  mj0.set("heads", o.model.heads);
  mj0.set("kv_heads", o.model.kv());
  mj0.set("context", o.model.seq);
  mj0.set("vocab", o.model.vocab);
  mj0.set("seed", static_cast<unsigned long long>(o.model.seed));
  mj0.set("norm", o.model.norm == weft::nn::NormKind::layernorm ? "layernorm" : "rmsnorm");
  mj0.set("mlp", o.model.mlp == weft::nn::MlpKind::gelu ? "gelu" : "swiglu");
  mj0.set("pos", o.model.position == weft::nn::PositionKind::learned ? "learned" : "rotary");
  mj0.set("experts", o.model.experts);
  if (o.model.experts > 0) {
    mj0.set("moe_top_k", o.model.top_k);
    mj0.set("router", o.model.router == weft::nn::RouterKind::softmax ? "softmax" : "sigmoid");
    mj0.set("moe_every", o.model.moe_every);
    mj0.set("shared_experts", o.model.shared_experts);
  }
  mj0.set("weights", o.checkpoint.empty() ? std::string("seed") : o.checkpoint);
  mj0.set("precision", o.bf16 ? "bfloat16" : "float32");
  r.set("model", mj0);
  Json mesh = Json::object();
  mesh.set("tp", o.tp);
  mesh.set("dp", o.dp);
  mesh.set("world", world);
  r.set("mesh", mesh);
  Json eng = Json::object();
  eng.set("block_size", o.engine.block_size);
  eng.set("kv_blocks", o.engine.blocks);
  eng.set("token_budget", o.engine.token_budget);
  eng.set("max_seqs", o.engine.max_seqs);
  eng.set("batching", o.engine.batching == weft::serve::Batching::continuous ? "continuous" : "static");
  r.set("engine", eng);
  Json tr = Json::object();
  tr.set("model", o.rate > 0 ? "poisson" : "closed_loop");
  tr.set("requests", o.requests);
  tr.set("rate", o.rate > 0 ? Json(o.rate) : Json());
  tr.set("concurrency", o.rate > 0 ? Json() : Json(o.concurrency));
  // With --prompts: the file, and its prompts' shortest and longest length.
  tr.set("prompts_file", o.prompts.empty() ? Json() : Json(o.prompts));
  if (o.prompts.empty()) {
    tr.set("prompt_len", Json(Json::Array{Json(o.prompt.lo), Json(o.prompt.hi)}));
  } else {
    std::size_t lo = all.requests.front().prompt.size(), hi = lo;
    for (const auto& q : all.requests) {
      lo = std::min(lo, q.prompt.size());
      hi = std::max(hi, q.prompt.size());
    }
    tr.set("prompt_len", Json(Json::Array{Json(lo), Json(hi)}));
  }
  tr.set("output_len", Json(Json::Array{Json(o.output.lo), Json(o.output.hi)}));
  tr.set("prompt_dist", o.prompts.empty() ? o.prompt_dist().shape_name() : std::string("file"));
  tr.set("output_dist", o.output_dist().shape_name());
  using weft::serve::LengthShape;
  tr.set("prompt_scale", o.prompt_shape != LengthShape::uniform ? Json(o.prompt_dist().effective_scale()) : Json());
  tr.set("output_scale", o.output_shape != LengthShape::uniform ? Json(o.output_dist().effective_scale()) : Json());
  tr.set("prompt_sigma", o.prompt_shape == LengthShape::lognormal ? Json(o.prompt_sigma) : Json());
  tr.set("output_sigma", o.output_shape == LengthShape::lognormal ? Json(o.output_sigma) : Json());
  tr.set("temperature", o.temperature);
  tr.set("top_k", o.top_k);
  r.set("traffic", tr);
  r.set("seconds", wall);
  r.set("generated_tokens", gen);
  r.set("tokens_per_second", tps);
  r.set("tokens_per_second_method", "generated tokens of all replicas / the longest replica's wall time from its first step to its last request's end");
  r.set("ttft_seconds", pct(ttft_all));
  r.set("inter_token_seconds", pct(itl_all));
  r.set("e2e_seconds", pct(e2e_all));
  r.set("steps", nsteps);
  r.set("preemptions", pre);
  r.set("rejected", rej);
  Json kv = Json::object();
  kv.set("mean_fraction", nsteps ? kvs / nsteps : 0.0);
  kv.set("max_fraction", kvm);
  r.set("kv_cache_use", kv);
  Json occj = Json::object();
  occj.set("mean_sequences_fraction", nsteps ? occ / nsteps : 0.0);
  occj.set("mean_tokens_fraction", nsteps ? toks / nsteps : 0.0);
  r.set("batch_occupancy", occj);
  Json mj = Json::object();
  mj.set("weights", mem.weights);
  mj.set("kv_cache", mem.kv_cache);
  mj.set("workspace", mem.workspace);
  mj.set("buffers", mem.buffers);
  mj.set("total", mem.total());
  r.set("memory_bytes_per_rank", mj);
  Json pj = Json::object();
  pj.set("weights", plan.weights);
  pj.set("kv_cache", plan.kv_cache);
  pj.set("workspace", plan.workspace);
  pj.set("buffers", plan.buffers);
  pj.set("total", planned);
  pj.set("relative_error", (double(mem.total()) - planned) / planned);
  r.set("planned_memory_bytes_per_rank", pj);
  r.set("checkpoint_load_seconds", load_seconds);
  Json cj = Json::object();
  cj.set("first_step", weft::metrics::to_json(first_counts));
  cj.set("decode_step", decode_counted ? weft::metrics::to_json(decode_counts) : Json());
  cj.set("decode_steps_counted", decode_counted);
  cj.set("decode_sequences_max", decode_sequences);
  cj.set("fences_reported", weft::metrics::KernelCounters::fences_reported());
  cj.set("note", "world rank 0's Kokkos events (tools callbacks) inside engine.step(): its first step, and the most of each "
                 "count over its first decode steps (each sequence adds one token; up to 4); see docs/records.md");
  r.set("counters", cj);
  Json::Array oa, ra;
  for (const auto& why : rejected_why) ra.push_back(why.empty() ? Json() : Json(why));
  r.set("rejections", Json(std::move(ra)));
  for (std::size_t i = 0; i < all_out.size(); ++i) {
    Json::Array t;
    for (int x : all_out[i]) t.push_back(Json(x));
    oa.push_back(Json(std::move(t)));
  }
  r.set("outputs", Json(std::move(oa)));
  Json::Array pa;
  for (const auto& q : all.requests) {
    Json::Array t;
    for (int x : q.prompt) t.push_back(Json(x));
    pa.push_back(Json(std::move(t)));
  }
  r.set("prompts", Json(std::move(pa)));
  if (o.baseline.empty()) {
    r.set("baseline", Json());
  } else {
    r.set("baseline", parity.json(o.baseline));
  }
  weft::write_file_whole("--record", o.record, r.dump(1) + "\n");  // whole or not at all
  std::printf("serve_gpt: record written to %s\n", o.record.c_str());
  report_parity();
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  try {
    return run(argc, argv, env);
  } catch (const weft::Error& e) {
    return weft::report_error_once(env, e, "serve_gpt", 2);
  }
}
