// train_gpt: trains the reference GPT on byte-level text -- by default a
// synthetic language generated here, or any text file with --data -- and
// prints one line per step; with --record FILE it writes a JSON run record
// (config, mesh, per-step losses, tokens/s, model FLOPs, MFU, memory).
//
//   mpirun -n 1 train_gpt --layers 4 --d-model 128 --heads 4 --seq 64 --batch 8 --steps 300 --record run.json
//
// --batch is the global batch (sequences per optimizer step); --microbatches
// splits it for gradient accumulation, and --mesh dp=N splits it over N
// data-parallel ranks (each takes batch / dp sequences): the same command line
// on any mesh trains the same model on the same data.
//
//   mpirun -n 4 train_gpt --mesh dp=4 --dp fsdp --batch 16 --record run.json
//
// --mesh dp=A,pp=B adds pipeline parallelism: B stages of consecutive layers
// run --schedule gpipe|1f1b|interleaved:V|zb over --microbatches, with stage
// boundaries from --stages auto|equal|L1,L2,...
//
//   mpirun -n 4 train_gpt --mesh dp=2,pp=2 --schedule 1f1b --microbatches 4 --stages auto
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
#include <string>
#include <vector>

#include <weft/metrics/metrics.hpp>
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
  int pp = 1;
  std::string schedule = "1f1b", stages = "equal";
  double stage_memory_mb = 0;
  std::string compare;  // a run record whose loss curve this run must follow
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
    "  --mesh dp=N,pp=M  the mesh; axes left out have size 1 (default dp = number of ranks)\n"
    "  --schedule S      pipeline schedule with pp > 1: gpipe, 1f1b, interleaved:V or zb (1f1b)\n"
    "  --stages S        pipeline stage boundaries: auto (measured time and memory), equal, or blocks per stage L1,L2,... (equal)\n"
    "  --stage-memory-mb X  memory limit per stage for --stages auto (0: none)\n"
    "  --dp replicate|zero1|zero2|fsdp  data-parallel mode (replicate)\n"
    "  --bucket-mb X     gradient bucket size of replicate and zero1 in MiB (25)\n"
    "  --no-overlap      reduce gradients after backward instead of during it\n"
    "  --compare FILE    fail unless the loss curve follows FILE's (a --record of another run) to --tolerance\n"
    "  --tolerance X     relative difference allowed per step by --compare (1e-5)\n";

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
int parse_mesh(const std::string& v, int* pp) {
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
    } else if (axis == "pp") {
      *pp = n;
    } else {
      WEFT_REQUIRE(axis == "tp" || axis == "cp" || axis == "ep", ConfigError, "--mesh ", v,
                   ": unknown axis '", axis, "'; the axes are dp, tp, pp, cp, ep");
      WEFT_REQUIRE(n == 1, ConfigError, "--mesh ", v, ": ", axis, "=", n,
                   " is not available in train_gpt yet (data and pipeline parallelism only); use ", axis, "=1 or leave it out");
    }
    start = end + 1;
  }
  WEFT_REQUIRE(dp > 0 || *pp > 1, ConfigError, "--mesh ", v, ": name the data-parallel extent, e.g. --mesh dp=4");
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
      {"--mesh", [&](const std::string& v) { o.dp = parse_mesh(v, &o.pp); }},
      {"--schedule", [&](const std::string& v) { o.schedule = weft::pipeline::parse_schedule(v).name; }},
      {"--stages", [&](const std::string& v) { o.stages = (weft::pipeline::parse_stage_spec(v), v); }},
      {"--stage-memory-mb", [&](const std::string& v) { o.stage_memory_mb = parse_real("--stage-memory-mb", v, false); }},
      {"--compare", [&](const std::string& v) { o.compare = v; }},
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

// The "loss" array of a run record written by --record.
std::vector<double> read_losses(const std::string& path) {
  std::ifstream f(path);
  WEFT_REQUIRE(f.good(), ConfigError, "--compare ", path, ": cannot open the file (", std::strerror(errno), ")");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::size_t key = text.find("\"loss\":");
  const std::size_t open = key == std::string::npos ? key : text.find('[', key);
  const std::size_t close = open == std::string::npos ? open : text.find(']', open);
  WEFT_REQUIRE(close != std::string::npos, ConfigError, "--compare ", path,
               ": no \"loss\" array found; expected a run record written by train_gpt --record");
  std::vector<double> out;
  const char* p = text.c_str() + open + 1;
  const char* end = text.c_str() + close;
  while (p < end) {
    char* next = nullptr;
    const double x = std::strtod(p, &next);
    if (next == p) {
      ++p;  // separators and spaces
      continue;
    }
    out.push_back(x);
    p = next;
  }
  WEFT_REQUIRE(!out.empty(), ConfigError, "--compare ", path, ": the \"loss\" array is empty");
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// --compare: 0 when the loss curve follows the reference record, 3 otherwise.
int compare_losses(const Options& o, const std::vector<double>& losses) {
  if (!o.compare.empty()) {
    const auto ref = read_losses(o.compare);
    WEFT_REQUIRE(ref.size() >= losses.size(), ConfigError, "--compare ", o.compare, " has ", ref.size(),
                 " steps, fewer than the ", losses.size(), " of this run");
    double worst = 0;
    for (std::size_t s = 0; s < losses.size(); ++s) {
      const double rel = std::abs(losses[s] - ref[s]) / std::max(std::abs(ref[s]), 1e-30);
      worst = std::max(worst, rel);
      if (!(rel <= o.tolerance)) {
        std::fprintf(stderr, "train_gpt: error: step %zu loss %.9g differs from %s's %.9g by %.3g relative, more than --tolerance %.3g\n",
                     s, losses[s], o.compare.c_str(), ref[s], rel, o.tolerance);
        return 3;
      }
    }
    std::printf("train_gpt: the loss curve follows %s: max relative difference %.3g over %zu steps (tolerance %.3g)\n",
                o.compare.c_str(), worst, losses.size(), o.tolerance);
  }
  return 0;
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
  for (std::size_t s = 0; s < o.steps; ++s) {
    const double lr = o.warmup > 0 && s < o.warmup ? o.lr * double(s + 1) / double(o.warmup) : o.lr;
    Kokkos::fence();
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = weft::metrics::process_cpu_seconds();
    const auto r = weft::parallel::train_step(gpt, dp, opt, stream, s, o.batch, o.microbatches, ids, tg, lr, o.clip);
    Kokkos::fence();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpus.push_back(weft::metrics::process_cpu_seconds() - c0);
    walls.push_back(wall);
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
  const std::size_t skip = o.steps > 1 ? std::min<std::size_t>(5, std::max<std::size_t>(1, o.steps / 10)) : 0;
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
  Kokkos::View<double*, Kokkos::HostSpace> mine("mine", 5), all("all", 5 * std::size_t(ndp));
  for (int k = 0; k < 5; ++k) mine(std::size_t(k)) = double(ledger.bytes(cats[k]));
  comm.all_gather(mine, all);
  const weft::CommStats stats = comm.stats();
  if (!root) return 0;
  std::printf("train_gpt: final loss %.4f (unigram entropy of the data %.4f); %.0f tok/s, %.2f GFLOP/s of model FLOPs, MFU %.3f\n",
              losses.back(), unigram, tps, flops_per_token * tps * 1e-9, mfu);

  if (!o.record.empty()) {
    using weft::metrics::Json;
    Json memory = Json::object();
    for (int k = 0; k < 5; ++k) memory.set(weft::metrics::category_name(cats[k]), Json(std::size_t(mine(std::size_t(k)))));
    memory.set("total", Json(ledger.total()));
    memory.set("note", "rank 0: bytes weft allocates, all at start-up and kept for the run, except fsdp/zero2 gathered groups counted at their peak under buffers; BLAS and MPI buffers not included");
    Json::Array per_rank;
    for (int r = 0; r < ndp; ++r) {
      Json m = Json::object();
      for (int k = 0; k < 5; ++k) m.set(weft::metrics::category_name(cats[k]), Json(std::size_t(all(std::size_t(5 * r + k)))));
      per_rank.push_back(m);
    }
    Json collectives = Json::object();
    for (int k = 0; k < weft::comm_kind_count; ++k) {
      const auto& ks = stats[static_cast<weft::CommKind>(k)];
      if (ks.calls == 0) continue;
      collectives.set(std::string(weft::to_string(static_cast<weft::CommKind>(k))),
                      Json::object().set("calls", Json(std::size_t(ks.calls))).set("bytes", Json(std::size_t(ks.bytes)))
                          .set("seconds", ks.seconds).set("exposed_seconds", ks.exposed_seconds));
    }
    Json rec = Json::object();
    rec.set("program", "train_gpt").set("weft_version", WEFT_VERSION_STRING);
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
                           .set("blas_threads", bt.threads).set("blas_threads_reason", bt.reason)
                           .set("ranks_per_node", ranks_per_node));
    rec.set("tokens_per_step", Json(tokens_per_step));
    rec.set("loss", Json(losses));
    rec.set("grad_norm", Json(norms));
    rec.set("step_seconds", Json(walls));
    rec.set("warmup_steps_excluded", Json(skip));
    rec.set("tokens_per_second", tps);
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
    rec.set("mfu_cpu_time", flops_per_token * tps_cpu / peak.cpu);
    rec.set("memory_bytes", memory);
    rec.set("memory_bytes_per_rank", Json(per_rank));
    rec.set("collectives", collectives);
    rec.set("collectives_note", "dp axis, rank 0, all steps: bytes as nccl-tests' size; exposed = time the rank was blocked");
    rec.set("unigram_entropy", unigram);
    std::ofstream f(o.record);
    WEFT_REQUIRE(f.good(), ConfigError, "--record ", o.record, ": cannot open the file for writing (", std::strerror(errno), ")");
    f << rec.dump() << "\n";
    WEFT_REQUIRE(f.good(), ConfigError, "--record ", o.record, ": writing failed");
    std::printf("train_gpt: run record written to %s\n", o.record.c_str());
  }
  return compare_losses(o, losses);
}

// The pipeline path (--mesh ...,pp=B with B > 1): a Stage of this rank's
// layers, data parallelism over the DP axis, the schedule's executor over the
// PP axis. Prints one line per step; --record and --compare as for dp only.
template <class Opt>
int train_pipeline(const Options& o, weft::pipeline::Executor<float, Space>& ex,
                   weft::parallel::DataParallel<float, Space>& dp, Opt& opt, const weft::data::TokenStream& stream,
                   const weft::ops::BlasThreads& bt, weft::Comm& world, const std::string& stages,
                   const std::string& data_name) {
  const auto& c = ex.stage().config();
  const bool root = world.rank() == 0;
  const int npp = ex.comm().size(), ndp = dp.comm().size();
  const std::size_t tokens_per_step = o.batch * c.seq;
  const double bubble = ex.schedule().bubble(npp, ex.microbatches(), {});
  if (root) {
    std::printf("train_gpt: mesh dp=%d (%s) x pp=%d, schedule %s, %d microbatches of %zu sequences per dp rank, "
                "stages (blocks per virtual stage) %s, analytic bubble %.3f, data %s\n",
                ndp, weft::parallel::to_string(dp.mode()), npp, ex.schedule().name.c_str(), ex.microbatches(), c.batch,
                stages.c_str(), bubble, data_name.c_str());
    std::printf("train_gpt: BLAS threads %d (%s)\n", bt.threads, bt.reason.c_str());
  }
  std::fflush(stdout);
  std::vector<double> losses, norms, walls;
  for (std::size_t s = 0; s < o.steps; ++s) {
    const double lr = o.warmup > 0 && s < o.warmup ? o.lr * double(s + 1) / double(o.warmup) : o.lr;
    Kokkos::fence();
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = weft::pipeline::train_step(ex, &dp, opt, stream, s, o.batch, lr, o.clip);
    Kokkos::fence();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    walls.push_back(wall);
    losses.push_back(r.loss);
    norms.push_back(r.grad_norm);
    if (root)
      std::printf("step %zu loss %.4f tok/s %.0f grad_norm %.4f lr %.3g ms %.1f\n", s, r.loss,
                  double(tokens_per_step) / wall, r.grad_norm, lr, wall * 1e3);
    std::fflush(stdout);
  }
  const std::size_t skip = o.steps > 1 ? std::min<std::size_t>(5, std::max<std::size_t>(1, o.steps / 10)) : 0;
  const double tps = double(tokens_per_step) / median(std::vector<double>(walls.begin() + long(skip), walls.end()));
  if (!root) return 0;
  std::printf("train_gpt: final loss %.4f; %.0f tok/s\n", losses.back(), tps);
  if (!o.record.empty()) {
    using weft::metrics::Json;
    Json rec = Json::object();
    rec.set("program", "train_gpt").set("weft_version", WEFT_VERSION_STRING);
    rec.set("config", Json::object()
                          .set("layers", Json(c.layers)).set("d_model", Json(c.d_model)).set("heads", Json(c.heads))
                          .set("seq", Json(c.seq)).set("batch", Json(o.batch)).set("microbatches", Json(o.microbatches))
                          .set("microbatch", Json(c.batch)).set("vocab", Json(c.vocab)).set("steps", Json(o.steps))
                          .set("lr", o.lr).set("optimizer", o.optimizer).set("clip", o.clip).set("seed", Json(c.seed))
                          .set("data", data_name).set("dtype", "float32"));
    rec.set("mesh", Json::object().set("dp", ndp).set("tp", 1).set("pp", npp).set("cp", 1).set("ep", 1)
                        .set("world_size", ndp * npp).set("dp_mode", weft::parallel::to_string(dp.mode()))
                        .set("schedule", ex.schedule().name).set("stages", stages).set("bubble_analytic", bubble));
    rec.set("tokens_per_step", Json(tokens_per_step));
    rec.set("loss", Json(losses));
    rec.set("grad_norm", Json(norms));
    rec.set("step_seconds", Json(walls));
    rec.set("warmup_steps_excluded", Json(skip));
    rec.set("tokens_per_second", tps);
    std::ofstream f(o.record);
    WEFT_REQUIRE(f.good(), ConfigError, "--record ", o.record, ": cannot open the file for writing (", std::strerror(errno), ")");
    f << rec.dump() << "\n";
    std::printf("train_gpt: run record written to %s\n", o.record.c_str());
  }
  return compare_losses(o, losses);
}

int run_pipeline(const Options& o, weft::Environment& env, int ndp, const weft::data::TokenStream& stream,
                 const weft::ops::BlasThreads& bt, const std::string& data_name) {
  weft::Mesh<weft::DP, weft::PP> mesh(env.world(), {.dp = ndp, .pp = o.pp});
  const auto sched = weft::pipeline::parse_schedule(o.schedule);
  sched.check(o.pp, int(o.microbatches));
  const std::size_t L = o.model.layers, S = std::size_t(o.pp * sched.chunks);
  const auto spec = weft::pipeline::parse_stage_spec(o.stages);
  weft::pipeline::StagePartition part;
  if (spec.kind == weft::pipeline::StageSpec::Kind::equal) {
    part = weft::pipeline::equal_partition(L, S);
  } else if (spec.kind == weft::pipeline::StageSpec::Kind::explicit_counts) {
    WEFT_REQUIRE(spec.counts.size() == S, ConfigError, "--stages ", o.stages, ": ", spec.counts.size(),
                 " block counts, but pp=", o.pp, " x ", sched.chunks, " chunks per rank (", sched.name, ") = ", S,
                 " virtual stages; give one count per virtual stage");
    part = weft::pipeline::partition_from_counts(L, spec.counts);
  } else {
    // Rank 0 measures every unit alone (the others wait), then all ranks use its figures.
    const std::size_t n = weft::pipeline::unit_count(L);
    Kokkos::View<double*, Kokkos::HostSpace> costs("unit_costs", 2 * n);
    if (env.world().rank() == 0) {
      const double in_flight = double(sched.peak_in_flight(o.pp, int(o.microbatches), 0)) / double(sched.chunks);
      const auto u = weft::pipeline::measure_unit_costs<float, Space>(o.model, 3, in_flight);
      for (std::size_t i = 0; i < n; ++i) {
        costs(2 * i) = u[i].seconds;
        costs(2 * i + 1) = u[i].bytes;
      }
    }
    env.world().broadcast(costs, 0);
    std::vector<weft::pipeline::UnitCost> u(n);
    for (std::size_t i = 0; i < n; ++i) u[i] = {costs(2 * i), costs(2 * i + 1)};
    part = weft::pipeline::balanced_partition(u, S, o.stage_memory_mb * 1048576.0);
    if (env.world().rank() == 0) {
      std::printf("train_gpt: --stages auto: unit ms (embedding, blocks, head):");
      for (const auto& x : u) std::printf(" %.2f", x.seconds * 1e3);
      std::printf("; slowest stage %.2f ms (equal: %.2f ms)\n", weft::pipeline::slowest_stage(part, u) * 1e3,
                  weft::pipeline::slowest_stage(weft::pipeline::equal_partition(L, S), u) * 1e3);
    }
  }
  weft::pipeline::Stage<float, Space> stage(o.model, part, o.pp, mesh.coord<weft::PP>(), sched.chunks);
  weft::parallel::DataParallel<float, Space> dp(mesh.axis<weft::DP>(), stage.parameter_groups(), o.dp_options);
  stage.set_hooks(&dp);
  weft::pipeline::Executor<float, Space> ex(stage, mesh.axis<weft::PP>(), sched, int(o.microbatches));
  const std::string stages = part.to_string(L);
  if (o.optimizer == "adamw") {
    weft::optim::AdamW<float, Space> opt(dp.optimizer_parameters(), {.weight_decay = o.weight_decay});
    return train_pipeline(o, ex, dp, opt, stream, bt, env.world(), stages, data_name);
  }
  weft::optim::SGD<float, Space> opt(dp.optimizer_parameters(), {.momentum = o.momentum, .weight_decay = o.weight_decay});
  return train_pipeline(o, ex, dp, opt, stream, bt, env.world(), stages, data_name);
}

int run(int argc, char** argv, weft::Environment& env) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  const Options o = parse(argc, argv);
  const int world = env.world().size();
  const int ndp = o.dp == 0 ? world / o.pp : o.dp;
  if (o.pp > 1)
    WEFT_REQUIRE(ndp * o.pp == world, ConfigError, "--mesh dp=", ndp, ",pp=", o.pp, " needs ", ndp * o.pp,
                 " ranks, but train_gpt was started on ", world, "; launch it with mpirun -n ", ndp * o.pp, " or change --mesh");
  WEFT_REQUIRE(ndp * o.pp == world, ConfigError, "--mesh dp=", ndp, " needs ", ndp, " ranks, but train_gpt was started on ",
               world, "; launch it with mpirun -n ", ndp, " or change --mesh");
  Options opts = o;
  opts.model.batch = weft::parallel::local_microbatch(o.batch, std::size_t(ndp), o.microbatches);
  opts.model.validate();
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
  if (o.pp > 1) return run_pipeline(opts, env, ndp, stream, bt, data_name);
  weft::Mesh<weft::DP> mesh(env.world(), ndp);
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
