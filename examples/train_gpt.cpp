// train_gpt: trains the reference GPT on byte-level text -- by default a
// synthetic language generated here, or any text file with --data -- and
// prints one line per step; with --record FILE it writes a JSON run record
// (config, mesh, per-step losses, tokens/s, model FLOPs, MFU, memory, the
// build and runtime, exposed communication, input stalls, stragglers and loss
// parity against --baseline; fields in docs/records.md, schema in
// docs/schema/run_record.schema.json).
//
//   mpirun -n 1 train_gpt --layers 4 --d-model 128 --heads 4 --seq 64 --batch 8 --steps 300 --record run.json
//
// --batch is the global batch (sequences per optimizer step); --microbatches
// splits it for gradient accumulation, and --mesh dp=N splits it over N
// data-parallel ranks (each takes batch / dp sequences): the same command line
// on any mesh trains the same model on the same data.
//
//   mpirun -n 4 train_gpt --mesh dp=4 --dp fsdp --batch 16 --record run.json
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <weft/metrics/metrics.hpp>
#include <weft/plan/json_read.hpp>
#include <weft/weft.hpp>

namespace {

using Space = Kokkos::DefaultExecutionSpace;
using weft::ConfigError;

struct Options {
  weft::nn::GPTConfig model;
  std::size_t batch = 8, microbatches = 1, steps = 200, threads = 0, corpus_bytes = 2000000;
  double lr = 1e-3, weight_decay = 0.1, clip = 1.0, momentum = 0.9;
  std::size_t warmup = 0;
  std::string data, record, optimizer = "adamw";
  int dp = 0;  // 0: the world size
  std::string compare;  // a run record whose loss curve this run must follow (--baseline, alias --compare)
  bool check_only = false;  // --check: validate the flags and exit without training
  double tolerance = 1e-5;
  weft::parallel::DPOptions dp_options;
};

const char* kUsage =
    "usage: train_gpt [flags]\n"
    "  --layers N        transformer blocks (4)\n"
    "  --d-model N       residual width (128)\n"
    "  --heads N         attention heads, dividing d-model (4)\n"
    "  --kv-heads N      key/value heads for grouped-query attention (= heads)\n"
    "  --seq N           tokens per sequence (64)\n"
    "  --batch N         global batch: sequences per optimizer step (8)\n"
    "  --microbatches N  gradient-accumulation microbatches, dividing batch (1)\n"
    "  --vocab N         vocabulary, >= 256 for byte data (256)\n"
    "  --steps N         optimizer steps (200)\n"
    "  --lr X            peak learning rate (1e-3)\n"
    "  --warmup N        linear learning-rate warm-up steps (0)\n"
    "  --optimizer adamw|sgd, --weight-decay X (0.1), --momentum X (sgd, 0.9), --clip X (1.0; 0: off)\n"
    "  --norm layernorm|rmsnorm, --mlp gelu|swiglu, --pos learned|rotary, --recompute\n"
    "  --seed N          initialisation and data order (1234)\n"
    "  --data FILE       train on the bytes of FILE (default: synthetic language)\n"
    "  --threads N       BLAS threads per rank (default: cores / ranks on the node)\n"
    "  --record FILE     write a JSON run record\n"
    "  --mesh dp=N       the mesh; axes left out have size 1 (default dp = number of ranks)\n"
    "  --dp replicate|zero1|zero2|fsdp  data-parallel mode (replicate)\n"
    "  --bucket-mb X     gradient bucket size of replicate and zero1 in MiB (25)\n"
    "  --no-overlap      reduce gradients after backward instead of during it\n"
    "  --baseline FILE   loss parity: fail unless the loss curve follows FILE's (a --record of another run)\n"
    "                    to --tolerance; the record gets the comparison (--compare FILE: the same)\n"
    "  --tolerance X     relative difference allowed per step by --baseline (1e-5)\n"
    "  --check           validate the flags (mesh, modes, batch split) and exit without training\n";

std::size_t parse_count(const std::string& flag, const std::string& v, bool allow_zero = false) {
  std::size_t pos = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &pos);
  } catch (...) {
    pos = 0;
  }
  WEFT_REQUIRE(pos == v.size() && !v.empty() && (allow_zero ? x >= 0 : x > 0), ConfigError, flag, " ", v,
               ": expected a ", allow_zero ? "non-negative" : "positive", " integer");
  return std::size_t(x);
}

double parse_real(const std::string& flag, const std::string& v, bool positive) {
  std::size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(v, &pos);
  } catch (...) {
    pos = 0;
  }
  WEFT_REQUIRE(pos == v.size() && !v.empty() && std::isfinite(x) && (positive ? x > 0 : x >= 0), ConfigError, flag,
               " ", v, ": expected a ", positive ? "positive" : "non-negative", " number");
  return x;
}

template <class E>
E parse_choice(const std::string& flag, const std::string& v, const std::map<std::string, E>& choices) {
  auto it = choices.find(v);
  if (it == choices.end()) {
    std::string names;
    for (const auto& [k, e] : choices) names += (names.empty() ? "" : ", ") + k;
    weft::detail::throw_error<ConfigError>(flag, " ", v, ": expected one of ", names);
  }
  return it->second;
}

// --mesh dp=A[,tp=B,pp=C,cp=D,ep=E]: the axes this build of train_gpt runs
// are named; the others must be 1 until their strategies arrive.
int parse_mesh(const std::string& v) {
  int dp = 0;
  std::size_t start = 0;
  while (start <= v.size()) {
    const std::size_t end = std::min(v.find(',', start), v.size());
    const std::string item = v.substr(start, end - start);
    const std::size_t eq = item.find('=');
    WEFT_REQUIRE(eq != std::string::npos, ConfigError, "--mesh ", v, ": expected axis=size items such as dp=4, got '", item, "'");
    const std::string axis = item.substr(0, eq);
    const int n = int(parse_count("--mesh " + axis, item.substr(eq + 1)));
    if (axis == "dp") {
      dp = n;
    } else {
      WEFT_REQUIRE(axis == "tp" || axis == "pp" || axis == "cp" || axis == "ep", ConfigError, "--mesh ", v,
                   ": unknown axis '", axis, "'; the axes are dp, tp, pp, cp, ep");
      WEFT_REQUIRE(n == 1, ConfigError, "--mesh ", v, ": ", axis, "=", n,
                   " is not available in train_gpt yet (data parallelism only); use ", axis, "=1 or leave it out");
    }
    start = end + 1;
  }
  WEFT_REQUIRE(dp > 0, ConfigError, "--mesh ", v, ": name the data-parallel extent, e.g. --mesh dp=4");
  return dp;
}

Options parse(int argc, char** argv) {
  Options o;
  o.model.d_model = 128;
  o.model.heads = 4;
  o.model.seq = 64;
  std::map<std::string, std::function<void(const std::string&)>> flags = {
      {"--layers", [&](const std::string& v) { o.model.layers = parse_count("--layers", v); }},
      {"--d-model", [&](const std::string& v) { o.model.d_model = parse_count("--d-model", v); }},
      {"--heads", [&](const std::string& v) { o.model.heads = parse_count("--heads", v); }},
      {"--kv-heads", [&](const std::string& v) { o.model.kv_heads = parse_count("--kv-heads", v); }},
      {"--seq", [&](const std::string& v) { o.model.seq = parse_count("--seq", v); }},
      {"--batch", [&](const std::string& v) { o.batch = parse_count("--batch", v); }},
      {"--microbatches", [&](const std::string& v) { o.microbatches = parse_count("--microbatches", v); }},
      {"--vocab", [&](const std::string& v) { o.model.vocab = parse_count("--vocab", v); }},
      {"--steps", [&](const std::string& v) { o.steps = parse_count("--steps", v); }},
      {"--lr", [&](const std::string& v) { o.lr = parse_real("--lr", v, true); }},
      {"--warmup", [&](const std::string& v) { o.warmup = parse_count("--warmup", v, true); }},
      {"--weight-decay", [&](const std::string& v) { o.weight_decay = parse_real("--weight-decay", v, false); }},
      {"--momentum", [&](const std::string& v) { o.momentum = parse_real("--momentum", v, false); }},
      {"--clip", [&](const std::string& v) { o.clip = parse_real("--clip", v, false); }},
      {"--seed", [&](const std::string& v) { o.model.seed = parse_count("--seed", v, true); }},
      {"--data", [&](const std::string& v) { o.data = v; }},
      {"--record", [&](const std::string& v) { o.record = v; }},
      {"--threads", [&](const std::string& v) { o.threads = parse_count("--threads", v); }},
      {"--mesh", [&](const std::string& v) { o.dp = parse_mesh(v); }},
      {"--compare", [&](const std::string& v) { o.compare = v; }},
      {"--baseline", [&](const std::string& v) { o.compare = v; }},
      {"--tolerance", [&](const std::string& v) { o.tolerance = parse_real("--tolerance", v, true); }},
      {"--dp", [&](const std::string& v) { o.dp_options.mode = weft::parallel::parse_dp_mode(v); }},
      {"--bucket-mb", [&](const std::string& v) { o.dp_options.bucket_mb = parse_real("--bucket-mb", v, true); }},
      {"--optimizer",
       [&](const std::string& v) {
         o.optimizer = parse_choice<std::string>("--optimizer", v, {{"adamw", "adamw"}, {"sgd", "sgd"}});
       }},
      {"--norm",
       [&](const std::string& v) {
         o.model.norm = parse_choice<weft::nn::NormKind>(
             "--norm", v, {{"layernorm", weft::nn::NormKind::layernorm}, {"rmsnorm", weft::nn::NormKind::rmsnorm}});
       }},
      {"--mlp",
       [&](const std::string& v) {
         o.model.mlp = parse_choice<weft::nn::MlpKind>("--mlp", v,
                                                       {{"gelu", weft::nn::MlpKind::gelu}, {"swiglu", weft::nn::MlpKind::swiglu}});
       }},
      {"--pos",
       [&](const std::string& v) {
         o.model.position = parse_choice<weft::nn::PositionKind>(
             "--pos", v, {{"learned", weft::nn::PositionKind::learned}, {"rotary", weft::nn::PositionKind::rotary}});
       }},
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], v;
    if (a == "--recompute") {
      o.model.recompute = true;
      continue;
    }
    if (a == "--no-overlap") {
      o.dp_options.overlap = false;
      continue;
    }
    if (a == "--check") {
      o.check_only = true;
      continue;
    }
    if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto it = flags.find(a);
    WEFT_REQUIRE(it != flags.end(), ConfigError, "unknown flag ", a, "; run train_gpt --help for the flags");
    if (v.empty() && argv[i][a.size()] != '=') {
      WEFT_REQUIRE(i + 1 < argc, ConfigError, a, " needs a value");
      v = argv[++i];
    }
    it->second(v);
  }
  WEFT_REQUIRE(o.model.vocab >= 256, ConfigError, "--vocab ", o.model.vocab,
               " is smaller than the 256 byte values of the data; use --vocab 256 or more");
  o.model.validate();
  return o;
}

// The "loss" array of a run record written by --record (the --baseline file).
std::vector<double> read_losses(const std::string& path) {
  std::ifstream f(path);
  WEFT_REQUIRE(f.good(), ConfigError, "--baseline ", path, ": cannot open the file (", std::strerror(errno), ")");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const weft::plan::JsonValue doc = weft::plan::parse_json(text, "--baseline " + path);
  const weft::plan::JsonValue* loss = doc.kind == weft::plan::JsonValue::Kind::object ? doc.find("loss") : nullptr;
  WEFT_REQUIRE(loss && loss->kind == weft::plan::JsonValue::Kind::array, ConfigError, "--baseline ", path,
               ": no \"loss\" array found; expected a run record written by train_gpt --record");
  std::vector<double> out;
  for (std::size_t i = 0; i < loss->array.size(); ++i) {
    WEFT_REQUIRE(loss->array[i].kind == weft::plan::JsonValue::Kind::number, ConfigError, "--baseline ", path,
                 ": loss[", i, "] is not a number");
    out.push_back(loss->array[i].number);
  }
  WEFT_REQUIRE(!out.empty(), ConfigError, "--baseline ", path, ": the \"loss\" array is empty");
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

const char* name_of(weft::nn::NormKind k) { return k == weft::nn::NormKind::layernorm ? "layernorm" : "rmsnorm"; }
const char* name_of(weft::nn::MlpKind k) { return k == weft::nn::MlpKind::gelu ? "gelu" : "swiglu"; }
const char* name_of(weft::nn::PositionKind k) { return k == weft::nn::PositionKind::learned ? "learned" : "rotary"; }

template <class Opt>
int train(const Options& o, weft::nn::GPT<float, Space>& gpt, weft::parallel::DataParallel<float, Space>& dp, Opt& opt,
          const weft::data::TokenStream& stream, const weft::ops::BlasThreads& bt, int ranks_per_node, double unigram,
          const std::string& data_name) {
  const auto& c = gpt.config();
  weft::Comm& comm = dp.comm();
  const bool root = comm.rank() == 0;
  const int ndp = comm.size();
  const std::size_t tokens_per_step = o.batch * c.seq;
  // The MFU yardstick: the best float gemm of the model's own MLP shape and a square one, measured now.
  const auto peak = weft::metrics::measure_sgemm_peak<Space>({{c.tokens(), 4 * c.d_model, c.d_model}, {512, 512, 512}}, 3);
  const double flops_per_token = c.flops_per_token();
  std::size_t nparams = 0;
  for (auto& g : gpt.parameter_groups())
    for (auto* p : g) nparams += p->size();
  if (root) {
    std::printf("train_gpt: %zu parameters, %.2f MFLOP/token, global batch %zu x %zu tokens (%zu microbatches), data %s\n",
                nparams, flops_per_token * 1e-6, o.batch, c.seq, o.microbatches, data_name.c_str());
    std::printf("train_gpt: mesh dp=%d (%s), %zu sequences per rank per microbatch\n", ndp,
                weft::parallel::to_string(dp.mode()), c.batch);
    std::printf("train_gpt: BLAS threads %d (%s); sgemm peak %.2f GFLOP/s per rank\n", bt.threads, bt.reason.c_str(),
                peak.wall * 1e-9);
  }
  std::fflush(stdout);
  const bool tty = root && isatty(STDOUT_FILENO);
  comm.reset_stats();
  weft::ops::Tokens<Space> ids("ids", c.tokens()), tg("targets", c.tokens());
  std::vector<double> losses, norms, walls, cpus;
  weft::metrics::Profiler prof;  // its "data" scope is the input stall (batches are filled synchronously)
  weft::CommStats warm_stats;    // communication during the warm-up steps (excluded from the steady figures)
  const std::size_t skip = o.steps > 1 ? std::min<std::size_t>(5, std::max<std::size_t>(1, o.steps / 10)) : 0;
  for (std::size_t s = 0; s < o.steps; ++s) {
    const double lr = o.warmup > 0 && s < o.warmup ? o.lr * double(s + 1) / double(o.warmup) : o.lr;
    Kokkos::fence();
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = weft::metrics::process_cpu_seconds();
    const auto r = weft::parallel::train_step(gpt, dp, opt, stream, s, o.batch, o.microbatches, ids, tg, lr, o.clip, &prof);
    Kokkos::fence();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpus.push_back(weft::metrics::process_cpu_seconds() - c0);
    walls.push_back(wall);
    if (s + 1 == skip) warm_stats = comm.stats();
    losses.push_back(r.loss);
    norms.push_back(r.grad_norm);
    if (!root) continue;
    if (tty) std::printf("\r\033[K");
    std::printf("step %zu loss %.4f tok/s %.0f grad_norm %.4f lr %.3g ms %.1f\n", s, r.loss,
                double(tokens_per_step) / wall, r.grad_norm, lr, wall * 1e3);
    if (tty) {
      const int width = 30, done = int(double(width) * double(s + 1) / double(o.steps));
      std::printf("[%s%s] %zu/%zu loss %.3f", std::string(std::size_t(done), '#').c_str(),
                  std::string(std::size_t(width - done), '.').c_str(), s + 1, o.steps, r.loss);
    }
    std::fflush(stdout);
  }
  if (tty) std::printf("\r\033[K");
  // Tokens/s: median over the steps after warm-up (the first steps pay for first-touch and BLAS buffers).
  const std::vector<double> steady(walls.begin() + long(skip), walls.end()),
      steady_cpu(cpus.begin() + long(skip), cpus.end());
  const double tps = double(tokens_per_step) / median(steady);
  const double tps_cpu = double(tokens_per_step) / median(steady_cpu);
  // Each rank's gemm peak is the yardstick of its share of the work.
  const double mfu = flops_per_token * tps / (peak.wall * ndp);
  // Memory per category on every rank (sharded modes differ by rank).
  using C = weft::metrics::MemoryCategory;
  const C cats[] = {C::parameters, C::gradients, C::optimizer_state, C::activations, C::buffers};
  auto mem = gpt.memory();
  weft::metrics::MemoryLedger ledger;
  for (const auto& item : mem.items())  // parameters and gradients are owned by the data-parallel engine
    if (item.category != C::parameters && item.category != C::gradients) ledger.add(item.category, item.label, item.bytes);
  ledger.merge(dp.memory());
  ledger.merge(opt.memory());
  // The planner splits buffers into communication (the data-parallel engine's
  // collective staging) and temporary (everything else: scratch, gathered groups).
  std::size_t comm_buffers = 0;
  for (const auto& item : ledger.items())
    if (item.label == "dp.communication_buffers") comm_buffers += item.bytes;
  // Exposed communication by the kinds (summed over all steps, this rank).
  const weft::CommStats stats = comm.stats();  // read before the gathers below add their own calls
  auto exposed = [&](std::initializer_list<weft::CommKind> kinds, bool steady_only) {
    double t = 0;
    for (auto k : kinds) t += stats[k].exposed_seconds - (steady_only ? warm_stats[k].exposed_seconds : 0.0);
    return t;
  };
  using K = weft::CommKind;
  double exposed_kinds[12];
  for (int w = 0; w < 2; ++w) {
    exposed_kinds[6 * w + 0] = exposed({K::all_reduce}, w);
    exposed_kinds[6 * w + 1] = exposed({K::all_gather}, w);
    exposed_kinds[6 * w + 2] = exposed({K::reduce_scatter}, w);
    exposed_kinds[6 * w + 3] = exposed({K::all_to_all, K::all_to_allv}, w);
    exposed_kinds[6 * w + 4] = exposed({K::send, K::recv, K::sendrecv}, w);
    exposed_kinds[6 * w + 5] = exposed({K::broadcast, K::barrier}, w);
  }
  const char* exposed_names[6] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "point_to_point", "other"};
  const auto data_it = prof.entries().find("data");
  const double input_stall = data_it == prof.entries().end() ? 0.0 : data_it->second.seconds;
  // Per rank: 5 categories, temporary, communication, total, median step, mean step, input stall,
  // 6 exposed kinds over all steps, the same 6 after the warm-up steps.
  constexpr std::size_t nfield = 23;
  Kokkos::View<double*, Kokkos::HostSpace> mine("mine", nfield), all("all", nfield * std::size_t(ndp));
  for (int k = 0; k < 5; ++k) mine(std::size_t(k)) = double(ledger.bytes(cats[k]));
  mine(5) = double(ledger.bytes(C::buffers) - comm_buffers);
  mine(6) = double(comm_buffers);
  mine(7) = double(ledger.total());
  mine(8) = median(steady);
  mine(9) = std::accumulate(steady.begin(), steady.end(), 0.0) / double(std::max<std::size_t>(1, steady.size()));
  mine(10) = input_stall;
  for (int k = 0; k < 12; ++k) mine(std::size_t(11 + k)) = exposed_kinds[k];
  comm.all_gather(mine, all);
  // The hosts of the ranks (topology identity): processor names, fixed width.
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_len = 0;
  MPI_Get_processor_name(host, &host_len);
  std::vector<char> hosts(std::size_t(MPI_MAX_PROCESSOR_NAME) * std::size_t(ndp));
  MPI_Allgather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD);
  auto field = [&](int r, std::size_t k) { return all(nfield * std::size_t(r) + k); };
  if (!root) return 0;
  std::printf("train_gpt: final loss %.4f (unigram entropy of the data %.4f); %.0f tok/s, %.2f GFLOP/s of model FLOPs, MFU %.3f\n",
              losses.back(), unigram, tps, flops_per_token * tps * 1e-9, mfu);

  // Loss parity against a baseline record: every step of this run against the same step there.
  struct Parity {
    std::size_t steps = 0, worst_step = 0;
    double worst = 0, ref_at_worst = 0;
    bool pass = true;
  } parity;
  if (!o.compare.empty()) {
    const auto ref = read_losses(o.compare);
    WEFT_REQUIRE(ref.size() >= losses.size(), ConfigError, "--baseline ", o.compare, " has ", ref.size(),
                 " steps, fewer than the ", losses.size(), " of this run");
    parity.steps = losses.size();
    for (std::size_t s = 0; s < losses.size(); ++s) {
      double rel = std::abs(losses[s] - ref[s]) / std::max(std::abs(ref[s]), 1e-30);
      if (std::isnan(rel)) rel = INFINITY;  // a NaN loss is the worst difference there is
      if (s == 0 || rel > parity.worst) {
        parity.worst = rel;
        parity.worst_step = s;
        parity.ref_at_worst = ref[s];
      }
      if (!(rel <= o.tolerance)) parity.pass = false;
    }
  }

  if (!o.record.empty()) {
    using weft::metrics::Json;
    Json memory = Json::object();
    for (int k = 0; k < 5; ++k) memory.set(weft::metrics::category_name(cats[k]), Json(std::size_t(mine(std::size_t(k)))));
    memory.set("total", Json(ledger.total()));
    memory.set("note", "rank 0: bytes weft allocates, all at start-up and kept for the run, except fsdp/zero2 gathered groups counted at their peak under buffers; BLAS and MPI buffers not included");
    const char* per_rank_names[8] = {"parameters", "gradients", "optimizer_state", "activations", "buffers",
                                     "temporary", "communication", "total"};
    Json::Array per_rank, step_per_rank, exposed_per_rank;
    int slow = 0, fast = 0;
    double stall_max = 0;
    double exposed_max[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < ndp; ++r) {
      Json m = Json::object();
      for (std::size_t k = 0; k < 8; ++k) m.set(per_rank_names[k], Json(std::size_t(field(r, k))));
      per_rank.push_back(m);
      step_per_rank.push_back(Json::object().set("median", field(r, 8)).set("mean", field(r, 9)));
      if (field(r, 8) > field(slow, 8)) slow = r;
      if (field(r, 8) < field(fast, 8)) fast = r;
      stall_max = std::max(stall_max, field(r, 10));
      Json e = Json::object();
      for (std::size_t k = 0; k < 12; ++k) {
        if (k < 6) e.set(exposed_names[k], field(r, 11 + k));
        exposed_max[k] = std::max(exposed_max[k], field(r, 11 + k));
      }
      exposed_per_rank.push_back(e);
    }
    Json exposed_comm = Json::object(), exposed_steady = Json::object();
    for (std::size_t k = 0; k < 6; ++k) exposed_comm.set(exposed_names[k], exposed_max[k]);
    for (std::size_t k = 0; k < 6; ++k) exposed_steady.set(exposed_names[k], exposed_max[6 + k]);
    std::vector<std::string> rank_hosts, distinct;
    for (int r = 0; r < ndp; ++r) {
      const char* h = hosts.data() + std::size_t(MPI_MAX_PROCESSOR_NAME) * std::size_t(r);
      rank_hosts.emplace_back(h, strnlen(h, MPI_MAX_PROCESSOR_NAME));
      if (std::find(distinct.begin(), distinct.end(), rank_hosts.back()) == distinct.end()) distinct.push_back(rank_hosts.back());
    }
    Json::Array host_list, rank_host_list;
    for (const auto& h : distinct) host_list.push_back(h);
    for (const auto& h : rank_hosts) rank_host_list.push_back(h);
    char mpi_lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int mpi_lib_len = 0;
    MPI_Get_library_version(mpi_lib, &mpi_lib_len);
    std::string mpi_library(mpi_lib, std::size_t(std::max(0, mpi_lib_len)));
    while (!mpi_library.empty() && (mpi_library.back() == '\n' || mpi_library.back() == ' ' || mpi_library.back() == '\0'))
      mpi_library.pop_back();
    int mpi_major = 0, mpi_minor = 0;
    MPI_Get_version(&mpi_major, &mpi_minor);
    const std::string kokkos_version = std::to_string(KOKKOS_VERSION / 10000) + "." +
                                       std::to_string(KOKKOS_VERSION / 100 % 100) + "." + std::to_string(KOKKOS_VERSION % 100);
    Json collectives = Json::object();
    for (int k = 0; k < weft::comm_kind_count; ++k) {
      const auto& ks = stats[static_cast<weft::CommKind>(k)];
      if (ks.calls == 0) continue;
      collectives.set(std::string(weft::to_string(static_cast<weft::CommKind>(k))),
                      Json::object().set("calls", Json(std::size_t(ks.calls))).set("bytes", Json(std::size_t(ks.bytes)))
                          .set("seconds", ks.seconds).set("exposed_seconds", ks.exposed_seconds));
    }
    Json rec = Json::object();
    rec.set("record_version", 1);
    rec.set("program", "train_gpt").set("weft_version", WEFT_VERSION_STRING).set("git_commit", weft::git_commit);
    rec.set("model", Json::object()
                         .set("name", "weft GPT (nn::GPT)").set("parameters", Json(nparams))
                         .set("matmul_parameters", c.matmul_params()).set("layers", Json(c.layers))
                         .set("d_model", Json(c.d_model)).set("heads", Json(c.heads)).set("kv_heads", Json(c.kv()))
                         .set("ffn_hidden", Json(c.hidden())).set("vocab", Json(c.vocab)).set("seq", Json(c.seq))
                         .set("norm", name_of(c.norm)).set("mlp", name_of(c.mlp)).set("position", name_of(c.position))
                         .set("recompute", c.recompute).set("dtype", "float32"));
    rec.set("config", Json::object()
                          .set("layers", Json(c.layers)).set("d_model", Json(c.d_model)).set("heads", Json(c.heads))
                          .set("kv_heads", Json(c.kv())).set("seq", Json(c.seq)).set("batch", Json(o.batch))
                          .set("microbatches", Json(o.microbatches)).set("microbatch", Json(c.batch))
                          .set("vocab", Json(c.vocab)).set("ffn_hidden", Json(c.hidden())).set("steps", Json(o.steps))
                          .set("lr", o.lr).set("warmup", Json(o.warmup)).set("optimizer", o.optimizer)
                          .set("weight_decay", o.weight_decay).set("clip", o.clip).set("seed", Json(c.seed))
                          .set("data", data_name).set("norm", name_of(c.norm)).set("mlp", name_of(c.mlp))
                          .set("position", name_of(c.position)).set("recompute", c.recompute).set("dtype", "float32"));
    rec.set("mesh", Json::object().set("dp", ndp).set("tp", 1).set("pp", 1).set("cp", 1).set("ep", 1).set("world_size", ndp)
                        .set("dp_mode", weft::parallel::to_string(dp.mode())).set("bucket_mb", o.dp_options.bucket_mb)
                        .set("overlap", o.dp_options.overlap));
    rec.set("runtime", Json::object()
                           .set("execution_space", Space::name()).set("kokkos_version", Json(KOKKOS_VERSION))
                           .set("kokkos_version_string", kokkos_version).set("kokkos_backend", Space::name())
                           .set("mpi_library", mpi_library)
                           .set("mpi_standard", std::to_string(mpi_major) + "." + std::to_string(mpi_minor))
                           .set("blas_threads", bt.threads).set("blas_threads_reason", bt.reason)
                           .set("ranks_per_node", ranks_per_node));
    rec.set("topology", Json::object()
                            .set("world_size", ndp).set("hosts", Json(host_list)).set("host_count", Json(distinct.size()))
                            .set("ranks_per_node", ranks_per_node).set("rank_hosts", Json(rank_host_list)));
    rec.set("batch", Json::object()
                         .set("global_sequences", Json(o.batch)).set("local_sequences", Json(o.batch / std::size_t(ndp)))
                         .set("microbatches", Json(o.microbatches)).set("microbatch_sequences", Json(c.batch))
                         .set("seq", Json(c.seq)).set("global_tokens", Json(tokens_per_step))
                         .set("local_tokens", Json(tokens_per_step / std::size_t(ndp)))
                         .set("steps", Json(o.steps)).set("total_tokens", Json(tokens_per_step * o.steps)));
    rec.set("tokens_per_step", Json(tokens_per_step));
    rec.set("loss", Json(losses));
    rec.set("grad_norm", Json(norms));
    rec.set("step_seconds", Json(walls));
    rec.set("warmup_steps_excluded", Json(skip));
    rec.set("tokens_per_second", tps);
    rec.set("useful_tokens_per_second", tps);
    rec.set("tokens_per_second_method",
            "global tokens per step / median wall time of rank 0's steps after warmup_steps_excluded; every token is useful (no padding)");
    rec.set("tokens_per_second_cpu_time", tps_cpu);
    rec.set("parameters", Json(nparams));
    rec.set("matmul_parameters", c.matmul_params());
    rec.set("model_flops_per_token", flops_per_token);
    rec.set("model_flops_formula",
            "6*N + 12*L*T*D per token (forward + backward); N = matmul weights = 12*L*D^2 + D*V for the GPT-2 shape; see docs/model.md");
    rec.set("peak_flops", peak.wall);
    rec.set("peak_flops_cpu_time", peak.cpu);
    rec.set("peak_method", "best float gemm through Kokkos Kernels at start-up: [tokens x D] x [D x 4D] and 512^3, 3 runs each, same BLAS threads");
    rec.set("mfu", mfu);
    rec.set("mfu_formula", "model_flops_per_token * tokens_per_second / (world_size * peak_flops): model FLOPs (no recompute counted) over the measured per-rank sgemm peak times the ranks");
    rec.set("mfu_cpu_time", flops_per_token * tps_cpu / peak.cpu);
    rec.set("memory_bytes", memory);
    rec.set("memory_bytes_per_rank", Json(per_rank));
    rec.set("memory_note", "per rank: the five ledger categories; buffers = temporary + communication (dp.communication_buffers), the planner's split; total = all five");
    rec.set("exposed_comm_seconds", exposed_comm);
    rec.set("exposed_comm_seconds_after_warmup", exposed_steady);
    rec.set("exposed_comm_seconds_per_rank", Json(exposed_per_rank));
    rec.set("exposed_comm_note", "seconds a rank was blocked in communication, summed over all steps; the top-level figure is the maximum over ranks; all_to_all includes all_to_allv, point_to_point is send + recv + sendrecv, other is broadcast + barrier; _after_warmup: the same over the steps after warmup_steps_excluded (those behind tokens_per_second)");
    rec.set("input_stall_seconds", stall_max);
    rec.set("input_stall_note", "time filling token batches from the data stream, summed over all steps, maximum over ranks (batches are prepared synchronously, so all of it stalls the step)");
    rec.set("checkpoint_seconds", Json(nullptr));
    rec.set("checkpoint_note", "train_gpt writes no checkpoints");
    rec.set("step_time_seconds",
            Json::object()
                .set("statistic", "median and mean of each rank's step wall times after warmup_steps_excluded")
                .set("per_rank", Json(step_per_rank))
                .set("slowest", Json::object().set("rank", slow).set("seconds", field(slow, 8)))
                .set("fastest", Json::object().set("rank", fast).set("seconds", field(fast, 8)))
                .set("slowest_over_fastest", field(fast, 8) > 0 ? field(slow, 8) / field(fast, 8) : 1.0));
    if (o.compare.empty()) {
      rec.set("loss_parity", Json(nullptr));
    } else {
      rec.set("loss_parity", Json::object()
                                 .set("baseline", o.compare).set("steps_compared", Json(parity.steps))
                                 .set("max_relative_difference", parity.worst).set("worst_step", Json(parity.worst_step))
                                 .set("tolerance", o.tolerance).set("pass", parity.pass)
                                 .set("definition", "per step |loss - baseline| / |baseline|, steps 0..steps_compared-1"));
    }
    rec.set("collectives", collectives);
    rec.set("collectives_note", "dp axis, rank 0, all steps: bytes as nccl-tests' size; exposed = time the rank was blocked");
    rec.set("unigram_entropy", unigram);
    std::ofstream f(o.record);
    WEFT_REQUIRE(f.good(), ConfigError, "--record ", o.record, ": cannot open the file for writing (", std::strerror(errno), ")");
    f << rec.dump() << "\n";
    WEFT_REQUIRE(f.good(), ConfigError, "--record ", o.record, ": writing failed");
    std::printf("train_gpt: run record written to %s\n", o.record.c_str());
  }
  if (!o.compare.empty()) {
    if (!parity.pass) {
      std::fprintf(stderr, "train_gpt: error: step %zu loss %.9g differs from %s's %.9g by %.3g relative, more than --tolerance %.3g\n",
                   parity.worst_step, losses[parity.worst_step], o.compare.c_str(), parity.ref_at_worst, parity.worst,
                   o.tolerance);
      return 3;
    }
    std::printf("train_gpt: the loss curve follows %s: max relative difference %.3g over %zu steps (tolerance %.3g)\n",
                o.compare.c_str(), parity.worst, parity.steps, o.tolerance);
  }
  return 0;
}

int run(int argc, char** argv, weft::Environment& env) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  const Options o = parse(argc, argv);
  const int world = env.world().size();
  if (o.check_only) {
    // What weft-plan --run-top asks before launching a candidate: does this
    // build accept the mesh, the modes and the batch split (on any world size)?
    const int n = o.dp == 0 ? world : o.dp;
    weft::nn::GPTConfig m = o.model;
    m.batch = weft::parallel::local_microbatch(o.batch, std::size_t(n), o.microbatches);
    m.validate();
    if (env.world().rank() == 0)
      std::printf("train_gpt: flags accepted: mesh dp=%d (%s), %zu sequences per rank per microbatch; needs %d ranks\n", n,
                  weft::parallel::to_string(o.dp_options.mode), m.batch, n);
    return 0;
  }
  const int ndp = o.dp == 0 ? world : o.dp;
  WEFT_REQUIRE(ndp == world, ConfigError, "--mesh dp=", ndp, " needs ", ndp, " ranks, but train_gpt was started on ",
               world, "; launch it with mpirun -n ", ndp, " or change --mesh");
  Options opts = o;
  opts.model.batch = weft::parallel::local_microbatch(o.batch, std::size_t(ndp), o.microbatches);
  opts.model.validate();
  weft::Mesh<weft::DP> mesh(env.world(), ndp);
  // BLAS threads: ranks sharing this node x threads must not exceed its cores.
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int ranks_per_node = 1;
  MPI_Comm_size(node, &ranks_per_node);
  MPI_Comm_free(&node);
  const auto bt = weft::ops::set_blas_threads(int(o.threads), ranks_per_node);

  std::vector<std::uint8_t> bytes = o.data.empty() ? weft::data::synthetic_corpus(o.corpus_bytes, 0) : weft::data::read_corpus(o.data);
  const std::string data_name = o.data.empty() ? "synthetic" : o.data;
  WEFT_REQUIRE(bytes.size() >= o.model.seq + 1, ConfigError, "--data ", data_name, " has ", bytes.size(),
               " bytes, fewer than --seq + 1 = ", o.model.seq + 1, "; use a longer file or a shorter --seq");
  const double unigram = weft::data::unigram_entropy(bytes);
  weft::data::TokenStream stream(bytes, opts.model.seq, opts.model.seed);
  weft::nn::GPT<float, Space> gpt(opts.model);
  weft::parallel::DataParallel<float, Space> dp(mesh.axis<weft::DP>(), gpt.parameter_groups(), opts.dp_options);
  gpt.set_hooks(&dp);
  if (o.optimizer == "adamw") {
    weft::optim::AdamW<float, Space> opt(dp.optimizer_parameters(), {.weight_decay = o.weight_decay});
    return train(opts, gpt, dp, opt, stream, bt, ranks_per_node, unigram, data_name);
  }
  weft::optim::SGD<float, Space> opt(dp.optimizer_parameters(), {.momentum = o.momentum, .weight_decay = o.weight_decay});
  return train(opts, gpt, dp, opt, stream, bt, ranks_per_node, unigram, data_name);
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  try {
    return run(argc, argv, env);
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 2;
  }
}
