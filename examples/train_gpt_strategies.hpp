// train_gpt's flags and the table of compiled strategies they select, in
// one place: Options (every flag's value), kUsage (the text --help prints),
// parse (the flags through weft::FlagParser, then the checks between flags),
// pick_strategy (the flags to one compiled weft::Strategy type) and the parts
// the table is compiled in (Part, part_of, in_part). A run-time flag selects
// a compiled strategy type here and nowhere else. The checks before step 0,
// the training run and run_part<P> are in train_gpt_impl.hpp; the program is
// train_gpt.cpp.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <type_traits>

#include <weft/core/flags.hpp>
#include <weft/core/parse.hpp>
#include <weft/parity.hpp>
#include <weft/weft.hpp>

#include "train_gpt_checkpoint.hpp"
#include "train_gpt_checks.hpp"

namespace train_gpt {

using weft::ConfigError;

// ---------------------------------------------------------------------------
// The flags.

struct Options {
  weft::nn::GPTConfig model;
  std::size_t batch = 8, microbatches = 1, steps = 200, threads = 0, corpus_bytes = 2000000;
  double lr = 1e-3, weight_decay = 0.1, clip = 1.0, momentum = 0.9;
  std::size_t warmup = 0;
  std::string data, record, optimizer = "adamw";
  int dp = 0;  // 0: the world size / (tp x pp)
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;  // expert parallelism: the MoE blocks' experts over ep ranks (folded over DP)
  std::string precision = "fp32";  // --precision: the operand type of the weight products (fp32, bf16, fp16)
  double loss_scale = 65536;       // --loss-scale: fp16's initial dynamic loss scale
  bool loss_scale_given = false;
  std::string context = "ring";  // --context: the CP variant (ring, allgather, alltoall), a compiled type each
  bool sequence_parallel = false;
  std::string schedule = "1f1b", stages = "equal";
  double stage_memory_mb = 0;
  std::string compare;  // a run record whose loss curve this run must follow (--baseline, alias --compare)
  weft::LossCurve baseline;  // --baseline's curve: read (and checked) by rank 0 before step 0; empty on other ranks
  bool check_only = false;  // --check: validate the flags and exit without training
  double tolerance = 1e-5;
  double divergence_factor = 4.0;  // --divergence-factor: stop when the loss stays above this x its best so far (0: off)
  std::size_t divergence_window = 3;  // --divergence-window: ... for this many consecutive steps
  weft::parallel::DPMode dp_mode = weft::parallel::DPMode::replicate;  // --dp: selects the compiled DP policy type
  weft::parallel::DPOptions dp_options;
  double memory_limit = 0;  // --memory-limit: per-rank bytes (0: MemAvailable, or a GPU's free memory, shared by its ranks)
  train_gpt_checkpoint::Flags ckpt;  // --checkpoint, --save-every, --keep, --resume
};

inline constexpr const char* kUsage =
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
    "  --attention K     attention over whole sequences: auto (BLAS products, or the blockwise kernel when the\n"
    "                    [T, T] probabilities would not fit in the memory limit), blas or blockwise (auto)\n"
    "  --experts N       mixture of experts: N routed experts in every --moe-every-th block (0: dense); with\n"
    "                    --mesh ep=E > 1 (N = 4 or 8) each EP rank holds N / E of them (docs/moe.md)\n"
    "  --top-k K (2), --capacity-factor C | --dropless (dropless), --router softmax|sigmoid (softmax),\n"
    "  --aux-loss A (0), --z-loss Z (0), --bias-balance G (0), --moe-every K (1), --shared-experts N (0),\n"
    "  --expert-hidden N (the MLP's width)   see docs/moe.md\n"
    "  --seed N          initialisation and data order (1234)\n"
    "  --data FILE       train on the bytes of FILE (default: synthetic language)\n"
    "  --threads N       BLAS threads per rank (default: cores / (ranks on the node x Kokkos host threads))\n"
    "  --record FILE     write a JSON run record\n"
    "  --mesh dp=A,tp=B,pp=C,cp=D,ep=E  the mesh; axes left out have size 1 (default dp = ranks / (tp x pp x cp x ep));\n"
    "                    with pp and tp both, each stage's layers are split over tp; cp splits every sequence;\n"
    "                    ep splits the MoE experts and takes its own share of the batch (EP folded over DP)\n"
    "  --context V       context parallelism with cp > 1: ring, allgather or alltoall (ring)\n"
    "  --sequence-parallel  with tp > 1: norms and residuals on token shards (all-gather/reduce-scatter)\n"
    "  --schedule S      pipeline schedule with pp > 1: gpipe, 1f1b, interleaved:V or zb (1f1b)\n"
    "  --stages S        pipeline stage boundaries: auto (measured time and memory), equal, or blocks per stage L1,L2,... (equal)\n"
    "  --stage-memory-mb X  memory limit per stage for --stages auto (0: none)\n"
    "  --dp replicate|zero1|zero2|fsdp  data-parallel mode (replicate)\n"
    "  --precision fp32|bf16|fp16  the weight products' operand type (fp32): bf16 and fp16 round weights and\n"
    "                    activations to 2 bytes for every Linear product and accumulate in fp32\n"
    "                    (weft::Precision<BF16>, weft::Precision<FP16, F32, DynamicLossScale>); weights,\n"
    "                    optimizer state, activations and reductions stay fp32. fp16 scales the loss\n"
    "                    dynamically: a step whose gradients overflow is skipped and halves the scale (after\n"
    "                    2 such steps in a row), 1000 clean steps double it. Compiled for meshes of dp, tp\n"
    "                    and cp (no pp, no ep)\n"
    "  --loss-scale X    fp16: the initial loss scale (65536 = 2^16)\n"
    "  --bucket-mb X     gradient bucket size of replicate and zero1 in MiB (25)\n"
    "  --no-overlap      reduce gradients after backward instead of during it\n"
    "  --baseline FILE   loss parity: fail unless the loss curve follows FILE's (a --record of another run)\n"
    "                    to --tolerance; the record gets the comparison (--compare FILE: the same)\n"
    "  --tolerance X     relative difference allowed per step by --baseline (1e-5); needs --baseline\n"
    "  --divergence-factor F, --divergence-window N  stop (exit status 4) when the loss stays above F x its best\n"
    "                    so far for N consecutive steps, even while finite (4, 3; F = 0: off)\n"
    "  --memory-limit X  per-rank memory limit, e.g. 2G or 512M (default: MemAvailable / ranks on the node,\n"
    "                    or on a GPU its free memory / the ranks that share it);\n"
    "                    a run whose estimated peak (weft/plan) exceeds it is refused before anything is allocated\n"
    "  --check           validate the flags (mesh, modes, batch split, files, memory estimate) and exit without training\n"
    "Each flag may be given once, as --flag value or --flag=value; a switch also as --switch=true|false.\n"
    "Integers are range-checked (a value that does not fit is refused, never wrapped). Exit status: 0 done;\n"
    "2 a bad flag or input, found before step 0;\n"
    "3 the loss does not follow --baseline; 4 the run diverged (a non-finite loss or gradient norm, or the loss\n"
    "far above its best: --divergence-factor);\n"
    "5 an allocation failed (the tensor is named).\n";

// Usual ranges of coefficients: a value above `warn` is printed as a warning
// before step 0 (the run goes on: the divergence guard watches it); one
// above `refuse` is refused (nothing sane is that large).
struct CoefficientRange {
  const char* flag;
  double warn, refuse;
  const char* usual;
};
constexpr CoefficientRange kCoefficients[] = {
    {"--weight-decay", 1.0, 1e6, "0 to 1 (typically 0.01 to 0.1)"},
    {"--aux-loss", 1.0, 1e6, "0 to 1 (typically 0.01)"},
    {"--z-loss", 1.0, 1e6, "0 to 1 (typically 0.001)"},
    {"--bias-balance", 1.0, 1e6, "0 to 1 (typically 0.001)"},
};

// The flags (weft::FlagParser): counts are strict integers, from 1 (0 where
// the usage says so) to 2^40 unless a smaller bound is named (no value wraps,
// no product of counts overflows); reals are finite; a flag given twice, an
// unknown flag, a missing value or a stray argument is refused. Then the
// checks between flags.
inline Options parse(int argc, char** argv) {
  using weft::RealSign;
  Options o;
  o.model.d_model = 128;
  o.model.heads = 4;
  o.model.seq = 64;
  weft::FlagParser flags("train_gpt");
  flags.usage_text(std::string(kUsage) + train_gpt_checkpoint::Flags::usage);
  // The model's sizes have weft-plan's largest accepted values (plan::model_field_max).
  flags.count("--layers", "N", "blocks", o.model.layers, 1, std::size_t(1) << 20)
      .count("--d-model", "N", "model width", o.model.d_model, 1, std::size_t(1) << 18)
      .count("--heads", "N", "attention heads", o.model.heads, 1, std::size_t(1) << 18)
      .count("--kv-heads", "N", "key/value heads", o.model.kv_heads, 1, std::size_t(1) << 18)
      .count("--seq", "N", "tokens per sequence", o.model.seq, 1, std::size_t(1) << 24)
      .count("--batch", "N", "global batch", o.batch, 1, std::size_t(1) << 30)
      .count("--microbatches", "M", "microbatches per step", o.microbatches, 1, std::size_t(1) << 30)
      .count("--vocab", "N", "vocabulary", o.model.vocab, 1, std::size_t(1) << 24)
      .count("--steps", "N", "optimizer steps", o.steps)
      .real("--lr", "X", "learning rate", o.lr, RealSign::positive)
      .count("--warmup", "N", "warmup steps", o.warmup, 0)
      .real("--weight-decay", "X", "weight decay", o.weight_decay)
      .real("--momentum", "X", "SGD momentum", o.momentum)
      .real("--clip", "X", "clipping norm", o.clip)
      .count("--seed", "N", "seed", o.model.seed, 0, std::numeric_limits<std::uint64_t>::max())
      .text("--data", "FILE", "training text", o.data)
      .text("--record", "FILE", "run record", o.record)
      .count("--threads", "N", "BLAS threads", o.threads, 1, 65536)
      // --mesh dp=A[,tp=B,pp=C,cp=D,ep=E] (ep: expert parallelism, whose ranks are data ranks too:
      // world = dp x ep x tp x pp x cp); at most 2^24 ranks per axis, weft-plan's largest device count.
      .value("--mesh", "dp=A,tp=B,pp=C,cp=D,ep=E", "the mesh",
             [&](const std::string& v) {
               const weft::AxisSizes m = weft::parse_mesh_spec("--mesh", v, {"dp", "tp", "pp", "cp", "ep"});
               const auto size = [&m](const char* axis, int& dest) {
                 if (m.count(axis)) dest = m.at(axis);
               };
               size("dp", o.dp);
               size("tp", o.tp);
               size("pp", o.pp);
               size("cp", o.cp);
               size("ep", o.ep);
             })
      .choice<std::string>("--context", "CP variant", o.context,
                           {{"ring", "ring"}, {"allgather", "allgather"}, {"alltoall", "alltoall"}})
      .choice<weft::nn::AttentionKernel>("--attention", "attention kernel", o.model.attention,
                                         {{"auto", weft::nn::AttentionKernel::automatic},
                                          {"blas", weft::nn::AttentionKernel::blas},
                                          {"blockwise", weft::nn::AttentionKernel::blockwise}})
      .value("--schedule", "S", "pipeline schedule", [&](const std::string& v) { o.schedule = weft::pipeline::parse_schedule(v); })
      .value("--stages", "SPEC", "pipeline stages", [&](const std::string& v) { o.stages = (weft::pipeline::parse_stage_spec(v), v); })
      .real("--stage-memory-mb", "MB", "memory per stage for --stages auto", o.stage_memory_mb)
      .text("--baseline", "FILE", "the loss curve to follow", o.compare)
      .alias("--compare", "--baseline")
      .value("--memory-limit", "BYTES", "per-rank memory limit",
             [&](const std::string& v) { o.memory_limit = train_gpt_checks::parse_bytes("--memory-limit", v); })
      .real("--tolerance", "X", "loss difference --baseline allows", o.tolerance, RealSign::positive)
      .value("--divergence-factor", "X", "divergence guard's factor",
             [&](const std::string& v) {
               o.divergence_factor = weft::parse_real("--divergence-factor", v);
               WEFT_REQUIRE(o.divergence_factor == 0 || o.divergence_factor > 1, ConfigError, "--divergence-factor ", v,
                            ": expected 0 (off) or a factor above 1 (the loss staying above factor x its best so far)");
             })
      .count("--divergence-window", "N", "divergence guard's window", o.divergence_window)
      .value("--dp", "MODE", "DP mode", [&](const std::string& v) { o.dp_mode = weft::parallel::parse_dp_mode(v); })
      .value("--precision", "P", "operand type of the products",
             [&](const std::string& v) {
               WEFT_REQUIRE(v == "fp32" || v == "bf16" || v == "fp16", ConfigError, "--precision ", v,
                            ": expected fp32, bf16 or fp16");
               o.precision = v;
             })
      .value("--loss-scale", "X", "fp16's initial loss scale",
             [&](const std::string& v) {
               o.loss_scale = weft::parse_real("--loss-scale", v, RealSign::positive);
               WEFT_REQUIRE(o.loss_scale >= 1, ConfigError, "--loss-scale ", v,
                            ": the initial loss scale must be >= 1 (the scale never backs off below 1); 65536 is usual");
               o.loss_scale_given = true;
             })
      .text("--checkpoint", "DIR", "checkpoint root", o.ckpt.dir)
      .count("--save-every", "N", "steps between checkpoints", o.ckpt.save_every)
      .count("--keep", "N", "checkpoints kept", o.ckpt.keep, 0)
      .text("--resume", "PATH", "checkpoint to resume from", o.ckpt.resume)
      .real("--bucket-mb", "MB", "gradient bucket size", o.dp_options.bucket_mb, RealSign::positive)
      .choice<std::string>("--optimizer", "optimizer", o.optimizer, {{"adamw", "adamw"}, {"sgd", "sgd"}})
      .choice<weft::nn::NormKind>("--norm", "normalization", o.model.norm,
                                  {{"layernorm", weft::nn::NormKind::layernorm}, {"rmsnorm", weft::nn::NormKind::rmsnorm}})
      .choice<weft::nn::MlpKind>("--mlp", "MLP", o.model.mlp, {{"gelu", weft::nn::MlpKind::gelu}, {"swiglu", weft::nn::MlpKind::swiglu}})
      // --experts 0: a dense model, as the usage says.
      .count("--experts", "N", "experts per MoE block", o.model.experts, 0, std::size_t(1) << 16)
      .count("--top-k", "K", "experts per token", o.model.top_k, 1, std::size_t(1) << 16)
      .real("--capacity-factor", "X", "expert capacity factor", o.model.capacity_factor, RealSign::positive)
      .choice<weft::nn::RouterKind>("--router", "router", o.model.router,
                                    {{"softmax", weft::nn::RouterKind::softmax}, {"sigmoid", weft::nn::RouterKind::sigmoid}})
      .real("--aux-loss", "X", "load-balancing loss coefficient", o.model.aux_loss)
      .real("--z-loss", "X", "router z-loss coefficient", o.model.z_loss)
      .real("--bias-balance", "X", "bias balancing rate", o.model.bias_balance)
      .count("--moe-every", "K", "every K-th block is MoE", o.model.moe_every)
      .count("--shared-experts", "N", "shared experts", o.model.shared_experts, 0)
      .count("--expert-hidden", "N", "expert hidden width", o.model.expert_hidden)
      .choice<weft::nn::PositionKind>("--pos", "positions", o.model.position,
                                      {{"learned", weft::nn::PositionKind::learned}, {"rotary", weft::nn::PositionKind::rotary}})
      // Switches, as --switch or --switch=true|false (yes/no, on/off, 1/0).
      .toggle("--recompute", "recompute activations", o.model.recompute)
      .toggle("--sequence-parallel", "sequence parallelism", o.sequence_parallel)
      .toggle("--no-overlap", "no communication overlap", [&](bool on) { o.dp_options.overlap = !on; })
      .toggle("--check", "check the flags only", o.check_only)
      .toggle("--dropless", "no token dropped", [&](bool on) { if (on) o.model.capacity_factor = 0; })
      .toggle("--overwrite-checkpoint", "replace another run's checkpoints", o.ckpt.overwrite);
  flags.parse(argc, argv);  // run() answers --help before
  const auto given = [&](const char* f) { return flags.given(f); };
  WEFT_REQUIRE(!(given("--dropless") && given("--capacity-factor")), ConfigError,
               "--dropless and --capacity-factor exclude each other; give one (dropless: no token is dropped)");
  if (o.model.experts == 0)
    for (const char* f : {"--top-k", "--capacity-factor", "--dropless", "--router", "--aux-loss", "--z-loss",
                          "--bias-balance", "--moe-every", "--shared-experts", "--expert-hidden"})
      WEFT_REQUIRE(!given(f), ConfigError, f, " configures mixture-of-experts blocks, but --experts is not given; add --experts N");
  // Flags that only another flag gives a meaning: refused alone, rather than silently ignored.
  WEFT_REQUIRE(!given("--tolerance") || given("--baseline"), ConfigError,
               "--tolerance is the loss difference --baseline allows, but no --baseline is given; add --baseline FILE "
               "(a --record of the run to follow) or drop --tolerance");
  WEFT_REQUIRE(!given("--divergence-window") || o.divergence_factor > 0, ConfigError,
               "--divergence-window with --divergence-factor 0 (the guard is off); give a factor above 1 or drop --divergence-window");
  WEFT_REQUIRE(!given("--stage-memory-mb") || o.stages == "auto", ConfigError,
               "--stage-memory-mb limits the stages --stages auto chooses, but --stages is ", o.stages,
               "; add --stages auto or drop --stage-memory-mb");
  WEFT_REQUIRE(!given("--momentum") || o.optimizer == "sgd", ConfigError,
               "--momentum is SGD's, but --optimizer is ", o.optimizer, "; add --optimizer sgd or drop --momentum");
  // Coefficients far outside any sane range are refused, with the range.
  const std::map<std::string, double> coefficient = {{"--weight-decay", o.weight_decay}, {"--aux-loss", o.model.aux_loss},
                                                     {"--z-loss", o.model.z_loss}, {"--bias-balance", o.model.bias_balance}};
  for (const auto& r : kCoefficients)
    WEFT_REQUIRE(coefficient.at(r.flag) <= r.refuse, ConfigError, r.flag, " ", coefficient.at(r.flag),
                 " is far outside any sane range (usual: ", r.usual, "; refused above ", r.refuse, "); give a value in the usual range");
  WEFT_REQUIRE(o.model.vocab >= 256, ConfigError, "--vocab ", o.model.vocab,
               " is smaller than the 256 byte values of the data; use --vocab 256 or more");
  o.model.validate();
  o.ckpt.validate();
  return o;
}


inline const char* name_of(weft::nn::NormKind k) { return k == weft::nn::NormKind::layernorm ? "layernorm" : "rmsnorm"; }
inline const char* name_of(weft::nn::MlpKind k) { return k == weft::nn::MlpKind::gelu ? "gelu" : "swiglu"; }
inline const char* name_of(weft::nn::PositionKind k) { return k == weft::nn::PositionKind::learned ? "learned" : "rotary"; }

// ---------------------------------------------------------------------------
// The table of compiled strategies. A run-time flag selects among them here
// and nowhere else: --dp picks the DP policy, tp and --sequence-parallel the
// TP policy, --schedule (with pp > 1) the pipeline's. Every DP mode combines
// with every TP choice, with and without each compiled schedule.

// The schedules compiled into train_gpt.
constexpr const char* kCompiledSchedules = "gpipe, 1f1b, interleaved:2, interleaved:4 and zb";
// The routed-expert counts compiled as Experts<N> for --mesh ep=E > 1.
constexpr const char* kCompiledExperts = "4 and 8";

template <class D, class TPPolicy, class Sched>
struct StrategyOf {
  using type = weft::Strategy<weft::On<weft::DP, D>, weft::On<weft::PP, weft::Pipeline<Sched>>, weft::On<weft::TP, TPPolicy>>;
};
// With context parallelism: the same strategy with On<CP, C> after the PP entry (the mesh's order).
template <class S, class C>
struct WithContext {
  using type = S;
};
template <class O, class... E, class V>
struct WithContext<weft::Strategy<O, E...>, weft::Context<V>> {
  using type = weft::Strategy<O, weft::On<weft::CP, weft::Context<V>>, E...>;
};
template <class D, class TPPolicy>
struct StrategyOf<D, TPPolicy, void> {
  using type = weft::Strategy<weft::On<weft::DP, D>, weft::On<weft::TP, TPPolicy>>;
};
template <class D, class Sched>
struct StrategyOf<D, weft::NoPolicy, Sched> {
  using type = weft::Strategy<weft::On<weft::DP, D>, weft::On<weft::PP, weft::Pipeline<Sched>>>;
};
template <class D>
struct StrategyOf<D, weft::NoPolicy, void> {
  using type = weft::Strategy<weft::On<weft::DP, D>>;
};
// --precision bf16 or fp16: the same strategy with the weft::Precision entry Prec last.
template <class S, class Prec>
struct WithPrecision;
template <class... E, class Prec>
struct WithPrecision<weft::Strategy<E...>, Prec> {
  using type = weft::Strategy<E..., Prec>;
};
using FP16Precision = weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale>;

// Calls f(std::type_identity<S>{}) with the compiled strategy the flags name.
template <class F>
int pick_strategy(const Options& o, F&& f) {
  auto with_dp = [&](auto g) -> int {
    switch (o.dp_mode) {
      case weft::parallel::DPMode::replicate: return g(std::type_identity<weft::Replicated>{});
      case weft::parallel::DPMode::zero1: return g(std::type_identity<weft::ZeRO<1>>{});
      case weft::parallel::DPMode::zero2: return g(std::type_identity<weft::ZeRO<2>>{});
      case weft::parallel::DPMode::fsdp: return g(std::type_identity<weft::FullyShard>{});
    }
    return 2;
  };
  auto with_tp = [&](auto g) -> int {
    if (o.tp == 1) return g(std::type_identity<weft::NoPolicy>{});
    if (o.sequence_parallel) return g(std::type_identity<weft::TensorParallel<weft::SequenceParallel>>{});
    return g(std::type_identity<weft::TensorParallel<>>{});
  };
  auto with_schedule = [&](auto g) -> int {
    if (o.pp == 1) return g(std::type_identity<void>{});
    if (o.schedule == "gpipe") return g(std::type_identity<weft::GPipe>{});
    if (o.schedule == "1f1b") return g(std::type_identity<weft::OneFOneB>{});
    if (o.schedule == "interleaved:2") return g(std::type_identity<weft::Interleaved1F1B<2>>{});
    if (o.schedule == "interleaved:4") return g(std::type_identity<weft::Interleaved1F1B<4>>{});
    if (o.schedule == "zb") return g(std::type_identity<weft::ZeroBubble>{});
    weft::detail::throw_error<ConfigError>("--schedule ", o.schedule, ": this schedule is not compiled into train_gpt; the compiled "
                                           "strategies are every --dp mode x (no TP, TP, TP with --sequence-parallel) x (no "
                                           "pipeline, or pp > 1 with --schedule ", kCompiledSchedules, ")");
  };
  auto with_cp = [&](auto g) -> int {
    if (o.cp == 1) return g(std::type_identity<weft::NoPolicy>{});
    if (o.context == "allgather") return g(std::type_identity<weft::Context<weft::AllGather>>{});
    if (o.context == "alltoall") return g(std::type_identity<weft::Context<weft::AllToAll>>{});
    return g(std::type_identity<weft::Context<weft::Ring>>{});
  };
  if (o.ep > 1) {  // expert parallelism: DP x (PP x) EP x TP, no CP or SP (refused before)
    auto with_experts = [&](auto g) -> int {
      if (o.model.experts == 8) return g(std::type_identity<weft::Experts<8>>{});
      return g(std::type_identity<weft::Experts<4>>{});
    };
    return with_dp([&]<class D>(std::type_identity<D>) {
      return with_experts([&]<class X>(std::type_identity<X>) {
        return with_schedule([&]<class Sched>(std::type_identity<Sched>) {
          using E = weft::On<weft::EP, X>;
          if constexpr (std::is_void_v<Sched>) {
            if (o.tp == 1) return f(std::type_identity<weft::Strategy<weft::On<weft::DP, D>, E>>{});
            return f(std::type_identity<weft::Strategy<weft::On<weft::DP, D>, E, weft::On<weft::TP, weft::TensorParallel<>>>>{});
          } else {
            using P = weft::On<weft::PP, weft::Pipeline<Sched>>;
            if (o.tp == 1) return f(std::type_identity<weft::Strategy<weft::On<weft::DP, D>, P, E>>{});
            return f(std::type_identity<
                     weft::Strategy<weft::On<weft::DP, D>, P, E, weft::On<weft::TP, weft::TensorParallel<>>>>{});
          }
        });
      });
    });
  }
  return with_dp([&]<class D>(std::type_identity<D>) {
    return with_tp([&]<class TPPolicy>(std::type_identity<TPPolicy>) {
      return with_schedule([&]<class Sched>(std::type_identity<Sched>) {
        return with_cp([&]<class C>(std::type_identity<C>) {
          using S = typename WithContext<typename StrategyOf<D, TPPolicy, Sched>::type, C>::type;
          // bf16 and fp16 products are compiled for the strategies without a pipeline (checked before step 0)
          if constexpr (std::is_void_v<Sched>) {
            if (o.precision == "bf16") return f(std::type_identity<typename WithPrecision<S, weft::Precision<weft::BF16>>::type>{});
            if (o.precision == "fp16") return f(std::type_identity<typename WithPrecision<S, FP16Precision>::type>{});
          }
          return f(std::type_identity<S>{});
        });
      });
    });
  });
}

/// The parts of the strategy table, one per translation unit: every strategy
/// without a pipeline or expert parallelism (DP x TP x CP), every one with
/// expert parallelism and no pipeline, and the pipelined ones by DP mode.
enum class Part {
  data_tensor,
  data_tensor_bf16,  // the same strategies with weft::Precision<BF16> (--precision bf16)
  data_tensor_fp16,  // and with weft::Precision<FP16, F32, DynamicLossScale> (--precision fp16)
  expert,
  pipeline_replicated,
  pipeline_zero1,
  pipeline_zero2,
  pipeline_fully_shard
};

/// The part that holds the strategy the (checked) flags name.
inline Part part_of(const Options& o) {
  if (o.pp > 1) {
    switch (o.dp_mode) {
      case weft::parallel::DPMode::replicate: return Part::pipeline_replicated;
      case weft::parallel::DPMode::zero1: return Part::pipeline_zero1;
      case weft::parallel::DPMode::zero2: return Part::pipeline_zero2;
      case weft::parallel::DPMode::fsdp: return Part::pipeline_fully_shard;
    }
  }
  if (o.ep > 1) return Part::expert;
  if (o.precision == "bf16") return Part::data_tensor_bf16;
  return o.precision == "fp16" ? Part::data_tensor_fp16 : Part::data_tensor;
}

/// Whether the compiled strategy S belongs to part P (the same rule as part_of).
template <Part P, class S>
constexpr bool in_part() {
  using D = typename S::data_parallel;
  if constexpr (S::pipelined) {
    if constexpr (std::is_same_v<D, weft::Replicated>) return P == Part::pipeline_replicated;
    else if constexpr (std::is_same_v<D, weft::ZeRO<1>>) return P == Part::pipeline_zero1;
    else if constexpr (std::is_same_v<D, weft::ZeRO<2>>) return P == Part::pipeline_zero2;
    else return P == Part::pipeline_fully_shard;
  } else if constexpr (S::expert_parallel_v) {
    return P == Part::expert;
  } else if constexpr (S::precision::loss_scaled) {
    return P == Part::data_tensor_fp16;
  } else if constexpr (S::precision::mixed) {
    return P == Part::data_tensor_bf16;
  } else {
    return P == Part::data_tensor;
  }
}

/// Thrown when part P is asked for a strategy it does not hold (a bug in part_of).
[[noreturn]] inline void not_in_part(Part p) {
  constexpr const char* names[] = {"data_tensor",         "data_tensor_bf16", "data_tensor_fp16", "expert",
                                   "pipeline_replicated", "pipeline_zero1",   "pipeline_zero2",   "pipeline_fully_shard"};
  weft::detail::throw_error<weft::ConfigError>("train_gpt: the strategy the flags name is not in the part ", names[int(p)],
                                               " of the strategy table (a bug in part_of)");
}

}  // namespace train_gpt
