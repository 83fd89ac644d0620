// Valid meshes and their ranking: every factorisation world = dp*tp*pp*cp
// (ep folded into dp) with each data-parallel mode, rejected with a reason when
// a size does not divide, then costed on a topology. Formulas: docs/plan.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <weft/vocabulary/context_policy.hpp>
#include <weft/plan/memory.hpp>

namespace weft::plan {

/// A cluster as the cost model sees it. Defaults: an 8-GPU node of 80 GB
/// devices with NVLink-class links inside and 400 Gb/s-class links between.
struct Topology {
  std::string name = "default";
  std::size_t gpus_per_node = 8;
  double memory_gb = 80;            ///< per device, 1e9 bytes
  double peak_tflops = 989;         ///< dense peak of the training precision
  double compute_efficiency = 0.5;  ///< fraction of the peak matrix products reach (model FLOPs)
  double intra_bw_gbs = 450;        ///< per-direction bandwidth per device inside a node, GB/s
  double intra_latency_us = 3;
  double inter_bw_gbs = 50;         ///< per device between nodes, GB/s
  double inter_latency_us = 10;
  double headroom_fraction = 0.10;  ///< allocator allowance added to every budget
  /// Switch levels above the nodes, innermost first: a level joins `nodes`
  /// nodes; traffic of a group that spans more nodes than a level joins runs
  /// at the bandwidth and latency of the level above it. Empty: one flat
  /// network at inter_bw_gbs / inter_latency_us.
  struct SwitchLevel {
    std::size_t nodes = 0;      ///< nodes under one switch of this level
    double bw_gbs = 0;          ///< per device, for traffic that leaves this level
    double latency_us = 0;      ///< for traffic that leaves this level
  };
  std::vector<SwitchLevel> switch_levels{};  ///< ascending `nodes`
};

/// Bandwidth (GB/s) and latency (µs) of the slowest link a group of ranks
/// crosses, given how many devices it spans when its ranks are placed
/// contiguously: inside a node, between nodes under one switch, or above the
/// switch levels it outgrows.
struct Link {
  double bw_gbs = 0, latency_us = 0;
  int level = 0;  ///< 0: inside a node; 1: between nodes; 1 + k: above switch level k
};
inline Link link_for_span(std::size_t devices, const Topology& t) {
  if (devices <= t.gpus_per_node) return {t.intra_bw_gbs, t.intra_latency_us, 0};
  const std::size_t nodes = (devices + t.gpus_per_node - 1) / t.gpus_per_node;
  Link l{t.inter_bw_gbs, t.inter_latency_us, 1};
  for (std::size_t k = 0; k < t.switch_levels.size(); ++k)
    if (nodes > t.switch_levels[k].nodes) l = {t.switch_levels[k].bw_gbs, t.switch_levels[k].latency_us, int(k) + 2};
  return l;
}

/// One factorisation with the verdict and, when valid, its cost.
struct Candidate {
  MeshSpec mesh;
  std::vector<std::string> reasons;  ///< why it is rejected (empty: valid)
  TrainingBudget memory;
  bool fits = false;                 ///< memory.total() <= device memory
  double compute_s = 0;              ///< FLOPs / (peak * efficiency), bubble excluded
  double bubble = 0;                 ///< (p-1)/(m+p-1)
  double tp_s = 0, cp_s = 0, ep_s = 0, pp_s = 0;  ///< exposed communication per step by strategy
  double dp_s = 0;                   ///< data-parallel collectives per step (partly hidden by backward)
  double step_s = 0;                 ///< predicted step time
  double tokens_per_s = 0;           ///< global tokens per predicted step time
  /// Whether no divisibility rule rejects it.
  bool valid() const { return reasons.empty(); }
};

/// The largest device count the planner accepts (weft-plan --gpus, a
/// topology's gpus_per_node): 2^24. Enumeration stays well under a second there.
inline constexpr std::size_t max_gpus = std::size_t(1) << 24;

namespace detail {
// The divisors of n in ascending order, found in O(sqrt n): each i <= sqrt(n)
// that divides n gives i and n / i.
inline std::vector<std::size_t> divisors(std::size_t n) {
  std::vector<std::size_t> low, high;
  for (std::size_t i = 1; i <= n / i; ++i)
    if (n % i == 0) {
      low.push_back(i);
      if (i != n / i) high.push_back(n / i);
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}
inline std::string str(std::size_t v) { return std::to_string(v); }
}  // namespace detail

/// The number of ordered factorisations world = tp * pp * cp * dp, the
/// meshes enumerate_meshes lists before data-parallel modes and expert
/// counts multiply them: the product over world's prime powers p^a of
/// C(a + 3, 3), found in O(sqrt world). 2^24 has 2925; a highly composite
/// count has far more (14414400 = 2^6 3^2 5^2 7 11 13: 537600).
inline std::size_t factorisation_count(std::size_t world) {
  std::size_t count = 1, n = world;
  auto term = [&](std::size_t a) { count *= (a + 1) * (a + 2) * (a + 3) / 6; };
  for (std::size_t p = 2; p <= n / p; ++p) {
    std::size_t a = 0;
    while (n % p == 0) n /= p, ++a;
    if (a) term(a);
  }
  if (n > 1) term(1);
  return count;
}

/// Why mesh s cannot run model m (empty: it can). TP must divide heads,
/// kv-heads (weft's attention splits the K/V heads over TP and never
/// replicates them, so tp above kv_heads is refused as the runtime refuses
/// it: nn::GPTConfig::validate_tensor_parallel), MLP hidden and
/// vocabulary, and fit in a node; PP must divide layers and not exceed the
/// microbatches; CP must split the sequence into 2*cp chunks (load-balanced
/// causal ring); EP must divide experts and dp; dp*micro_batch must divide
/// the global batch.
inline std::vector<std::string> rejection_reasons(const ModelSpec& m, const MeshSpec& s, const Topology& t) {
  using detail::str;
  std::vector<std::string> r;
  if (m.heads % s.tp) r.push_back("tp " + str(s.tp) + " does not divide heads " + str(m.heads));
  if (m.kv() % s.tp)
    r.push_back("tp " + str(s.tp) + " does not divide kv_heads " + str(m.kv()) +
                " (each TP rank takes an equal share of the K/V heads; weft does not replicate them)");
  if (m.hidden() % s.tp) r.push_back("tp " + str(s.tp) + " does not divide the MLP hidden size " + str(m.hidden()));
  if (m.vocab % s.tp) r.push_back("tp " + str(s.tp) + " does not divide vocab " + str(m.vocab));
  if (s.tp > t.gpus_per_node) r.push_back("tp " + str(s.tp) + " exceeds the " + str(t.gpus_per_node) + " devices of a node");
  if (m.layers % s.pp) r.push_back("pp " + str(s.pp) + " does not divide layers " + str(m.layers));
  if (m.global_batch % (s.dp * m.micro_batch))
    r.push_back("dp " + str(s.dp) + " x micro_batch " + str(m.micro_batch) + " does not divide global_batch " + str(m.global_batch));
  else if (s.pp > 1 && s.schedule != Schedule::gpipe && m.global_batch / (s.dp * m.micro_batch) < s.pp)
    r.push_back("pp " + str(s.pp) + " exceeds the " + str(m.global_batch / (s.dp * m.micro_batch)) + " microbatches per step");
  else if (s.pp > 1) {
    const std::string why = schedule_rejection(s.schedule, s.chunks, int(s.pp), int(m.global_batch / (s.dp * m.micro_batch)));
    if (!why.empty()) r.push_back(schedule_name(s.schedule, s.chunks).append(": ").append(why));
  }
  if (s.pp > 1 && s.schedule == Schedule::interleaved && s.pp * s.chunks > pipeline::unit_count(m.layers))
    r.push_back(std::string("pp ").append(str(s.pp)).append(" x ").append(str(s.chunks))
                    .append(" virtual stages exceed the ").append(str(m.layers)).append(" layers plus embedding and head"));
  if (s.cp > 1 && m.seq % (2 * s.cp)) r.push_back("cp " + str(s.cp) + ": seq " + str(m.seq) + " does not split into 2 x cp chunks");
  if (s.cp > 1 && s.context == ContextKind::alltoall && m.heads % s.tp == 0 &&
      !context::alltoall_fits(m.heads / s.tp, std::max<std::size_t>(m.kv() / s.tp, 1), s.cp))
    r.push_back("cp " + str(s.cp) + " alltoall: " + str(m.heads / s.tp) + " query heads and " +
                str(std::max<std::size_t>(m.kv() / s.tp, 1)) + " K/V heads per TP rank do not shard over cp");
  if (s.ep > 1 && (!m.experts || m.experts % s.ep)) r.push_back("ep " + str(s.ep) + " does not divide experts " + str(m.experts));
  if (s.dp % s.ep) r.push_back("ep " + str(s.ep) + " does not divide dp " + str(s.dp));
  if (s.dp == 1 && s.mode != DPMode::replicate) r.push_back("dp 1: nothing to shard with " + std::string(to_string(s.mode)));
  return r;
}

/// Every layout of `world` ranks: all ordered factorisations dp*tp*pp*cp, the
/// four dp modes when dp > 1 (replicate only at dp = 1) and, for MoE models,
/// every ep that divides dp; each with its rejection reasons. dp=1 with a
/// sharding mode is not listed at all (it is the same layout as replicate).
/// With pp > 1 the stages run `schedule` (`chunks` virtual stages per rank for
/// the interleaved one).
inline std::vector<Candidate> enumerate_meshes(const ModelSpec& m, std::size_t world, const Topology& t,
                                               Schedule schedule = Schedule::one_f_one_b, std::size_t chunks = 1) {
  std::vector<Candidate> out;
  for (std::size_t tp : detail::divisors(world))
    for (std::size_t pp : detail::divisors(world / tp))
      for (std::size_t cp : detail::divisors(world / tp / pp)) {
        const std::size_t dp = world / tp / pp / cp;
        const std::vector<std::size_t> eps = m.experts ? detail::divisors(dp) : std::vector<std::size_t>{1};
        for (std::size_t ep : eps)
          for (DPMode mode : {DPMode::replicate, DPMode::zero1, DPMode::zero2, DPMode::fsdp}) {
            if (dp == 1 && mode != DPMode::replicate) continue;
            Candidate c;
            c.mesh = MeshSpec{.dp = dp, .tp = tp, .pp = pp, .cp = cp, .ep = ep, .mode = mode,
                              .schedule = schedule, .chunks = schedule == Schedule::interleaved ? chunks : 1};
            c.reasons = rejection_reasons(m, c.mesh, t);
            out.push_back(std::move(c));
          }
      }
  return out;
}

/// Seconds of a ring collective over `ranks` ranks moving a buffer of `bytes`:
/// all-reduce moves 2(r-1)/r of it, all-gather and reduce-scatter (r-1)/r,
/// all-to-all (r-1)/r, each step paying the link latency.
inline double collective_seconds(const char* kind, double bytes, std::size_t ranks, double bw_gbs, double lat_us) {
  if (ranks <= 1) return 0;
  const double r = double(ranks), f = (r - 1) / r;
  const bool all_reduce = std::string(kind) == "all_reduce";
  const double vol = (all_reduce ? 2 * f : f) * bytes;
  const double steps = all_reduce ? 2 * (r - 1) : (r - 1);
  return vol / (bw_gbs * 1e9) + steps * lat_us * 1e-6;
}

/// Bytes one rank's collectives and messages carry in one training step, by
/// strategy and kind, counted as weft's CommStats counts them: the size of
/// the buffer each call passes (the full gathered or reduced buffer for
/// all-gather and reduce-scatter), not the bytes on the wire.
struct CommVolume {
  double tp_all_reduce = 0;      ///< TP axis (gradient-norm term included)
  double tp_all_gather = 0;      ///< TP axis, sequence parallelism
  double tp_reduce_scatter = 0;  ///< TP axis, sequence parallelism
  double pp_send = 0;            ///< PP axis: activations and input gradients sent
  double pp_recv = 0;            ///< PP axis: activations and output gradients received
  double pp_all_reduce = 0;      ///< PP axis: the step totals (gradient norm, loss)
  double cp_send = 0;            ///< CP axis, Ring: K/V blocks and dK/dV sums sent
  double cp_recv = 0;            ///< CP axis, Ring: K/V blocks and dK/dV sums received
  double cp_all_gather = 0;      ///< CP axis, AllGather: K/V gathered (the whole sequence's)
  double cp_reduce_scatter = 0;  ///< CP axis, AllGather: dK/dV reduced (the whole sequence's)
  double cp_all_to_all = 0;      ///< CP axis, AllToAll: Q, K, V, output, lse and their gradients
  double cp_all_reduce = 0;      ///< CP axis: the loss sum of each microbatch (pp = 1)
  double cp_calls = 0;           ///< CP axis: point-to-point messages and exchange collectives (the all-reduce aside)
};

/// The step's communication volume of pipeline rank `rank` (0 with pp = 1).
/// Per microbatch, with n the rank's tokens and D the width, elements of
/// act_bytes (formulas: docs/plan.md):
///   TP without sequence parallelism: all-reduce 4 n D per block (two in
///   forward, two in backward; two more for each block recompute re-runs), n D after the
///   vocabulary-parallel embedding, n D for the head's input gradient, and
///   3 n for the vocabulary-parallel cross-entropy (row maxima, sums of exp,
///   target logits).
///   TP with sequence parallelism: all-gather and reduce-scatter 4 n D per
///   block, one n D each at the embedding and at the head; all-reduce of the
///   cross-entropy's 3 n and of the gradients of the parameters the token
///   shards share (norms, learned positions), in grad_bytes.
///   Both: one 8-byte all-reduce of the gradient norm per step.
///   CP, per block, sequence and microbatch, with kvb = 2 kv (T/cp) hd (one
///   rank's K/V block, kv the TP rank's K/V heads): Ring sends and receives
///   kvb cp-1 times in forward, and in backward cp-1 K/V blocks and cp dK/dV
///   sums (3 cp - 2 in all); AllGather all-gathers 2 kv T hd in forward and
///   reduce-scatters as much in backward. K and V travel at
///   context_kv_bytes (product_bytes under a 2-byte precision), every other
///   tensor (dK/dV sums, Q, the output, dO) at act_bytes. AllToAll exchanges Q, K, V, the
///   output and the log-sum-exp in forward (H/tp (T/cp) (2 hd + 1) + 2 cp
///   kv' (T/cp) hd, kv' the K/V heads per CP rank) and dO, dQ, dK, dV in
///   backward. Recompute runs each forward exchange once more, for every
///   block but the last of each chunk (as it does TP's two forward
///   all-reduces). One 8-byte all-reduce of the loss per microbatch (pp = 1).
///   PP: each chunk receives its input and sends its input gradient unless it
///   holds the embedding, and sends its output and receives its output
///   gradient unless it holds the head: n D / (sequence split) each; two
///   8-byte all-reduces per step (gradient norm, loss).
inline CommVolume comm_volume(const ModelSpec& m, const MeshSpec& s, std::size_t rank) {
  CommVolume v;
  const double mb = double(microbatches(m, s)), n = rank_tokens(m, s), D = double(m.d_model);
  const double a = double(m.act_bytes), g = double(m.grad_bytes), nd = n * D * a;
  const bool sp = s.sequence_parallel && s.tp > 1;
  const auto chunks = rank_layout(m, s, rank);
  // Recompute re-runs the forward of every block but the last one in one
  // process (nn::GPT: the last block's activations are still in the shared
  // set when backward starts); a pipeline stage re-runs every block, since
  // its shared set holds whichever microbatch ran forward last.
  double recomputed = 0;
  if (m.recompute)
    for (const auto& k : chunks) recomputed += k.blocks > 0 ? double(k.blocks) - (s.pp > 1 ? 0.0 : 1.0) : 0.0;
  if (s.tp > 1) {
    double blocks = 0;
    bool emb = false, head = false;
    for (const auto& k : chunks) blocks += double(k.blocks), emb = emb || k.embedding, head = head || k.head;
    const double ce = head ? 3 * n * a : 0.0;
    const double ends = double(emb) + double(head);
    if (!sp) {
      v.tp_all_reduce = mb * ((4 * blocks + 2 * recomputed) * nd + ends * nd + ce);
    } else {
      const double per = (4 * blocks + 2 * recomputed) * nd + ends * nd;
      // The forward's all-gathers (each block's attention and MLP inputs,
      // recomputed ones too, and the head's) gather products' inputs, in
      // product_bytes under 2-byte products (nn::detail::tp_all_gather_operand);
      // the backward's (output gradients, the embedding's) stay act_bytes.
      const double pa = m.product_bytes ? double(m.product_bytes) : a;
      v.tp_all_gather = mb * ((2 * blocks + 2 * recomputed + double(head)) * n * D * pa + (2 * blocks + double(emb)) * nd);
      v.tp_reduce_scatter = mb * per;
      const double shared = blocks * double(m.norm_params(2)) + (head ? double(m.norm_params(1)) : 0.0) +
                            (emb && m.learned_positions ? double(m.seq * m.d_model) : 0.0);
      v.tp_all_reduce = mb * (ce + shared * g);
    }
    v.tp_all_reduce += 8;
  }
  if (s.cp > 1) {
    double blocks = 0;
    for (const auto& k : chunks) blocks += double(k.blocks);
    const ContextShape c = context_shape(m, s);
    const double P = double(s.cp), tl = c.local_tokens, hd = c.head_dim, w = context_kv_bytes(m);
    // Per sequence: forwards (recomputed ones included) and backwards over all blocks.
    const double B = mb * double(m.micro_batch), fw = B * (blocks + recomputed), bw = B * blocks;
    switch (s.context) {
      case ContextKind::ring: {
        // K/V blocks travel at context_kv_bytes, the dK/dV sums at act_bytes.
        const double kvb = 2 * c.kv * tl * hd;
        const double kv_msgs = fw * (P - 1) + bw * (P - 1), sum_msgs = bw * P;
        v.cp_send = v.cp_recv = kv_msgs * kvb * w + sum_msgs * kvb * a;
        v.cp_calls = kv_msgs + sum_msgs;
        break;
      }
      case ContextKind::allgather:
        v.cp_all_gather = fw * 2 * c.kv * c.seq * hd * w;
        v.cp_reduce_scatter = bw * 2 * c.kv * c.seq * hd * a;
        v.cp_calls = fw + bw;
        break;
      case ContextKind::alltoall: {
        const double kv = 2 * P * c.kv_per_rank * tl * hd, q = c.heads * tl * hd;
        v.cp_all_to_all = (fw * (2 * q + c.heads * tl) + bw * (2 * q + kv)) * a + fw * kv * w;
        v.cp_calls = fw * 5 + bw * 4;
        break;
      }
    }
    // Without a pipeline the model sums each microbatch's loss over CP (one
    // 8-byte all-reduce); a pipeline's head returns its local sum to the
    // executor, which totals the step over PP and the gradients' group.
    if (s.pp == 1) v.cp_all_reduce = mb * 8;
  }
  if (s.pp > 1) {
    // Activations and input gradients travel at wire_bytes (2 under a 2-byte precision).
    const double msg = n * D * wire_bytes(m) / s.sequence_split();
    for (const auto& k : chunks) {
      const double one_way = (k.embedding ? 0.0 : 1.0) + (k.head ? 0.0 : 1.0);
      v.pp_send += mb * one_way * msg;
      v.pp_recv += mb * one_way * msg;
    }
    v.pp_all_reduce = 16;
  }
  return v;
}

/// The step's volume of the pipeline rank that moves the most bytes over
/// TP, PP and CP (rank 0 with pp = 1).
inline CommVolume busiest_comm_volume(const ModelSpec& m, const MeshSpec& s) {
  auto load = [](const CommVolume& x) {
    return x.tp_all_reduce + x.tp_all_gather + x.pp_send + x.cp_send + x.cp_all_gather + x.cp_all_to_all;
  };
  CommVolume vol = comm_volume(m, s, 0);
  for (std::size_t r = 1; r < s.pp; ++r) {
    const CommVolume o = comm_volume(m, s, r);
    if (load(o) > load(vol)) vol = o;
  }
  return vol;
}

/// The step's bubble: the schedule's idle fraction (pipeline.hpp:
/// schedule_bubble; a backward costs two forwards), 0 without a pipeline.
inline double pipeline_bubble(const ModelSpec& m, const MeshSpec& s) {
  return s.pp > 1 ? schedule_bubble(s.schedule, s.chunks, int(s.pp), int(microbatches(m, s))) : 0.0;
}

/// Fills c's memory and cost on topology t for c.mesh as it is (c must be valid).
inline void cost_layout(const ModelSpec& m, Candidate& c, const Topology& t) {
  const MeshSpec& s = c.mesh;
  c.memory = training_memory(m, s, t.headroom_fraction);
  c.fits = c.memory.total() <= t.memory_gb * 1e9;
  const double mb = double(microbatches(m, s)), world = double(s.world());
  const double tokens = double(m.global_batch) * double(m.seq);
  // Every rank of a TP group runs its routed experts whole (TP-replicated),
  // so their FLOPs divide over world / tp ranks only.
  const double expert_flops = m.expert_train_flops_per_token();
  c.compute_s = ((m.train_flops_per_token() - expert_flops) / world + expert_flops * double(s.tp) / world) * tokens /
                (t.peak_tflops * 1e12 * t.compute_efficiency);
  c.bubble = pipeline_bubble(m, s);
  auto link = [&](std::size_t stride, std::size_t size, const char* kind, double bytes) {
    const Link l = size > 1 ? link_for_span(stride * size, t) : Link{t.intra_bw_gbs, t.intra_latency_us, 0};
    return collective_seconds(kind, bytes, size, l.bw_gbs, l.latency_us);
  };
  const double n = rank_tokens(m, s), D = double(m.d_model);
  const double layers_here = double(m.layers) / double(s.pp);
  // TP and PP from the step's volume on the busiest pipeline rank; each
  // collective call pays its latency steps (4 calls per block per microbatch).
  const CommVolume vol = busiest_comm_volume(m, s);
  if (s.tp > 1) {
    const Link l = link_for_span(s.tp, t);
    const double calls = mb * layers_here * (4 + (m.recompute ? 2 : 0));
    // An all-reduce takes 2 (tp-1) ring steps; sequence parallelism's
    // all-gather and reduce-scatter pair takes as many.
    const double steps = 2.0 * double(s.tp - 1);
    c.tp_s = collective_seconds("all_reduce", vol.tp_all_reduce, s.tp, l.bw_gbs, 0) +
             collective_seconds("all_gather", vol.tp_all_gather, s.tp, l.bw_gbs, 0) +
             collective_seconds("reduce_scatter", vol.tp_reduce_scatter, s.tp, l.bw_gbs, 0) +
             calls * steps * l.latency_us * 1e-6;
  }
  // CP from the step's volume: Ring's messages one after another on the
  // ring's link (each paying its latency), AllGather's and AllToAll's
  // collectives each paying their ring steps. All on the critical path: the
  // ring overlaps its transfers with compute, so this is an upper bound.
  if (s.cp > 1) {
    const Link l = link_for_span(s.tp * s.cp, t);
    const double steps = double(s.cp - 1);
    switch (s.context) {
      case ContextKind::ring:
        c.cp_s = vol.cp_send / (l.bw_gbs * 1e9) + vol.cp_calls * l.latency_us * 1e-6;
        break;
      case ContextKind::allgather:
        c.cp_s = collective_seconds("all_gather", vol.cp_all_gather, s.cp, l.bw_gbs, 0) +
                 collective_seconds("reduce_scatter", vol.cp_reduce_scatter, s.cp, l.bw_gbs, 0) +
                 vol.cp_calls * steps * l.latency_us * 1e-6;
        break;
      case ContextKind::alltoall:
        c.cp_s = collective_seconds("all_to_all", vol.cp_all_to_all, s.cp, l.bw_gbs, 0) +
                 vol.cp_calls * steps * l.latency_us * 1e-6;
        break;
    }
  }
  // EP: dispatch and combine all-to-alls of top_k copies of each token,
  // forward and backward, in the exchange's element width (2 bytes under a
  // 2-byte precision).
  c.ep_s = m.experts && s.ep > 1
               ? mb * layers_here * 4 *
                     link(s.tp * s.cp * s.pp, s.ep, "all_to_all", n * double(m.top_k) * D * wire_bytes(m))
               : 0.0;
  // PP: the busiest rank's sends (receives overlap them on a full-duplex link).
  if (s.pp > 1) {
    const Link l = link_for_span(s.tp * s.cp * s.pp, t);
    const double msgs = vol.pp_send / std::max(1.0, n * D * wire_bytes(m) / s.sequence_split());
    c.pp_s = vol.pp_send / (l.bw_gbs * 1e9) + msgs * l.latency_us * 1e-6;
  }
  // DP: gradients reduced once per step (replicate, zero1) or per microbatch
  // (zero2), plus the parameter all-gather (zero1/2 once; fsdp twice per microbatch).
  const double S = stage_params(m, s).total(), pb = double(m.param_bytes), gb = double(m.grad_bytes);
  const std::size_t stride = s.tp * s.cp * s.pp;
  switch (s.mode) {
    case DPMode::replicate: c.dp_s = link(stride, s.dp, "all_reduce", S * gb); break;
    case DPMode::zero1:
      c.dp_s = link(stride, s.dp, "reduce_scatter", S * gb) + link(stride, s.dp, "all_gather", S * pb);
      break;
    case DPMode::zero2:
      c.dp_s = mb * link(stride, s.dp, "reduce_scatter", S * gb) + link(stride, s.dp, "all_gather", S * pb);
      break;
    case DPMode::fsdp:
      c.dp_s = mb * (link(stride, s.dp, "reduce_scatter", S * gb) + 2 * link(stride, s.dp, "all_gather", S * pb));
      break;
  }
  // Data-parallel traffic overlaps backward (two thirds of compute); only the
  // excess is exposed. The other strategies sit on the critical path.
  const double dp_exposed = std::max(0.0, c.dp_s - c.compute_s * 2.0 / 3.0);
  const double busy = c.compute_s + c.tp_s + c.cp_s + c.ep_s + c.pp_s;
  c.step_s = busy / (1.0 - c.bubble) + dp_exposed;
  c.tokens_per_s = tokens / c.step_s;
}

/// Fills c's memory and cost on topology t (c must be valid). With cp > 1
/// every context variant the heads allow is costed and c keeps the best
/// (fitting first, then the shortest step): Ring always fits the rules,
/// AllToAll only where query and K/V heads shard over cp.
inline void cost(const ModelSpec& m, Candidate& c, const Topology& t) {
  if (c.mesh.cp <= 1) return cost_layout(m, c, t);
  bool have = false;
  Candidate best;
  for (ContextKind k : {ContextKind::ring, ContextKind::allgather, ContextKind::alltoall}) {
    Candidate x = c;
    x.mesh.context = k;
    if (!rejection_reasons(m, x.mesh, t).empty()) continue;
    cost_layout(m, x, t);
    if (!have || (x.fits && !best.fits) || (x.fits == best.fits && x.step_s < best.step_s)) best = std::move(x), have = true;
  }
  c = std::move(best);
}

/// Valid candidates costed and ranked: fitting ones first, then by predicted
/// step time, then by memory left. Rejected ones follow in enumeration order.
/// With pp > 1 the stages run `schedule` (`chunks` virtual stages per rank).
inline std::vector<Candidate> rank_meshes(const ModelSpec& m, std::size_t world, const Topology& t,
                                          Schedule schedule = Schedule::one_f_one_b, std::size_t chunks = 1) {
  m.validate();
  WEFT_REQUIRE(world > 0 && world <= max_gpus, ConfigError, "--gpus ", world, ": expected a positive number of devices, at most ",
               max_gpus);
  auto all = enumerate_meshes(m, world, t, schedule, chunks);
  std::vector<Candidate> ok, bad;
  for (auto& c : all) {
    if (c.valid()) {
      cost(m, c, t);
      ok.push_back(std::move(c));
    } else {
      bad.push_back(std::move(c));
    }
  }
  std::stable_sort(ok.begin(), ok.end(), [](const Candidate& x, const Candidate& y) {
    if (x.fits != y.fits) return x.fits;
    if (x.step_s != y.step_s) return x.step_s < y.step_s;
    return x.memory.total() < y.memory.total();
  });
  ok.insert(ok.end(), bad.begin(), bad.end());
  return ok;
}

/// One serving layout: replicas of tp x pp devices.
struct ServeCandidate {
  std::size_t tp = 1, pp = 1, replicas = 1;
  std::vector<std::string> reasons;  ///< why it cannot be used (empty: usable)
  InferenceBudget memory;
  bool fits = false;
  double tp_us_per_token = 0;  ///< two all-reduces per layer of one decode step's [batch, D]
};

/// Serving layouts for `gpus` devices: every tp (inside a node) and pp with
/// tp*pp dividing gpus; replicas = gpus / (tp*pp). Fitting ones first, then
/// most replicas, then least TP communication per token. A layout with
/// pp > 1 is listed with its reason and never ranked usable: weft's serving
/// runtime (serve::Engine, serve_gpt) runs tensor parallelism and
/// independent replicas, no pipeline stages.
inline std::vector<ServeCandidate> plan_serving(const ModelSpec& m, std::size_t gpus, const Topology& t, const ServeSpec& q) {
  m.validate();
  std::vector<ServeCandidate> out;
  for (std::size_t tp : detail::divisors(gpus))
    for (std::size_t pp : detail::divisors(gpus / tp)) {
      ServeCandidate c;
      c.tp = tp, c.pp = pp, c.replicas = gpus / tp / pp;
      MeshSpec s{.tp = tp, .pp = pp};
      for (auto& r : rejection_reasons(m, s, t))
        if (r.rfind("dp ", 0) != 0 && r.find("microbatches") == std::string::npos) c.reasons.push_back(r);
      if (pp > 1)
        c.reasons.push_back("pp " + detail::str(pp) +
                            ": weft serves with tensor parallelism and replicas only (no pipeline stages in serving)");
      if (c.reasons.empty()) {
        c.memory = inference_memory(m, tp, pp, q, t.headroom_fraction);
        c.fits = c.memory.total() <= t.memory_gb * 1e9;
        const double bytes = double(q.batch) * double(m.d_model) * double(m.act_bytes);
        const double per = collective_seconds("all_reduce", bytes, tp, t.intra_bw_gbs, t.intra_latency_us);
        c.tp_us_per_token = double(m.layers) * 2 * per * 1e6;
      }
      out.push_back(std::move(c));
    }
  std::stable_sort(out.begin(), out.end(), [](const ServeCandidate& x, const ServeCandidate& y) {
    const bool xo = x.reasons.empty() && x.fits, yo = y.reasons.empty() && y.fits;
    if (xo != yo) return xo;
    if (x.replicas != y.replicas) return x.replicas > y.replicas;
    return x.tp_us_per_token < y.tp_us_per_token;
  });
  return out;
}

}  // namespace weft::plan
