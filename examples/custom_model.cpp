// custom_model: a model that is not a GPT, trained with weft's strategies.
// A stack of residual MLP blocks (x + W2 f(W1 x + b1) + b2, f = gelu in even
// blocks and silu in odd ones: two block kinds in one model) between a
// linear input projection and a linear regression head with a mean squared
// error, learning a fixed random function of synthetic inputs drawn from a
// seed. The blocks are the user's own layers: they meet nn::Layer (and
// nn::SplitBackwardLayer, so zero-bubble schedules run them), their MLPs are
// tensor-parallel through the placed Linear layers, and the same code runs
// data-parallel in every mode, pipelined under every schedule, and both:
//
//   mpirun -n 8 custom_model --mesh dp=2,pp=2,tp=2 --dp fsdp --schedule zb --steps 8 --record run.json
//
// The same flags with any other --mesh train the same model on the same data:
// --batch is the global batch, parameters depend only on the seed and their
// global indices. --baseline FILE compares the loss curve with another run's
// --record and fails when they differ by more than --tolerance. The steps run
// through weft::TrainLoop (weft/train_loop.hpp), the parity and the record
// through weft/parity.hpp: the toolkit a user's program is built from.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/weft.hpp>
#include <weft/core/flags.hpp>
#include <weft/nn/chain.hpp>
#include <weft/nn/one_of.hpp>
#include <weft/parity.hpp>
#include <weft/train_loop.hpp>

namespace {

using T = float;
using Space = Kokkos::DefaultExecutionSpace;
using Matrix = weft::ops::Matrix<T, Space>;
using Param = weft::nn::Parameter<T, Space>;
using MeshT = weft::Mesh<weft::DP, weft::PP, weft::TP>;
using weft::ConfigError;

// The model's sizes; `samples` is the microbatch on each rank.
struct Sizes {
  std::size_t in = 8, width = 32, hidden = 64, out = 4, blocks = 4, samples = 4;
  std::uint64_t seed = 7;
};

// One microbatch of data: inputs [samples, in], targets [samples, out].
struct Batch {
  Matrix x, y;
};

// The input projection: data into the residual stream (a plain, replicated Linear).
class InputProjection {
 public:
  using value_type = T;
  using execution_space = Space;
  explicit InputProjection(const Sizes& z)
      : ctx_(std::make_shared<weft::nn::LayerContext>()), lin_(ctx_, "input", z.in, z.width, true, z.seed, 0.35) {}
  void forward(const Batch& b, const Matrix& x0) { lin_.forward(b.x, x0); }
  void backward(const Batch& b, const Matrix& dx0) { lin_.backward(b.x, dx0, Matrix()); }
  void collect(std::vector<Param*>& ps) { lin_.collect(ps); }

 private:
  weft::nn::ContextPtr ctx_;
  weft::nn::Linear<T, Space> lin_;
};

// A residual MLP block, its two matrices split over TP (column- then
// row-parallel): y = x + all_reduce(f(x W1 + b1) W2) + b2, with the
// activation f a chain step (weft::nn::Gelu or weft::nn::Silu). It is
// declared as a sequence of placed steps (weft::nn::Chain): the
// column-parallel up projection, f on its Shard<1> output, the row-parallel
// down projection and the all-reduce of its Partial<Sum> output;
// nn::Residual adds the skip. Backward, and the split backward of
// zero-bubble schedules, are generated from the sequence: nothing of it is
// written here.
template <class Act>
class ResidualMLP {
  using Up = weft::nn::Linear<T, weft::On<weft::TP, weft::Shard<0>>>;
  using Down = weft::nn::Linear<T, weft::On<weft::TP, weft::Shard<1>>>;
  using Rep = weft::DistView<T, 2, weft::On<weft::TP, weft::Replicate>>;
  using Body = weft::nn::Chain<Rep, Up, Act, Down, weft::nn::Reduce<weft::TP>>;

 public:
  using value_type = T;
  using execution_space = Space;
  // What forward keeps for backward: the steps' inputs (the tensors the
  // placed Linear and gelu return; empty until the first forward).
  using Saved = typename Body::Saved;

  ResidualMLP(MeshT& mesh, std::size_t index, const Sizes& z)
      : mesh_(&mesh), width_(z.width),
        f_(Body(Up(mesh, z.width, z.hidden, {"block." + std::to_string(index) + ".up", true, z.seed, 0.15}),
                Act{},
                Down(mesh, z.hidden, z.width, {"block." + std::to_string(index) + ".down", true, z.seed, 0.05}),
                weft::nn::Reduce<weft::TP>{})) {}

  Saved make_saved(std::size_t) const { return {}; }
  std::size_t saved_bytes(const Saved& s) const { return f_.body().saved_bytes(s); }

  void forward(const Matrix& x, const Matrix& y, Saved& s) { f_.forward(rep(x), rep(y), s); }
  void backward(const Matrix&, const Matrix& dy, const Matrix& dx, Saved& s) { f_.backward(rep(dy), rep(dx), s); }
  // The split backward: dx now, the weight gradients' gemms queued on `work`.
  void backward_input(const Matrix&, const Matrix& dy, const Matrix& dx, Saved& s, weft::nn::DeferredWork& work) {
    f_.defer_weight_gradients(&work);
    f_.backward(rep(dy), rep(dx), s);
    f_.defer_weight_gradients(nullptr);
  }

  void collect(std::vector<Param*>& ps) { f_.collect(ps); }

 private:
  // A rank's [rows, width] block as the Replicate tensor it is over TP.
  Rep rep(const Matrix& m) const { return Rep(*mesh_, {m.extent(0), width_}, m); }
  MeshT* mesh_;
  std::size_t width_;
  weft::nn::Residual<Body> f_;
};

// The regression head: pred = x W + b; loss term per sample mean_k (pred_k - y_k)^2.
class RegressionHead {
 public:
  using value_type = T;
  using execution_space = Space;
  struct Saved {
    Matrix g;  // the prediction, then grad_scale * d(sum of loss terms)/d(pred)
  };
  explicit RegressionHead(const Sizes& z)
      : ctx_(std::make_shared<weft::nn::LayerContext>()), lin_(ctx_, "head", z.width, z.out, true, z.seed, 0.05), out_(z.out) {}
  Saved make_saved(std::size_t rows) const { return {Matrix("head.pred", rows, out_)}; }
  std::size_t saved_bytes(const Saved& s) const { return s.g.span() * sizeof(T); }
  double forward(const Matrix& x, const Batch& b, Saved& s, double grad_scale) {
    lin_.forward(x, s.g);
    auto g = s.g;
    auto y = b.y;
    const double k = double(out_);
    const T c = T(2.0 * grad_scale / k);
    double sum = 0;
    Kokkos::parallel_reduce(
        "custom_model.mse", Kokkos::MDRangePolicy<Space, Kokkos::Rank<2>>({0, 0}, {g.extent(0), g.extent(1)}),
        KOKKOS_LAMBDA(std::size_t i, std::size_t j, double& acc) {
          const T e = g(i, j) - y(i, j);
          acc += double(e) * double(e) / k;
          g(i, j) = c * e;
        },
        sum);
    return sum;
  }
  void backward(const Matrix& x, Saved& s, const Matrix& dx) { lin_.backward(x, s.g, dx); }
  void collect(std::vector<Param*>& ps) { lin_.collect(ps); }

 private:
  weft::nn::ContextPtr ctx_;
  weft::nn::Linear<T, Space> lin_;
  std::size_t out_;
};

// The model: what weft::pipeline::LayerStage builds its chunks from.
class ResidualMLPModel {
 public:
  using value_type = T;
  using execution_space = Space;
  using Input = InputProjection;
  // Two block kinds in one model: even blocks GELU, odd blocks SiLU.
  using Block = weft::nn::OneOf<ResidualMLP<weft::nn::Gelu>, ResidualMLP<weft::nn::Silu>>;
  using Head = RegressionHead;
  using Batch = ::Batch;

  ResidualMLPModel(MeshT& mesh, const Sizes& z)
      : mesh_(&mesh), z_(z), tp_(mesh.extent<weft::TP>() > 1 ? &mesh.axis<weft::TP>() : nullptr) {}
  std::size_t blocks() const { return z_.blocks; }
  std::size_t rows() const { return z_.samples; }
  std::size_t width() const { return z_.width; }
  std::size_t microbatch_samples() const { return z_.samples; }
  std::size_t loss_terms_per_sample() const { return 1; }
  std::unique_ptr<Input> make_input() { return std::make_unique<Input>(z_); }
  std::unique_ptr<Block> make_block(std::size_t i) {
    if (i % 2 == 0) return std::make_unique<Block>(Block::make<ResidualMLP<weft::nn::Gelu>>(*mesh_, i, z_));
    return std::make_unique<Block>(Block::make<ResidualMLP<weft::nn::Silu>>(*mesh_, i, z_));
  }
  std::unique_ptr<Head> make_head() { return std::make_unique<Head>(z_); }
  Batch make_batch() { return {Matrix("batch.x", z_.samples, z_.in), Matrix("batch.y", z_.samples, z_.out)}; }
  weft::Comm* tp_comm() const { return tp_; }

 private:
  MeshT* mesh_;
  Sizes z_;
  weft::Comm* tp_;
};
static_assert(weft::nn::LayeredModel<ResidualMLPModel>);
static_assert(weft::nn::SplitBackwardLayer<ResidualMLPModel::Block>);

// The data: sample g of the run (step * batch + index in the global batch)
// has inputs x ~ N(0, 1) and targets y_k = sin(sum_c A_kc x_c) + x_k / 2,
// all drawn from the seed, so every mesh sees the same samples.
void fill_batch(Batch& b, const Sizes& z, std::uint64_t first_sample) {
  auto x = Kokkos::create_mirror_view(b.x);
  auto y = Kokkos::create_mirror_view(b.y);
  for (std::size_t i = 0; i < x.extent(0); ++i) {
    const std::uint64_t g = first_sample + i;
    for (std::size_t c = 0; c < z.in; ++c) x(i, c) = T(weft::ops::Philox(z.seed, 101, g * z.in + c).normal());
    for (std::size_t k = 0; k < z.out; ++k) {
      double u = 0;
      for (std::size_t c = 0; c < z.in; ++c)
        u += weft::ops::Philox(z.seed, 202, k * z.in + c).normal() / std::sqrt(double(z.in)) * double(x(i, c));
      y(i, k) = T(std::sin(u) + 0.5 * double(x(i, k % z.in)));
    }
  }
  Kokkos::deep_copy(b.x, x);
  Kokkos::deep_copy(b.y, y);
}

struct Options {
  int dp = 0, pp = 1, tp = 1;
  std::string dp_mode = "replicate", schedule = "1f1b", record, baseline;
  std::size_t batch = 16, microbatches = 2, steps = 8;
  bool help = false;  // --help: print the usage (world rank 0 alone) and run nothing
  double lr = 3e-3, clip = 1.0, tolerance = 1e-5;
  Sizes z;
};

const char* kUsage =
    "usage: custom_model [flags]\n"
    "  --mesh dp=A,pp=B,tp=C  the mesh; axes left out have size 1 (default dp = ranks / (pp x tp))\n"
    "  --dp MODE              replicate | zero1 | zero2 | fsdp (default replicate)\n"
    "  --schedule S           gpipe | 1f1b | interleaved:2 | zb (default 1f1b; also at pp = 1)\n"
    "  --batch N              global batch in samples (default 16)\n"
    "  --microbatches M       microbatches per step (default 2)\n"
    "  --steps N              optimizer steps (default 8)\n"
    "  --blocks L --width D --hidden H   model sizes (default 4, 32, 64)\n"
    "  --lr X --clip X        AdamW learning rate (3e-3), clipping norm (1.0; 0: none)\n"
    "  --seed N               seed of parameters and data (7)\n"
    "  --record FILE          write the run record (JSON: strategy, losses, memory)\n"
    "  --baseline FILE        compare the loss curve with FILE's, fail beyond --tolerance (1e-5 relative)\n"
    "  --help                 this text\n"
    "Exit status: 0 done; 1 the loss curve departs from --baseline; 2 a refused flag or file; 4 the run diverged\n"
    "(a non-finite loss or gradient norm, or a loss above 4 x its best for 3 steps).\n";

// The flags, through weft::FlagParser: counts are strict integers from 1 to
// 2^40 (weft::parse_integer: a value beyond the range is refused, never
// wrapped), reals finite and non-negative; an unknown flag, a missing value or
// a flag given twice is refused with the fix. Returns o.help = true on --help.
Options parse(int argc, char** argv) {
  Options o;
  weft::FlagParser flags("custom_model");
  flags.usage_text(kUsage)
      .value("--mesh", "dp=A,pp=B,tp=C", "the mesh",
             [&](const std::string& v) {
               const weft::AxisSizes m = weft::parse_mesh_spec("--mesh", v, {"dp", "pp", "tp"});
               if (m.count("dp")) o.dp = m.at("dp");
               if (m.count("pp")) o.pp = m.at("pp");
               if (m.count("tp")) o.tp = m.at("tp");
             })
      .value("--dp", "MODE", "DP mode",
             [&](const std::string& v) { o.dp_mode = weft::parallel::to_string(weft::parallel::parse_dp_mode(v)); })
      .value("--schedule", "S", "pipeline schedule", [&](const std::string& v) { o.schedule = weft::pipeline::parse_schedule(v); })
      .count("--batch", "N", "global batch in samples", o.batch)
      .count("--microbatches", "M", "microbatches per step", o.microbatches)
      .count("--steps", "N", "optimizer steps", o.steps)
      .count("--blocks", "L", "blocks", o.z.blocks)
      .count("--width", "D", "width", o.z.width)
      .count("--hidden", "H", "hidden width", o.z.hidden)
      .real("--lr", "X", "AdamW learning rate", o.lr)
      .real("--clip", "X", "clipping norm", o.clip)
      .count("--seed", "N", "seed", o.z.seed, 0)
      .text("--record", "FILE", "run record", o.record)
      .text("--baseline", "FILE", "loss curve to follow", o.baseline)
      .real("--tolerance", "X", "relative loss difference --baseline allows", o.tolerance);
  o.help = !flags.parse(argc, argv);
  return o;
}

// Trains with the data-parallel policy DPPolicy and the schedule Sched (the
// types the command line selects), on the mesh.
template <class DPPolicy, class Sched>
int train(const Options& o, MeshT& mesh) {
  using S = weft::Strategy<weft::On<weft::DP, DPPolicy>, weft::On<weft::PP, weft::Pipeline<Sched>>,
                           weft::On<weft::TP, weft::TensorParallel<>>>;
  const bool root = mesh.rank_in_mesh() == 0;
  const std::size_t ndp = std::size_t(mesh.extent<weft::DP>()), npp = std::size_t(mesh.extent<weft::PP>());
  Sizes z = o.z;
  z.samples = weft::parallel::local_microbatch(o.batch, ndp, o.microbatches);
  WEFT_REQUIRE(z.hidden % std::size_t(mesh.extent<weft::TP>()) == 0, ConfigError, "--hidden ", z.hidden,
               " does not divide by tp ", mesh.extent<weft::TP>(), "; choose a multiple of tp");
  // Before any step: a bad baseline or an unwritable record path fails at once.
  const weft::LossCurve baseline = o.baseline.empty() ? weft::LossCurve{} : weft::LossCurve::read(o.baseline, o.steps);
  const weft::RecordFile record = root ? weft::RecordFile(o.record) : weft::RecordFile();
  weft::check_outputs_not_inputs({{"--record", o.record}}, {{"--baseline", o.baseline}});

  ResidualMLPModel model(mesh, z);
  const auto part = weft::pipeline::equal_partition(z.blocks, npp * std::size_t(Sched::chunks));
  weft::pipeline::LayerStage<ResidualMLPModel> stage(model, part, int(npp), mesh.coord<weft::PP>(), Sched::chunks);
  weft::parallel::DataParallelOf<T, S> dp(mesh, stage);  // checks S against the mesh and the model
  stage.set_hooks(&dp);
  weft::optim::AdamW<T, Space> opt(dp.optimizer_parameters());
  weft::pipeline::Executor ex(stage, mesh.axis<weft::PP>(), weft::Pipeline<Sched>(int(npp), int(o.microbatches)));
  if (root)
    std::printf("custom_model: %s\ncustom_model: mesh dp=%zu,pp=%zu,tp=%d; %zu blocks of width %zu (hidden %zu), global batch %zu in %zu microbatches\n",
                S::name().c_str(), ndp, npp, mesh.extent<weft::TP>(), z.blocks, z.width, z.hidden, o.batch, o.microbatches);
  // The toolkit's run loop: one line per step, Kokkos events over the first
  // steps, and a stop with a message at a non-finite or runaway loss.
  weft::TrainLoop loop({.program = "custom_model", .steps = o.steps, .print = root});
  loop.set_fixes([&](double lr) {
    return "try a smaller --lr (now " + weft::number_text(lr) + ") or a smaller --clip (now " + weft::number_text(o.clip) + ")";
  });
  const weft::TrainLoopRun run = loop.run(
      [&](std::size_t) { return o.lr; },
      [&](std::size_t step, double lr) {
        return weft::pipeline::train_step_with(ex, &dp, opt, o.batch, lr, o.clip,
                                               [&](std::size_t i, std::size_t first, std::size_t) {
                                                 fill_batch(stage.batch(i), z, step * o.batch + first);
                                               });
      },
      [](std::size_t, const weft::optim::StepResult&) {}, [](std::size_t, const weft::optim::StepResult&) { return ""; });
  if (!run.diverged.empty()) {
    if (root) std::fprintf(stderr, "custom_model: error: %s\n", run.diverged.c_str());
    return 4;
  }
  const std::vector<double>& losses = run.losses;
  const std::vector<double>& norms = run.norms;
  weft::metrics::MemoryLedger ledger;
  using C = weft::metrics::MemoryCategory;
  const auto stage_memory = stage.memory();
  for (const auto& item : stage_memory.items())  // parameters and gradients are owned by the data-parallel engine
    if (item.category != C::parameters && item.category != C::gradients) ledger.add(item.category, item.label, item.bytes);
  ledger.merge(dp.memory());
  ledger.merge(opt.memory());
  int status = 0;
  weft::Parity parity;
  if (baseline.active()) {
    parity = baseline.compare(losses, o.tolerance);
    status = parity.follows() ? 0 : 1;
    if (root) std::printf("%s\n", parity.line("custom_model", baseline.file).c_str());
  }
  if (record.active()) {
    using weft::metrics::Json;
    Json mem = Json::object();
    for (C c : {C::parameters, C::gradients, C::optimizer_state, C::activations, C::buffers})
      mem.set(weft::metrics::category_name(c), Json(std::size_t(ledger.bytes(c))));
    Json rec = Json::object();
    rec.set("example", "custom_model")
        .set("strategy", S::name())
        .set("mesh", Json::object().set("dp", Json(int(ndp))).set("pp", Json(int(npp))).set("tp", mesh.extent<weft::TP>()))
        .set("dp_mode", o.dp_mode)
        .set("schedule", weft::pipeline::schedule_name<Sched>())
        .set("batch", Json(o.batch))
        .set("microbatches", Json(o.microbatches))
        .set("steps", Json(o.steps))
        .set("loss", losses)
        .set("grad_norm", norms)
        .set("memory_rank0", mem);
    rec.set("loss_parity", baseline.active() ? parity.json(baseline.file) : Json(nullptr));
    record.write(rec);
  }
  return status;
}

// The table of compiled strategies: every --dp mode with every --schedule.
template <class DPPolicy>
int with_schedule(const Options& o, MeshT& mesh) {
  if (o.schedule == "gpipe") return train<DPPolicy, weft::GPipe>(o, mesh);
  if (o.schedule == "1f1b") return train<DPPolicy, weft::OneFOneB>(o, mesh);
  if (o.schedule == "interleaved:2") return train<DPPolicy, weft::Interleaved1F1B<2>>(o, mesh);
  if (o.schedule == "zb") return train<DPPolicy, weft::ZeroBubble>(o, mesh);
  throw ConfigError("--schedule " + o.schedule +
                    ": not compiled into custom_model; the compiled schedules are gpipe, 1f1b, interleaved:2 and zb");
}

int run(const Options& o, weft::Environment& env) {
  const int world = env.world().size();
  {
    // BLAS threads so that the node's ranks x threads do not outnumber its cores, and what that gives.
    const int ranks_per_node = weft::ranks_on_node(MPI_COMM_WORLD);
    const auto bt = weft::ops::set_blas_threads(0, ranks_per_node);
    weft::ops::print_host_threads("custom_model", env.world().rank(), weft::ops::host_binding(bt.threads, ranks_per_node));
  }
  WEFT_REQUIRE(world % (o.pp * o.tp) == 0, ConfigError, "--mesh pp=", o.pp, ",tp=", o.tp, ": ", world,
               " ranks do not divide by pp x tp = ", o.pp * o.tp);
  const int ndp = o.dp ? o.dp : world / (o.pp * o.tp);
  MeshT mesh(env.world(), {.dp = ndp, .pp = o.pp, .tp = o.tp});
  using weft::parallel::DPMode;
  switch (weft::parallel::parse_dp_mode(o.dp_mode)) {
    case DPMode::replicate: return with_schedule<weft::Replicated>(o, mesh);
    case DPMode::zero1: return with_schedule<weft::ZeRO<1>>(o, mesh);
    case DPMode::zero2: return with_schedule<weft::ZeRO<2>>(o, mesh);
    case DPMode::fsdp: return with_schedule<weft::FullyShard>(o, mesh);
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  try {
    const Options o = parse(argc, argv);
    if (o.help) {  // once, not once per rank
      if (env.world().rank() == 0) std::fputs(kUsage, stdout);
      return 0;
    }
    return run(o, env);
  } catch (const weft::Error& e) {
    if (env.world().rank() == 0) std::fprintf(stderr, "custom_model: error: %s\n", e.what());
    return 2;
  }
}
