// Per-rank memory budgets: training (parameters, gradients, optimizer state,
// saved activations, temporary, communication, allocator headroom) and
// inference (weights, KV cache, workspace, buffers). Formulas: docs/plan.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include <weft/plan/model.hpp>

namespace weft::plan {

/// Parameter elements one rank holds before data-parallel sharding, split the
/// way weft groups them (a block; the root: embeddings, final norm, head).
struct StageParams {
  double block = 0;       ///< one block's elements on this rank (its experts and tensor shard)
  double blocks = 0;      ///< blocks on this stage (all its chunks)
  double root = 0;        ///< root elements on this stage (embedding on the first, final norm and head on the last)
  double block_experts = 0;  ///< of `block`, the routed experts' elements (split over ep; 0 in a dense model)
  /// Elements of the stage.
  double total() const { return blocks * block + root; }
  /// Elements of the stage's routed experts.
  double experts() const { return blocks * block_experts; }
};

/// The tensor-parallel split of one expert's MLP: 1. weft replicates the
/// routed (and shared) experts over TP (every TP rank of an EP group runs the
/// same routing and the same whole experts, docs/moe.md); a dense MLP splits
/// over tp.
inline double mlp_tp_split(const ModelSpec& m, const MeshSpec& s) { return m.experts ? 1.0 : double(s.tp); }
/// Elements of one MLP (one expert) on one rank: a dense MLP's matrices and
/// column-parallel bias split over tp, the row-parallel bias replicated; an
/// expert whole (mlp_tp_split).
inline double mlp_params_here(const ModelSpec& m, const MeshSpec& s) {
  const double tp = mlp_tp_split(m, s), D = double(m.d_model), up = double(m.up_cols()), F = double(m.hidden());
  return (D * up + F * D) / tp + (m.bias ? up / tp + D : 0.0);
}
/// Of block_params_here, the routed experts' elements (0 in a dense model):
/// E / ep whole experts, not split over tp.
inline double block_expert_params_here(const ModelSpec& m, const MeshSpec& s) {
  return m.experts ? double(m.experts) / double(s.ep) * mlp_params_here(m, s) : 0.0;
}
/// Parameter elements of one block on one rank: matrices and column-parallel
/// biases split over tp; norms and row-parallel biases replicated; experts
/// split over ep and replicated over tp.
inline double block_params_here(const ModelSpec& m, const MeshSpec& s) {
  const double tp = double(s.tp), D = double(m.d_model), qkv = double(m.qkv_cols());
  const double attn = (D * qkv + D * D) / tp + (m.bias ? qkv / tp + D : 0.0);
  const double mlps = m.experts ? block_expert_params_here(m, s) + double(m.shared_experts) * mlp_params_here(m, s)
                                : mlp_params_here(m, s);
  return attn + mlps + double(m.norm_params(2)) + double(m.router_params());
}
/// Embedding elements on one rank (the vocabulary table splits over tp).
inline double embedding_params_here(const ModelSpec& m, const MeshSpec& s) {
  return double(m.vocab) * double(m.d_model) / double(s.tp) + (m.learned_positions ? double(m.seq * m.d_model) : 0.0);
}
/// Final norm and LM head elements on one rank.
inline double head_params_here(const ModelSpec& m, const MeshSpec& s) {
  return double(m.norm_params(1)) + double(m.d_model) * double(m.vocab) / double(s.tp);
}

/// Microbatches per step: global batch over dp ranks and the micro-batch size.
inline std::size_t microbatches(const ModelSpec& m, const MeshSpec& s) {
  const std::size_t per = s.dp * m.micro_batch;
  return per ? std::max<std::size_t>(1, m.global_batch / per) : 1;
}

/// The chunks of pipeline rank `rank` (0 with pp = 1) and the activation
/// slots each allocates in a step of the mesh's schedule.
inline std::vector<ChunkLayout> rank_layout(const ModelSpec& m, const MeshSpec& s, std::size_t rank) {
  return pipeline_rank_layout(m.layers, s.schedule, s.chunks, s.pp, microbatches(m, s), rank);
}

/// Parameter elements on pipeline rank `rank`, as weft's equal partition
/// places the blocks, the embedding (first stage) and the head (last stage).
inline StageParams stage_params(const ModelSpec& m, const MeshSpec& s, std::size_t rank) {
  StageParams p;
  p.block = block_params_here(m, s);
  p.block_experts = block_expert_params_here(m, s);
  for (const auto& k : chunk_layouts(m.layers, s.pp, s.schedule == Schedule::interleaved && s.pp > 1 ? s.chunks : 1, rank)) {
    p.blocks += double(k.blocks);
    if (k.embedding) p.root += embedding_params_here(m, s);
    if (k.head) p.root += head_params_here(m, s);
  }
  return p;
}

/// Parameter elements on the heaviest pipeline stage of one rank.
inline StageParams stage_params(const ModelSpec& m, const MeshSpec& s) {
  StageParams best = stage_params(m, s, 0);
  for (std::size_t r = 1; r < s.pp; ++r) {
    const StageParams p = stage_params(m, s, r);
    if (p.total() > best.total()) best = p;
  }
  return best;
}

/// Per-rank peak bytes of a training step, by category.
struct TrainingBudget {
  double parameters = 0;       ///< weights this rank keeps between steps
  double gradients = 0;        ///< gradients this rank keeps between steps
  double optimizer_state = 0;  ///< moments (and master weights)
  double activations = 0;      ///< tensors saved by forward for backward
  double temporary = 0;        ///< backward scratch and transiently gathered parameters/gradients
  double communication = 0;    ///< staging buffers of collectives and point-to-point
  double headroom = 0;         ///< allocator fragmentation and library workspaces (a fraction of the rest)
  /// Sum of all categories.
  double total() const {
    return parameters + gradients + optimizer_state + activations + temporary + communication + headroom;
  }
};

/// Tokens of one microbatch on one rank (the sequence splits over cp).
inline double rank_tokens(const ModelSpec& m, const MeshSpec& s) {
  return double(m.micro_batch) * double(m.seq) / double(s.cp);
}

/// Context parallelism's per-rank head counts: query heads and K/V heads of
/// one TP rank (K/V replicated when fewer than tp), AllToAll's query and K/V
/// heads per CP rank (K/V replicated when fewer than cp), and the tokens of
/// one sequence on one rank.
struct ContextShape {
  double heads = 0, kv = 0, q_per_rank = 0, kv_per_rank = 0, local_tokens = 0, seq = 0, head_dim = 0;
};
inline ContextShape context_shape(const ModelSpec& m, const MeshSpec& s) {
  ContextShape c;
  c.heads = double(m.heads / s.tp);
  c.kv = double(std::max<std::size_t>(m.kv() / s.tp, 1));
  c.q_per_rank = c.heads / double(s.cp);
  c.kv_per_rank = c.kv >= double(s.cp) ? c.kv / double(s.cp) : 1.0;
  c.seq = double(m.seq);
  c.local_tokens = double(m.seq) / double(s.cp);
  c.head_dim = double(m.head_dim());
  return c;
}

/// Bytes per element of the activations weft moves between ranks in the
/// precision's storage type: product_bytes under a 2-byte precision,
/// act_bytes otherwise. The context-parallel attention's K/V blocks
/// (nn::context_kv_t, context_kv_bytes), the expert-parallel exchange's rows
/// (nn::MoE::row_bytes) and the pipeline's messages
/// (pipeline::Executor::wire_type) travel at this width; TP's partial sums
/// and CP's dK/dV sums stay act_bytes.
inline double wire_bytes(const ModelSpec& m) { return m.product_bytes ? double(m.product_bytes) : double(m.act_bytes); }

/// Bytes per element of the K/V blocks the context-parallel attention
/// exchanges and reads (nn::context_kv_t): wire_bytes.
inline double context_kv_bytes(const ModelSpec& m) { return wire_bytes(m); }

/// Bytes the context-parallel attention of one block keeps of its own
/// from forward to backward, for one microbatch (weft::context::
/// ContextAttention::owned_bytes): none for Ring; AllGather the K/V of the
/// whole sequence; AllToAll the head-sharded Q, K, V, output and
/// log-sum-exp over the whole sequence. K and V at context_kv_bytes, the
/// rest at act_bytes. 0 with cp = 1.
inline double context_saved_bytes(const ModelSpec& m, const MeshSpec& s) {
  if (s.cp <= 1) return 0;
  const ContextShape c = context_shape(m, s);
  const double B = double(m.micro_batch), a = double(m.act_bytes), w = context_kv_bytes(m);
  switch (s.context) {
    case ContextKind::ring: return 0;
    case ContextKind::allgather: return B * 2 * c.kv * c.seq * c.head_dim * w;
    case ContextKind::alltoall:
      return B * ((2 * c.q_per_rank * c.seq * c.head_dim + c.q_per_rank * c.seq) * a +
                  2 * c.kv_per_rank * c.seq * c.head_dim * w);
  }
  return 0;
}

/// The largest set of buffers the context-parallel attention holds at once
/// during one sequence's forward or backward, in bytes (weft::context::
/// ContextAttention::peak_buffer_bytes; sequences and blocks run one after
/// another, so this is a peak, not a sum). K/V blocks at context_kv_bytes,
/// everything else (partial results, gradients) at act_bytes. 0 with cp = 1.
///   Ring: forward the current and next K/V blocks and one chunk's partial
///   output and log-sum-exp; backward the two K/V blocks, this step's dK/dV
///   part and the incoming and outgoing sums (5 blocks of 2 kv T/cp hd).
///   AllGather: forward this rank's K/V and the gathered cp blocks; backward
///   dK/dV over the whole sequence, their scattered copy and this rank's sum.
///   AllToAll: backward's head-sharded dO, dQ, dK, dV over the whole
///   sequence beside one exchange's send and receive buffers.
inline double context_buffer_bytes(const ModelSpec& m, const MeshSpec& s) {
  if (s.cp <= 1) return 0;
  const ContextShape c = context_shape(m, s);
  const double P = double(s.cp), tl = c.local_tokens, hd = c.head_dim, kvb = 2 * c.kv * tl * hd;
  const double a = double(m.act_bytes), w = context_kv_bytes(m);
  switch (s.context) {
    case ContextKind::ring: {
      const double chunk = tl / 2;
      return std::max(2 * kvb * w + c.heads * chunk * (hd + 1) * a, 2 * kvb * w + 3 * kvb * a);
    }
    case ContextKind::allgather: return std::max(kvb * (1 + P) * w, (2 * (2 * c.kv * c.seq * hd) + kvb) * a);
    case ContextKind::alltoall: {
      const double exchange = 2 * std::max(c.heads, P * c.kv_per_rank) * tl * hd;
      return ((2 * c.q_per_rank + 2 * c.kv_per_rank) * c.seq * hd + exchange) * a;
    }
  }
  return 0;
}

/// Activation elements saved per block for one microbatch (what nn::Block,
/// nn::Attention and nn::MLP keep; see docs/model.md), on one rank.
inline double block_saved_elements(const ModelSpec& m, const MeshSpec& s) {
  const double n = rank_tokens(m, s), D = double(m.d_model), tp = double(s.tp);
  const double heads = double(m.heads) / tp, T = double(m.seq), Tq = T / double(s.cp), B = double(m.micro_batch);
  const double routed = double(m.mlp_passes());  // MLP rows a token
  // Sequence parallelism splits the element-wise region over the tokens, and
  // the attention and MLP keep their all-gathered inputs for backward.
  const double sp = s.sequence_split();
  // A MoE block routes its own token shard under sequence parallelism: its
  // rows are n / sp and its input is not gathered (nn::Block::moe_rows).
  const double mlp_rows = m.experts ? n / sp : n;
  double e = 2 * 2 * n / sp;                                 // two norms' mean and 1/std
  e += 3 * n * D / sp;                                       // h1, mid, h2
  if (sp > 1) e += (m.experts ? 1 : 2) * n * D;              // gathered inputs of QKV and (dense) MLP up
  e += n * double(m.qkv_cols()) / tp;                        // fused Q, K, V
  // Context parallelism runs the blockwise kernel on every variant: no probabilities.
  if (!m.flash_attention && s.cp == 1) e += B * heads * Tq * T;  // probabilities
  e += B * heads * Tq;                                       // log-sum-exp
  e += n * D / tp;                                           // heads before Wo
  e += routed * mlp_rows * double(m.up_cols() + m.hidden()) / mlp_tp_split(m, s);  // MLP up output and activation
  if (m.experts) e += mlp_rows * double(m.experts);          // router logits
  return e;
}

/// Of block_saved_elements, the statistics (two norms' means and 1 / std,
/// the attention's log-sum-exps) that a 2-byte stash keeps in full width.
inline double block_statistic_elements(const ModelSpec& m, const MeshSpec& s) {
  const double n = rank_tokens(m, s), heads = double(m.heads) / double(s.tp), Tq = double(m.seq) / double(s.cp);
  return 2 * 2 * n / s.sequence_split() + double(m.micro_batch) * heads * Tq;
}

/// Elements of the staging that weft's 2-byte products grow (ModelSpec::
/// product_bytes; nn::ProductStaging): slot 0 the largest weight a rank
/// holds, slot 1 the largest input of a product ([tokens, D] gathered under
/// sequence parallelism, the heads' and the MLP's hidden outputs), slot 2
/// the largest output gradient (QKV, D, the MLP's up output, the logits);
/// with the BLAS attention (whole sequences on a rank, no blockwise kernel)
/// slots 3-5 its products' operands: Q, K and V [tokens, QKV / tp], the
/// heads' output gradient [tokens, D / tp] and one head's [T, T]
/// probabilities; slots 8 and 9 the compute copies of the parameters read
/// outside the products (the largest bias, norm scale or position table,
/// and a LayerNorm's shift). Dense blocks; a MoE block's experts take rows
/// by capacity, not counted, nor are the expert exchange's slots 6 and 7
/// (stage_memory adds those).
inline double product_staging_elements(const ModelSpec& m, const MeshSpec& s) {
  const double n = rank_tokens(m, s), D = double(m.d_model), tp = double(s.tp);
  const double qkv = double(m.qkv_cols()) / tp, up = double(m.up_cols()) / mlp_tp_split(m, s);
  const double F = double(m.hidden()) / mlp_tp_split(m, s), V = double(m.vocab) / tp;
  const double weight = std::max({D * qkv, D / tp * D, D * up, F * D, D * V});
  const double input = n * std::max({D, F});
  const double output_grad = n * std::max({qkv, D, up, V});
  const double T = double(m.seq);
  const double attention = !m.flash_attention && s.cp == 1 ? n * qkv + n * D / tp + T * T : 0.0;
  // The compute copies of the parameters read outside the products
  // (nn::ComputeCopies, slots 8 and 9): the largest of a bias, a norm's
  // scale and the position table; a LayerNorm's shift beside its scale.
  const double vectors = std::max({m.bias ? std::max({qkv, D, up}) : 0.0, D, m.learned_positions ? T * D : 0.0}) +
                         (m.layernorm ? D : 0.0);
  return weight + input + output_grad + attention + vectors;
}

/// Backward scratch elements shared by all blocks for one microbatch
/// (nn::Block::Workspace plus the GPT's residual-stream gradients).
inline double backward_scratch_elements(const ModelSpec& m, const MeshSpec& s) {
  const double n = rank_tokens(m, s), D = double(m.d_model), tp = double(s.tp);
  const double heads = double(m.heads) / tp, T = double(m.seq), Tq = T / double(s.cp), B = double(m.micro_batch);
  const double routed = double(m.mlp_passes());  // MLP rows a token
  // Sequence parallelism: the residual-stream gradients are on token shards;
  // attention and MLP each keep a [tokens, D] buffer for the gathered output
  // gradient and the partial input gradient, and the head one for its
  // partial input gradient before the reduce-scatter.
  const double sp = s.sequence_split();
  const double mlp_rows = m.experts ? n / sp : n;            // a MoE block's rows (its token shard under sp)
  double e = n * double(m.qkv_cols()) / tp + n * D / tp;    // dqkv, dheads
  if (!m.flash_attention && s.cp == 1) e += B * heads * Tq * T;  // dprobs
  e += routed * mlp_rows * double(m.up_cols() + m.hidden()) / mlp_tp_split(m, s);  // dup, dact
  if (sp > 1) e += (m.experts ? 1 : 2) * n * D;              // attention's and (dense) MLP's gathered gradients
  e += 2 * n * D / sp;                                       // dh, dmid
  if (m.recompute) e += n * D / sp;                          // recomputed block output
  e += 3 * n * D / sp;                                       // two residual gradients and the final norm's
  if (sp > 1) e += n * D;                                    // the head's partial input gradient
  return e;
}

/// Bytes of the pipeline send buffers of pipeline rank `rank`: when a slot
/// retires while its input-gradient send is still in flight, the executor
/// moves the send to one of pipeline_send_cap() buffers of one message each,
/// allocated up front on a rank with a chunk that sends gradients (any but
/// the embedding chunk), and waits when all are in flight
/// ("pipeline.send_buffers"; weft/parallel/pipeline/send_cap.hpp). None
/// without a pipeline, and none under a 2-byte precision, whose sends
/// detach their wire buffers instead (pipeline_wire_buffer_bytes).
inline double pipeline_send_buffer_bytes(const ModelSpec& m, const MeshSpec& s, std::size_t rank) {
  if (s.pp <= 1 || m.product_bytes) return 0.0;
  const double seq_split = s.sequence_split();
  const double cap = double(pipeline_send_cap(s.schedule, s.chunks, s.pp, microbatches(m, s)));
  for (const ChunkLayout& k : rank_layout(m, s, rank))
    if (!k.embedding) return cap * rank_tokens(m, s) * double(m.d_model) / seq_split * double(m.act_bytes);
  return 0.0;
}

/// An upper bound on the bytes of the 2-byte wire buffers of pipeline rank
/// `rank` under a 2-byte precision (product_bytes set; 0 otherwise): one per
/// message of each slot the rank allocates -- the chunk input received and
/// the input gradient sent unless the chunk holds the embedding, the output
/// sent and the output gradient received unless it holds the head -- plus
/// pipeline_send_cap() detached gradient sends, each [n, D / sequence split]
/// at product_bytes. The executor pools them by shape and returns a buffer
/// once its message completes ("pipeline.wire_buffers"), so how many exist
/// depends on when MPI completes messages: fewer than this.
inline double pipeline_wire_buffer_bytes(const ModelSpec& m, const MeshSpec& s, std::size_t rank) {
  if (s.pp <= 1 || !m.product_bytes) return 0.0;
  double messages = 0;
  bool sends_gradients = false;
  for (const ChunkLayout& k : rank_layout(m, s, rank)) {
    messages += double(k.slots) * 2.0 * ((k.embedding ? 0.0 : 1.0) + (k.head ? 0.0 : 1.0));
    sends_gradients = sends_gradients || !k.embedding;
  }
  if (sends_gradients) messages += double(pipeline_send_cap(s.schedule, s.chunks, s.pp, microbatches(m, s)));
  return messages * rank_tokens(m, s) * double(m.d_model) / s.sequence_split() * double(m.product_bytes);
}

/// The training peak of pipeline rank `rank` (0 with pp = 1) of model m on
/// layout s. headroom_fraction is the allocator and library allowance on top
/// of everything weft allocates.
inline TrainingBudget stage_memory(const ModelSpec& m, const MeshSpec& s, std::size_t rank,
                                   double headroom_fraction = 0.10) {
  m.validate();
  const StageParams sp = stage_params(m, s, rank);
  const double S = sp.total(), dp = double(s.dp), pb = double(m.param_bytes), gb = double(m.grad_bytes);
  TrainingBudget b;
  // Persistent state by mode (parallel::DataParallel's buffers). Under EP
  // (parallel::ExpertDataParallel) the routed experts are sharded over the
  // dp / ep ranks that hold the same experts, everything else over all dp.
  const double shard = (S - sp.experts()) / dp + sp.experts() / (dp / double(s.ep));
  // zero2 and fsdp build a group's full gradient while its backward runs and
  // free it when its reduce-scatter completes. The root's lives through all of
  // backward (its head runs first, its embedding last); the block before the
  // current one is usually still in flight. fsdp's waits on all-gathers drive
  // MPI's progress, so no more than that stays alive; zero2 waits on nothing
  // during backward, so how many stay alive depends on when MPI progresses
  // them: between two groups and all of them. The budget takes the upper
  // bound (measured: docs/plan.md).
  const double two_groups = sp.root + std::min(2.0, sp.blocks) * sp.block;
  const double zero2_grads = s.dp > 1 ? S : two_groups;  // (under zb: S in any case, below)
  // fsdp gathers the root for the whole microbatch and a block plus the
  // prefetched next one. In a pipeline, forwards and backwards of different
  // microbatches alternate, and a prefetch still in flight when the schedule
  // turns keeps one more block gathered, depending on when MPI completes it
  // (measured: root + 2 or root + 3 blocks, docs/plan.md): the budget takes
  // the upper bound.
  const double gathered = s.pp > 1 ? sp.root + std::min(3.0, sp.blocks) * sp.block : two_groups;
  // A zero-bubble schedule splits each backward and runs the weight halves
  // late: zero2 and fsdp then keep every group's full gradient from its first
  // backward of the step to its last weight half, and reduce-scatter it once
  // per step (DataParallel::set_weight_gradients_deferred), so all of the
  // stage's gradients are held at once.
  const bool split = s.pp > 1 && s.schedule == Schedule::zero_bubble;
  const double held_grads = split ? S : two_groups;
  switch (s.mode) {
    case DPMode::replicate:
      b.parameters = S * pb;
      b.gradients = S * gb;
      break;
    case DPMode::zero1:
      b.parameters = S * pb;
      b.gradients = (S + shard) * gb;
      b.communication += shard * pb;  // send buffer of the updated shard's all-gather
      break;
    case DPMode::zero2:
      b.parameters = S * pb;
      b.gradients = shard * gb;
      b.temporary += (split ? S : zero2_grads) * gb;
      b.communication += shard * pb + shard * gb;  // all-gather send, reduce-scatter receive
      break;
    case DPMode::fsdp:
      b.parameters = shard * pb;
      b.gradients = shard * gb;
      b.temporary += gathered * pb + held_grads * gb;
      b.communication += shard * gb;  // reduce-scatter receive
      break;
  }
  const double opt_elems = s.mode == DPMode::replicate ? S : shard;
  b.optimizer_state = opt_elems * double(m.optimizer_bytes_per_param());

  // Activations, per chunk of this rank: each activation slot (one in-flight
  // microbatch) holds the saved tensors of the chunk's blocks (none under
  // recompute, where one set serves every block of the rank), its residual stream (the chunk's input and each block's
  // output), and on the head chunk the final norm (output and statistics)
  // and the logits; under sequence parallelism the residuals and norms are on
  // token shards and the head keeps the gathered final-norm output too. A
  // slot also holds the chunk's message buffers, counted as communication:
  // the received output gradient (all but the head chunk) and the input
  // gradient to send (all but the embedding chunk). The number of slots a
  // chunk allocates is what the executor holds at its peak for the schedule
  // (pipeline.hpp: executor_slots); a single process holds one.
  const double n = rank_tokens(m, s), D = double(m.d_model), a = double(m.act_bytes);
  const double seq_split = s.sequence_split();
  const double head = (n * D + 2 * n) / seq_split + (seq_split > 1 ? n * D : 0.0) + n * double(m.vocab) / double(s.tp);
  // Under zb a slot also keeps, for the deferred weight halves, a copy of
  // the output gradient of each of its linear layers (QKV, attention output,
  // MLP up and down per block; the LM head), pooled with the slot
  // (pipeline.deferred_output_gradients). A MoE block's experts defer theirs
  // for top_k rows a token, and its router for the logits.
  const double tp = double(s.tp), routed = double(m.mlp_passes());
  const double deferred_block =
      split ? n * (double(m.qkv_cols()) / tp + D + routed * (double(m.up_cols()) / mlp_tp_split(m, s) + D) +
                   (m.experts ? double(m.experts) : 0.0))
            : 0.0;
  const double deferred_head = split ? n * double(m.vocab) / tp : 0.0;
  // weft's GPT and its pipeline stages keep 2-byte copies (without
  // recompute) of every block input and of the saved tensors of dense
  // blocks. The GPT's residual stream is then two float buffers; a stage's
  // slot keeps its chunk's input and output in float, and the stage has two
  // float buffers for the stream between a chunk's blocks (temporary).
  const bool narrow_inputs = m.saved_bytes != 0 && m.saved_bytes != m.act_bytes && !m.recompute;
  const bool stash = narrow_inputs && !m.experts;
  // Under recompute, or with 2-byte copies of the saved activations, the
  // deferred work also copies each linear layer's input (the shared or
  // working set it read is refilled before the weight halves run): QKV's
  // and the MLP up's (the router's too) [n, D], the attention output's
  // [n, D / tp], the MLP down's [n, hidden / tp], per routed row; the head's [n, D].
  const bool copies = split && (m.recompute || narrow_inputs);
  const double deferred_inputs_block =
      copies ? n * (D + D / tp + routed * (D + double(m.hidden()) / mlp_tp_split(m, s)) + (m.experts ? D : 0.0)) : 0.0;
  const double deferred_inputs_head = copies ? n * D : 0.0;
  const double narrow = block_saved_elements(m, s) - block_statistic_elements(m, s);
  bool any_blocks = false;
  std::size_t most_blocks = 0;
  for (const ChunkLayout& k : rank_layout(m, s, rank)) {
    any_blocks = any_blocks || k.blocks > 0;
    most_blocks = std::max(most_blocks, k.blocks);
    const double blocks = double(k.blocks), sets = m.recompute ? 0.0 : blocks;
    // Each block's context-parallel attention keeps its own copies (every
    // block, recompute or not: they are the attention's, not the block's).
    const double slot = sets * block_saved_elements(m, s) + (blocks + 1) * n * D / seq_split + (k.head ? head : 0.0) +
                        blocks * (deferred_block + deferred_inputs_block) +
                        (k.head ? deferred_head + deferred_inputs_head : 0.0);
    const double messages = (k.head ? 0.0 : n * D / seq_split) + (k.embedding ? 0.0 : n * D / seq_split);
    b.activations += double(k.slots) * (slot * a + blocks * context_saved_bytes(m, s));
    // Dense blocks that keep saved_bytes copies (ModelSpec::saved_bytes) hold
    // their saved tensors, statistics apart, at that width instead.
    if (stash) b.activations += double(k.slots) * sets * narrow * (double(m.saved_bytes) - a);
    // Block inputs: the GPT's at saved_bytes (blocks + 1 floats counted
    // above become one); a stage slot's at saved_bytes beside its chunk's
    // float input and output (min(blocks + 1, 2) floats).
    if (narrow_inputs) {
      const double row = n * D / seq_split;
      if (s.pp == 1) b.activations += double(k.slots) * blocks * row * (double(m.saved_bytes) - a);
      else b.activations += double(k.slots) * (blocks * row * double(m.saved_bytes) - std::max(blocks - 1.0, 0.0) * row * a);
    }
    b.communication += double(k.slots) * messages * a;
  }
  if (m.recompute && any_blocks) b.activations += block_saved_elements(m, s) * a;  // the shared set
  if (stash && any_blocks) b.temporary += block_saved_elements(m, s) * a;  // the stashes' float working set
  if (narrow_inputs && s.pp > 1 && most_blocks >= 2) b.temporary += 2 * n * D / seq_split * a;  // a stage's residual pair
  if (m.product_bytes) b.temporary += product_staging_elements(m, s) * double(m.product_bytes);
  b.communication += pipeline_send_buffer_bytes(m, s, rank) + pipeline_wire_buffer_bytes(m, s, rank);
  b.temporary += backward_scratch_elements(m, s) * a;
  // Tensor parallelism: the vocabulary-parallel cross-entropy's per-token
  // maximum, sum of exponentials and target logit (every stage allocates
  // them), and under sequence parallelism the embedding's [tokens, D] buffer
  // of partial lookups and gathered gradients.
  if (s.tp > 1) {
    b.temporary += 3 * n * a;
    if (seq_split > 1)
      for (const ChunkLayout& k : rank_layout(m, s, rank))
        if (k.embedding) b.temporary += n * D * a;
  }

  // Other strategies' staging: expert dispatch and combine, and the
  // context-parallel attention's largest set of exchange buffers.
  if (m.experts && s.ep > 1) b.communication += 2 * n / seq_split * double(m.top_k) * D * a;
  // Under a 2-byte precision the rows travel through two more staging slots
  // (sent and received rows, product_bytes each; nn::ProductStaging 6 and 7).
  if (m.experts && s.ep > 1 && m.product_bytes)
    b.temporary += 2 * n / seq_split * double(m.top_k) * D * double(m.product_bytes);
  if (s.cp > 1) b.communication += context_buffer_bytes(m, s);

  b.headroom = headroom_fraction * (b.total());
  return b;
}

/// The per-rank training peak of model m on layout s: the heaviest pipeline
/// stage's budget (the only one with pp = 1).
inline TrainingBudget training_memory(const ModelSpec& m, const MeshSpec& s, double headroom_fraction = 0.10) {
  TrainingBudget best = stage_memory(m, s, 0, headroom_fraction);
  for (std::size_t r = 1; r < s.pp; ++r) {
    const TrainingBudget b = stage_memory(m, s, r, headroom_fraction);
    if (b.total() > best.total()) best = b;
  }
  return best;
}

/// What a serving replica must hold.
struct ServeSpec {
  std::size_t batch = 1;        ///< concurrent sequences
  std::size_t context = 4096;   ///< tokens of context per sequence (prompt + generated)
  std::size_t kv_bytes = 2;     ///< bytes per cached key/value element
  std::size_t prefill_chunk = 2048;  ///< prompt tokens processed per forward (sizes the workspace)
};

/// Per-rank inference memory by category.
struct InferenceBudget {
  double weights = 0;    ///< resident parameters
  double kv_cache = 0;   ///< keys and values of every layer for batch x context
  double workspace = 0;  ///< one prefill chunk's activations and the logits of a decode step
  double buffers = 0;    ///< tensor-parallel all-reduce staging
  double headroom = 0;   ///< allocator and library allowance
  /// Sum of all categories.
  double total() const { return weights + kv_cache + workspace + buffers + headroom; }
};

/// Inference memory of one rank of a replica sharded tp x pp (dp and cp are
/// replicas, not shards, here). Key/value heads fewer than tp are replicated.
inline InferenceBudget inference_memory(const ModelSpec& m, std::size_t tp, std::size_t pp, const ServeSpec& q,
                                        double headroom_fraction = 0.10) {
  m.validate();
  MeshSpec s;
  s.tp = tp;
  s.pp = pp;
  const StageParams sp = stage_params(m, s);
  InferenceBudget b;
  b.weights = sp.total() * double(m.param_bytes);
  const double kv_here = std::max(1.0, double(m.kv()) / double(tp));
  b.kv_cache = 2.0 * sp.blocks * kv_here * double(m.head_dim()) * double(q.context) * double(q.batch) * double(q.kv_bytes);
  const double c = double(std::min(q.prefill_chunk, q.context)), D = double(m.d_model), a = double(m.act_bytes);
  const double routed = double(m.mlp_passes());  // MLP rows a token
  b.workspace = c * (3 * D + double(m.qkv_cols()) / double(tp) + routed * double(m.up_cols() + m.hidden()) / mlp_tp_split(m, s)) * a +
                double(q.batch) * double(m.vocab) / double(tp) * 4.0;
  // A MoE block's router logits and its grouped expert inputs and outputs (top_k rows a token).
  if (m.experts) b.workspace += c * (double(m.experts) + 2 * double(m.top_k) * D) * a;
  b.buffers = tp > 1 ? 2 * c * D * a : 0.0;
  b.headroom = headroom_fraction * b.total();
  return b;
}

}  // namespace weft::plan
