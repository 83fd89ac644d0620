// train_gpt's checks before step 0 and at every step: files it will read or
// write, repeated flags, the per-rank memory peak (estimated with weft/plan
// before anything is allocated) against the memory available, and the first
// non-finite loss or gradient norm. An error found before step 0 is agreed
// on by all ranks and printed once (report_once).
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/nn/attention.hpp>
#include <weft/nn/config.hpp>
#include <weft/vocabulary/dp_mode.hpp>
#include <weft/plan/json_read.hpp>
#include <weft/plan/meshes.hpp>
#include <weft/parity.hpp>
#include <weft/train_loop.hpp>

namespace train_gpt_checks {

using weft::ConfigError;

/// `--data PATH` must name a regular file this process can read; returns its size in bytes.
inline std::size_t check_data_file(const std::string& path) {
  struct stat st {};
  WEFT_REQUIRE(::stat(path.c_str(), &st) == 0, ConfigError, "--data ", path, ": cannot open the file (",
               std::strerror(errno), "); give a readable text file");
  WEFT_REQUIRE(S_ISREG(st.st_mode), ConfigError, "--data ", path, ": is ",
               S_ISDIR(st.st_mode) ? "a directory" : "not a regular file", "; give a readable text file");
  std::ifstream f(path, std::ios::binary);
  WEFT_REQUIRE(f.good(), ConfigError, "--data ", path, ": cannot open the file (", std::strerror(errno),
               "); give a readable text file");
  return std::size_t(st.st_size);
}

/// Parses a byte count: a number with an optional K, M, G or T suffix
/// (powers of 1024), e.g. 512M or 1.5G; a plain number is bytes.
inline double parse_bytes(const std::string& flag, const std::string& v) {
  std::size_t pos = 0;
  double x = -1;
  try {
    x = std::stod(v, &pos);
  } catch (...) {
    pos = 0;
  }
  double unit = 1;
  if (pos > 0 && pos + 1 == v.size()) {
    const char s = v[pos];
    unit = s == 'K' || s == 'k' ? 1024.0 : s == 'M' || s == 'm' ? 1048576.0 : s == 'G' || s == 'g' ? 1073741824.0
           : s == 'T' || s == 't' ? 1099511627776.0 : 0.0;
    if (unit > 0) ++pos;
  }
  WEFT_REQUIRE(pos > 0 && pos == v.size() && unit > 0 && std::isfinite(x) && x > 0, ConfigError, flag, " ", v,
               ": expected a positive size such as 512M, 2G or 1.5G (K, M, G, T: powers of 1024; no suffix: bytes)");
  return x * unit;
}

/// Bytes as a short human figure (GiB, MiB or KiB).
inline std::string human_bytes(double b) {
  char buf[48];
  if (b >= 1073741824.0) std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) std::snprintf(buf, sizeof buf, "%.1f MiB", b / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.0f KiB", b / 1024.0);
  return buf;
}

/// One output a run writes, for the free-space check: the flag that names
/// it (e.g. "--checkpoint"), its path, the bytes it will take at most, what
/// they are (e.g. "3 checkpoints of 1.2 GiB (--keep 2, ...)") and what
/// lowers them (e.g. "save less often (--save-every), keep fewer (--keep)").
struct Output {
  std::string flag, path;
  double bytes = 0;
  std::string what, lower;
};

/// The most bytes a train_gpt --record of `steps` steps on `world` ranks
/// takes: three per-step arrays (loss, grad_norm, step_seconds) of at most
/// 26 characters a number, per-rank figures (communication, hosts) of at
/// most 4 KiB a rank, and 64 KiB for the rest (configuration, runtime,
/// counters). A bound, not a guess: a record is always smaller.
inline double record_bytes(std::size_t steps, std::size_t world) {
  return 3.0 * 26.0 * double(steps) + 4096.0 * double(world) + 65536.0;
}

/// The --record output of a run of `steps` steps on `world` ranks (record_bytes).
inline Output record_output(const std::string& path, std::size_t steps, std::size_t world) {
  return {"--record", path, record_bytes(steps, world), "the record of " + std::to_string(steps) + " steps",
          "record fewer --steps"};
}

/// Throws when the outputs will not fit in the free space (statvfs
/// f_bavail, what this user may write) of the file systems that hold them
/// (each output's path or, while it does not exist yet, its nearest
/// existing parent). Outputs on the same file system (the same st_dev) are
/// summed: a checkpoint root and a record on one disk share its space. The
/// message names the outputs, what the run will write, what is free and
/// what to change; nothing has been written yet.
inline void check_free_space(const std::vector<Output>& outputs) {
  struct Where {
    dev_t dev = 0;
    double free_bytes = 0;
    std::vector<const Output*> outs;
  };
  std::vector<Where> places;
  for (const Output& o : outputs) {
    std::string at = o.path.empty() ? "." : o.path;
    struct statvfs fs {};
    struct stat st {};
    bool known = false;
    for (;;) {
      if (::statvfs(at.c_str(), &fs) == 0 && ::stat(at.c_str(), &st) == 0) {
        known = true;
        break;
      }
      if (at == "." || at == "/") break;
      const std::size_t slash = at.find_last_of('/');
      at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
    }
    if (!known) continue;  // nothing to measure: the write will say
    auto it = std::find_if(places.begin(), places.end(), [&](const Where& w) { return w.dev == st.st_dev; });
    if (it == places.end()) it = places.insert(places.end(), Where{st.st_dev, double(fs.f_bavail) * double(fs.f_frsize), {}});
    it->outs.push_back(&o);
  }
  for (const Where& w : places) {
    double bytes = 0;
    std::string names, what;
    std::vector<std::string> fixes = {"free space", "write elsewhere"};
    for (std::size_t i = 0; i < w.outs.size(); ++i) {
      const Output& o = *w.outs[i];
      bytes += o.bytes;
      names += (i == 0 ? "" : i + 1 == w.outs.size() ? " and " : ", ") + o.flag + " " + o.path;
      what += (i == 0 ? "" : "; ") + o.what + (w.outs.size() > 1 ? ": " + human_bytes(o.bytes) : std::string());
      fixes.push_back(o.lower);
    }
    std::string lower;
    for (std::size_t i = 0; i < fixes.size(); ++i) lower += (i == 0 ? "" : i + 1 == fixes.size() ? " or " : ", ") + fixes[i];
    WEFT_REQUIRE(bytes <= w.free_bytes, ConfigError, names, w.outs.size() > 1 ? " (on one file system)" : "",
                 ": the run will write ", human_bytes(bytes), " (", what, "), but the file system has ",
                 human_bytes(w.free_bytes), " free; ", lower);
  }
}

using weft::mem_available_bytes;  // MemAvailable in bytes (weft/core/measure.hpp)

/// A run as the memory estimate sees it.
struct RunShape {
  weft::nn::GPTConfig model;  ///< with model.batch = the sequences of one microbatch on one rank
  std::size_t batch = 8;      ///< global batch (--batch)
  std::size_t dp = 1, tp = 1, pp = 1;  ///< the mesh (--mesh), dp resolved from the world size
  std::size_t cp = 1;                  ///< context-parallel ranks (--mesh cp=N)
  std::size_t ep = 1;                  ///< expert-parallel ranks (--mesh ep=N), folded into dp (dp counts them)
  std::string context = "ring";        ///< --context, with cp > 1
  bool sequence_parallel = false;      ///< --sequence-parallel
  weft::parallel::DPMode dp_mode = weft::parallel::DPMode::replicate;  ///< --dp
  std::string schedule = "1f1b";   ///< with pp > 1
  std::string optimizer = "adamw";
  double momentum = 0.9;           ///< sgd: a momentum buffer when > 0
  std::string precision = "fp32";  ///< --precision: bf16 and fp16 keep 2-byte saved activations and stage 2-byte operands
};

/// The planner's description of train_gpt's GPT (fp32 tensors; under
/// --precision bf16|fp16 2-byte saved activations and product staging) and mesh.
inline std::pair<weft::plan::ModelSpec, weft::plan::MeshSpec> plan_of(const RunShape& r) {
  using namespace weft::plan;
  const auto& c = r.model;
  ModelSpec m;
  m.name = "train_gpt";
  m.layers = c.layers, m.d_model = c.d_model, m.heads = c.heads, m.kv_heads = c.kv_heads, m.ffn_hidden = c.ffn_hidden;
  m.vocab = c.vocab, m.seq = c.seq, m.micro_batch = c.batch, m.global_batch = r.batch;
  m.mlp = c.mlp == weft::nn::MlpKind::gelu ? Mlp::gelu : Mlp::swiglu;
  m.layernorm = c.norm == weft::nn::NormKind::layernorm;
  m.learned_positions = c.position == weft::nn::PositionKind::learned;
  m.recompute = c.recompute;
  if (r.precision != "fp32") m.saved_bytes = m.product_bytes = 2;
  // The planner's MoE terms treat every block as MoE with experts of the MLP's width: exact for
  // --moe-every 1 without --expert-hidden, an estimate otherwise.
  m.experts = c.experts, m.top_k = c.top_k, m.shared_experts = c.shared_experts;
  // Whether the attention keeps [T, T] probabilities: only whole sequences on the BLAS path.
  m.flash_attention = r.cp > 1 || weft::nn::detail::use_blockwise_attention<float>(c.local(r.tp));
  m.optimizer = r.optimizer == "sgd" ? Optimizer::sgd : Optimizer::adamw;
  m.sgd_momentum = r.momentum > 0;
  MeshSpec s{.dp = r.dp, .tp = r.tp, .pp = r.pp, .cp = r.cp, .ep = r.ep, .mode = r.dp_mode,
             .sequence_parallel = r.sequence_parallel};
  if (r.pp > 1) std::tie(s.schedule, s.chunks) = parse_schedule_name(r.schedule);
  if (r.cp > 1) s.context = parse_context_name(r.context);
  return {m, s};
}

/// The per-rank peak the planner predicts (the heaviest pipeline stage; the
/// planner's 10 % allocator headroom included; docs/plan.md).
inline double estimate_peak_bytes(const RunShape& r) {
  const auto [m, s] = plan_of(r);
  return weft::plan::training_memory(m, s).total();
}

/// The flags that would lower the estimate, each with the estimate it gives
/// (e.g. "--recompute (1.2 GiB)"), in the order a user would try them.
inline std::vector<std::string> reductions(const RunShape& r) {
  const double now = estimate_peak_bytes(r);
  std::vector<std::string> out;
  auto offer = [&](const std::string& flags, RunShape alt) {
    try {
      alt.model.validate();
      const double b = estimate_peak_bytes(alt);
      if (b < now) out.push_back(flags + " (" + human_bytes(b) + ")");
    } catch (const weft::Error&) {  // a variation this run cannot take is not offered
    }
  };
  if (!r.model.recompute) {
    RunShape a = r;
    a.model.recompute = true;
    offer("--recompute", a);
  }
  const std::size_t mbs = r.batch / (r.dp * r.model.batch);
  for (std::size_t k = 2; k <= r.model.batch; ++k)
    if (r.model.batch % k == 0) {
      RunShape a = r;
      a.model.batch /= k;
      offer("--microbatches " + std::to_string(mbs * k), a);
      break;
    }
  if (r.dp > 1 && r.dp_mode != weft::parallel::DPMode::fsdp) {
    RunShape a = r;
    a.dp_mode = weft::parallel::DPMode::fsdp;
    offer("--dp fsdp", a);
  }
  if (r.model.seq > 1) {
    RunShape a = r;
    a.model.seq = r.model.seq / 2;
    offer("--seq " + std::to_string(a.model.seq), a);
  }
  if (r.cp == 1 && r.model.attention != weft::nn::AttentionKernel::blockwise) {
    RunShape a = r;
    a.model.attention = weft::nn::AttentionKernel::blockwise;
    offer("--attention blockwise", a);
  }
  if (r.model.seq % (4 * r.cp) == 0) {  // the sequence over twice the CP ranks (ring: any heads)
    RunShape a = r;
    a.cp = r.cp * 2;
    offer("cp=" + std::to_string(a.cp) + " in --mesh on " + std::to_string(r.dp * r.tp * r.pp * a.cp) + " ranks", a);
  }
  for (std::size_t t = r.tp * 2; t <= r.model.heads; t *= 2) {
    try {
      r.model.validate_tensor_parallel(t, r.sequence_parallel);
    } catch (const weft::Error&) {
      continue;
    }
    RunShape a = r;
    a.tp = t;
    offer("tp=" + std::to_string(t) + " in --mesh on " + std::to_string(r.dp * t * r.pp * r.cp) + " ranks", a);
    break;
  }
  return out;
}

/// Throws when the estimated per-rank peak exceeds `limit` bytes, giving the
/// estimate, the limit and where it came from (`limit_source`), and the flags
/// that would reduce the estimate.
inline void check_memory(const RunShape& r, double limit, const std::string& limit_source) {
  const double est = estimate_peak_bytes(r);
  if (est <= limit) return;
  std::string fix;
  for (const auto& x : reductions(r)) fix += (fix.empty() ? "" : ", ") + x;
  weft::detail::throw_error<ConfigError>(
      "the estimated peak memory per rank, ", human_bytes(est), ", exceeds the limit of ", human_bytes(limit), " (",
      limit_source, "); nothing was allocated. ",
      fix.empty() ? std::string("No single flag of this run lowers it; use a smaller model")
                  : "Flags that lower the estimate: " + fix,
      "; or, if the memory is there, raise the limit: --memory-limit ",
      est < 1073741824.0 ? std::to_string(std::size_t(std::ceil(est / 1048576.0))) + "M"
                         : std::to_string(std::size_t(std::ceil(est / 1073741824.0))) + "G");
}

/// Where the model lives in device memory (a CUDA or HIP default execution
/// space): the free memory of this rank's device, shared by the node's ranks
/// that use the same device (Kokkos gives rank r device r mod devices).
/// nullopt for host memory spaces or when the runtime cannot tell.
inline std::optional<std::pair<double, std::string>> device_memory(int ranks_per_node) {
#if defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP)
  std::size_t free = 0, total = 0;
  int devices = 0;
  bool known = false;
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<Kokkos::DefaultExecutionSpace, Kokkos::Cuda>)
    known = cudaMemGetInfo(&free, &total) == cudaSuccess && cudaGetDeviceCount(&devices) == cudaSuccess;
#else
  if constexpr (std::is_same_v<Kokkos::DefaultExecutionSpace, Kokkos::HIP>)
    known = hipMemGetInfo(&free, &total) == hipSuccess && hipGetDeviceCount(&devices) == hipSuccess;
#endif
  if (!known || devices < 1) return std::nullopt;
  const int share = (ranks_per_node + devices - 1) / devices;
  return std::pair<double, std::string>{double(free) / double(share),
                                        "GPU free memory " + human_bytes(double(free)) + " / " + std::to_string(share) +
                                            " rank" + (share == 1 ? "" : "s") + " per GPU"};
#else
  (void)ranks_per_node;
  return std::nullopt;
#endif
}

/// The limit check_memory compares with: --memory-limit when given (per
/// rank), else the device's free memory when the model lives on a GPU
/// (device_memory), else MemAvailable shared by the `ranks_per_node` ranks
/// of a node. Returns {bytes, source}; bytes < 0 when none is known.
inline std::pair<double, std::string> memory_limit(double flag_bytes, int ranks_per_node) {
  if (flag_bytes > 0) return {flag_bytes, "--memory-limit"};
  if (auto dev = device_memory(ranks_per_node)) return *dev;
  const auto avail = mem_available_bytes();
  if (!avail) return {-1.0, "unknown"};
  return {*avail / double(ranks_per_node), "MemAvailable " + human_bytes(*avail) + " / " + std::to_string(ranks_per_node) +
                                               " rank" + (ranks_per_node == 1 ? "" : "s") + " on this node"};
}

/// Collective over `world`: every rank passes the error it found (empty:
/// none). Returns whether any rank found one; the lowest such rank prints
/// its message, once, as "<program>: error: ...". Every rank must call it.
inline bool report_once(weft::Comm& world, const std::string& error, const char* program) {
  Kokkos::View<int*, Kokkos::HostSpace> first("first_failing_rank", 1);
  first(0) = error.empty() ? world.size() : world.rank();
  world.all_reduce(first, weft::ReduceOp::min);
  if (first(0) == world.size()) return false;
  if (first(0) == world.rank()) {
    std::fprintf(stderr, "%s: error: %s\n", program, error.c_str());
    std::fflush(stderr);
  }
  return true;
}

using weft::number_text;

/// The flags that could make a run diverge, with their values now.
struct DivergenceCauses {
  double lr = 0, clip = 0, weight_decay = 0;
  bool moe = false;  ///< a mixture-of-experts model: its loss coefficients count too
  double aux_loss = 0, z_loss = 0;
};

/// "try a smaller --lr (now 0.001), a smaller --clip (now 1), a smaller
/// --weight-decay (now 0.1)[, a smaller --aux-loss (now A), a smaller
/// --z-loss (now Z)] or a --warmup" (the MoE coefficients when they are set).
inline std::string divergence_fixes(const DivergenceCauses& c) {
  std::string out = "try a smaller --lr (now " + number_text(c.lr) + "), " +
                    (c.clip > 0 ? "a smaller --clip (now " + number_text(c.clip) + ")" : std::string("--clip 1 (now 0: off)"));
  if (c.weight_decay > 0) out += ", a smaller --weight-decay (now " + number_text(c.weight_decay) + ")";
  if (c.moe && c.aux_loss > 0) out += ", a smaller --aux-loss (now " + number_text(c.aux_loss) + ")";
  if (c.moe && c.z_loss > 0) out += ", a smaller --z-loss (now " + number_text(c.z_loss) + ")";
  return out + " or a --warmup";
}

}  // namespace train_gpt_checks
