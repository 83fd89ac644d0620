// nn::MoE: a mixture-of-experts MLP. A linear router scores each token
// against N experts (softmax or sigmoid), sends it to its top k, and the
// block's output is the gate-weighted sum of those experts' outputs (each an
// nn::MLP run as one gemm chain on its contiguous group of tokens), plus
// optional shared experts every token passes through. Capacity, drops, the
// balancing losses and the selection bias are defined in docs/moe.md.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/comm/node_local.hpp>
#include <weft/nn/linear.hpp>
#include <weft/nn/mlp.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::nn {

namespace detail {
// dst(g) = src(perm(g)) (gather) or dst(perm(g)) = src(g) (scatter), g < rows.
// A free function: nvcc refuses extended lambdas in private members.
template <class M, class P>
void moe_permute_rows(const M& src, const P& perm, const M& dst, std::size_t rows, bool gather) {
  const std::size_t D = src.extent(1);
  using exec = typename M::execution_space;
  Kokkos::parallel_for(
      "weft::moe_permute", Kokkos::RangePolicy<exec>(0, rows), KOKKOS_LAMBDA(std::size_t g) {
        const std::size_t a = gather ? g : std::size_t(perm(g)), b = gather ? std::size_t(perm(g)) : g;
        for (std::size_t j = 0; j < D; ++j) dst(a, j) = src(b, j);
      });
}

// ------------------------------------------------------------ node-shared exchange
// Expert parallelism between the ranks of one node, on host memory: every
// forward pass's expert-side rows live in one MPI shared-memory window per
// MoE::Saved (each EP rank's segment holds its grouped inputs gx, outputs gy,
// output gradients dgy and input gradients dgx), so a token's rank writes its
// rows straight into the rows of the expert's rank that hold them, and reads
// the experts' outputs from there for the gate-weighted sum: the gather, the
// exchange and the permutation by expert are one pass, and so are the
// exchange back and the combine (docs/moe.md, "Exchange").
struct MoEWindow {
  std::unique_ptr<weft::detail::SharedSegment> seg;
  std::vector<char*> data;  // every rank's segment from its first 64-byte boundary
  std::size_t rows = 0, cols = 0, elem = 0;
  weft::detail::SyncSite site;

  MoEWindow(const MoEWindow&) = delete;
  MoEWindow& operator=(const MoEWindow&) = delete;
  // Collective over `comm` (every rank with the same rows and cols).
  MoEWindow(Comm& comm, std::size_t rows_, std::size_t cols_, std::size_t elem_)
      : rows(rows_), cols(cols_), elem(elem_), site(weft::detail::sync_site(comm)) {
    bool aligned = true;
    seg = weft::detail::allocate_shared_segment(comm.native(), comm.name(), 4 * rows * cols * elem + 64, 1,
                                                "weft::nn::MoE exchange rows", aligned);
    for (char* b : seg->bases) {
      const auto a = reinterpret_cast<std::uintptr_t>(b);
      data.push_back(b + (64 - a % 64) % 64);
    }
    // Every owner has zero-filled its segment before anyone writes into it.
    weft::detail::shared_barrier(site, "the barrier after allocating the MoE exchange window");
  }
  // Collective over the EP ranks (they destroy their passes' buffers at the
  // same points of the program); left allocated when MPI is finalised or the
  // process is leaving with an error, as the staging window is.
  ~MoEWindow() {
    if (!seg) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin || std::uncaught_exceptions() > 0 || weft::detail::comm_poisoned()) return;
    weft::detail::free_shared_segment(*seg);
  }
  std::size_t bytes() const { return seg ? seg->bytes : 0; }
  // Matrix m (0 gx, 1 gy, 2 dgy, 3 dgx) of EP rank r.
  template <class T>
  T* mat(std::size_t r, int m) const {
    return reinterpret_cast<T*>(data[r]) + std::size_t(m) * rows * cols;
  }
  // Makes this rank's writes visible to its peers and theirs to it, once every
  // rank has arrived (the unified memory model's rule for load/store access).
  void sync(const char* what) {
    MPI_Win_sync(seg->win);
    weft::detail::shared_barrier(site, what);
    MPI_Win_sync(seg->win);
  }
};

// Row pointers of a host matrix whose rows are contiguous.
template <class V>
auto moe_rows(const V& v, const char* what) {
  WEFT_REQUIRE(v.extent(0) == 0 || v.extent(1) <= 1 || v.stride(1) == 1, ShapeError, "nn::MoE: the ", what,
               " must have contiguous rows for the node-shared exchange (stride ", v.stride(1), ")");
  return std::pair{v.data(), std::size_t(v.stride(0))};
}

// Row r of the rows this rank routes goes to row dest[r] of EP rank peer[r]'s
// matrix m: dst = src(row_token(r)), times row_gate(r) when `gated`. With
// `dgate` (the backward of the combine), also dgate(slot(r)) = src(t) . that
// row of the peer's outputs (matrix 1), in the same pass over the row. W is
// the window's element type: T, or the 2-byte type of a mixed Precision
// (each written value rounded once, each read one widened exactly).
template <class T, class W = T, class SV, class IV, class GV, class DG>
void moe_push_rows(const SV& src, const IV& row_token, const GV& row_gate, bool gated, const MoEWindow& w, int m,
                   const int* peer, const int* dest, std::size_t rows, const DG* dgate, const int* row_slot) {
  const std::size_t D = w.cols;
  std::vector<W*> base(w.data.size()), outs(w.data.size());
  for (std::size_t r = 0; r < base.size(); ++r) {
    base[r] = w.mat<W>(r, m);
    outs[r] = w.mat<W>(r, 1);
  }
  W* const* b = base.data();
  W* const* y = outs.data();
  const auto src_rows = moe_rows(src, "rows sent");  // (no structured binding: lambdas cannot capture one in C++20)
  const auto sp = src_rows.first;
  const std::size_t ss = src_rows.second;
  const bool grad = dgate != nullptr;
  DG dg = grad ? *dgate : DG();
  Kokkos::parallel_for(
      "weft::moe_push_rows", Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(0, rows), [=](std::size_t r) {
        const T* __restrict x = sp + std::size_t(row_token(r)) * ss;
        W* __restrict dst = b[peer[r]] + std::size_t(dest[r]) * D;
        if constexpr (std::is_same_v<W, T>) {
          if (gated)
            ops::detail::row_scale_to(dst, x, T(row_gate(r)), D);
          else
            std::memcpy(dst, x, D * sizeof(T));
        } else if (gated) {
          const T g = T(row_gate(r));
          for (std::size_t j = 0; j < D; ++j) dst[j] = W(g * x[j]);
        } else {
          for (std::size_t j = 0; j < D; ++j) dst[j] = W(x[j]);
        }
        if (grad) {
          const W* __restrict yr = y[peer[r]] + std::size_t(dest[r]) * D;
          dg(row_slot[r]) = ops::detail::lane_sum<T>(D, [=](std::size_t j) { return x[j] * T(yr[j]); });
        }
      });
  Kokkos::DefaultHostExecutionSpace().fence();
}

// out(t) = sum over token t's kept slots, in choice order, of (row_gate when
// `gated`) x row dest[r] of EP rank peer[r]'s matrix m, r = slot_row(t K + q);
// the window's elements are W (widened exactly when 2-byte).
template <class T, class W = T, class OV, class IV, class GV>
void moe_pull_sum(const OV& out, const IV& slot_row, const GV& row_gate, bool gated, const MoEWindow& w, int m,
                  const int* peer, const int* dest, std::size_t n, std::size_t K) {
  const std::size_t D = w.cols;
  std::vector<const W*> base(w.data.size());
  for (std::size_t r = 0; r < base.size(); ++r) base[r] = w.mat<W>(r, m);
  const W* const* b = base.data();
  const auto out_rows = moe_rows(out, "output");
  const auto op = out_rows.first;
  const std::size_t os = out_rows.second;
  Kokkos::parallel_for(
      "weft::moe_pull_sum", Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(0, n), [=](std::size_t t) {
        T* __restrict o = op + t * os;
        bool first = true;
        for (std::size_t q = 0; q < K; ++q) {
          const int r = slot_row(t * K + q);
          if (r < 0) continue;
          const W* __restrict src = b[peer[r]] + std::size_t(dest[r]) * D;
          const T g = gated ? T(row_gate(r)) : T(1);
          if constexpr (std::is_same_v<W, T>) {
            if (first)
              ops::detail::row_scale_to(o, src, g, D);
            else
              ops::detail::row_axpy(o, src, g, D);
          } else if (first) {
            for (std::size_t j = 0; j < D; ++j) o[j] = g * T(src[j]);
          } else {
            for (std::size_t j = 0; j < D; ++j) o[j] += g * T(src[j]);
          }
          first = false;
        }
        if (first)
          for (std::size_t j = 0; j < D; ++j) o[j] = T(0);
      });
  Kokkos::DefaultHostExecutionSpace().fence();
}

// Which exchange EP takes between host ranks of one node: the node-shared
// rows (default) or MPI's all_to_allv; WEFT_MOE_EXCHANGE=mpi forces the
// latter (every rank must see the same value). Read once.
inline bool moe_node_exchange_allowed() {
  static const bool v = [] {
    const char* e = std::getenv("WEFT_MOE_EXCHANGE");
    if (e == nullptr || std::strcmp(e, "node") == 0) return true;
    WEFT_REQUIRE(std::strcmp(e, "mpi") == 0, ConfigError, "WEFT_MOE_EXCHANGE must be 'node' or 'mpi', got '", e, "'");
    return false;
  }();
  return v;
}
}  // namespace detail

/// Routing statistics of MoE layers, summed over the forward passes (and,
/// when merged, the layers) since the last reset.
struct MoEStats {
  std::vector<double> selected;  ///< per expert (per layer when merged): slots the router chose, before capacity
  double tokens = 0;             ///< tokens routed (each counted once per layer)
  double slots = 0;              ///< token-expert slots chosen: tokens x k
  double dropped = 0;            ///< slots over capacity, not computed
  double entropy_sum = 0;        ///< sum over tokens of the entropy (nats) of the normalised scores
  double aux_loss = 0;           ///< sum over passes of the load-balancing loss (with its coefficient)
  double z_loss = 0;             ///< sum over passes of the router z-loss (with its coefficient)
  std::size_t passes = 0;        ///< forward passes summed (layers x microbatches when merged)
  std::size_t layers = 0;        ///< layers merged (1 for one layer's own statistics)
  double a2a_bytes = 0;          ///< bytes this rank sent in the expert-parallel all_to_allv calls (dispatch and combine, forward and backward)
  double a2a_seconds = 0;        ///< seconds this rank spent in them (blocking calls: all of it is exposed)
  /// Route quality, per expert (per layer when merged, as `selected`): the
  /// summed cross-entropy of the tokens whose kept slots went to the expert
  /// (a token counts once per kept slot), and that number of slots; the
  /// mean is route_loss_sum / route_loss_slots. Empty when the model did not
  /// measure it (nn::GPT does, MoE::record_route_losses; a pipeline stage
  /// does not).
  std::vector<double> route_loss_sum, route_loss_slots;

  /// Whether anything was recorded.
  bool empty() const { return passes == 0; }
  /// Smallest count in `selected`.
  double min_tokens() const { return selected.empty() ? 0 : *std::min_element(selected.begin(), selected.end()); }
  /// Largest count in `selected`.
  double max_tokens() const { return selected.empty() ? 0 : *std::max_element(selected.begin(), selected.end()); }
  /// Mean count in `selected`.
  double mean_tokens() const {
    return selected.empty() ? 0 : std::accumulate(selected.begin(), selected.end(), 0.0) / double(selected.size());
  }
  /// max / mean of the per-expert counts (1: perfectly balanced).
  double imbalance() const { return mean_tokens() > 0 ? max_tokens() / mean_tokens() : 0; }
  /// Mean routing entropy per token and layer (nats; log N is uniform routing).
  double entropy() const { return tokens > 0 ? entropy_sum / tokens : 0; }
  /// Mean load-balancing loss per layer and pass.
  double mean_aux_loss() const { return passes ? aux_loss / double(passes) : 0; }
  /// Mean z-loss per layer and pass.
  double mean_z_loss() const { return passes ? z_loss / double(passes) : 0; }
  /// The load-balancing term of the objective: summed over the layers,
  /// mean over the forward passes of each layer (the microbatches).
  double aux_loss_term() const { return passes ? aux_loss * double(std::max<std::size_t>(layers, 1)) / double(passes) : 0; }
  /// The z-loss term of the objective, as aux_loss_term.
  double z_loss_term() const { return passes ? z_loss * double(std::max<std::size_t>(layers, 1)) / double(passes) : 0; }
  /// Appends another layer's statistics (its experts are appended to `selected`).
  void merge(const MoEStats& o) {
    selected.insert(selected.end(), o.selected.begin(), o.selected.end());
    tokens += o.tokens;
    slots += o.slots;
    dropped += o.dropped;
    entropy_sum += o.entropy_sum;
    aux_loss += o.aux_loss;
    z_loss += o.z_loss;
    passes += o.passes;
    layers += std::max<std::size_t>(o.layers, 1);
    a2a_bytes += o.a2a_bytes;
    a2a_seconds += o.a2a_seconds;
    route_loss_sum.insert(route_loss_sum.end(), o.route_loss_sum.begin(), o.route_loss_sum.end());
    route_loss_slots.insert(route_loss_slots.end(), o.route_loss_slots.begin(), o.route_loss_slots.end());
  }
  /// Whether the route quality was measured for every merged layer.
  bool route_loss_measured() const { return !route_loss_slots.empty() && route_loss_slots.size() == selected.size(); }
};

/// The mixture-of-experts feed-forward part of a block. Under expert
/// parallelism (the model LayerContext's ExpertSplit) this rank holds N / ep of
/// the routed experts, sends each kept token-expert slot to its expert's rank
/// with all_to_allv and receives the outputs back; routing decisions
/// (capacity, drops, losses, statistics, the bias counts) are made over the
/// whole microbatch of the ExpertSplit's data ranks, so that they are the
/// single process's. Under tensor parallelism without sequence parallelism
/// every TP rank runs the same MoE on the same tokens (the experts are
/// TP-replicated); with sequence parallelism each TP rank routes and runs
/// its own token shard (the TP ranks are data ranks of the ExpertSplit,
/// token_shards = tp) and the block sums the MoE's parameter gradients over
/// TP. Under context parallelism each CP rank routes its share of every
/// sequence: the CP ranks are data ranks too (token_shards = cp, times tp
/// under sequence parallelism), and the model's gradient sum over CP covers
/// the MoE's parameters as every other's (docs/moe.md).
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class MoE {
  using Mat = ops::Matrix<T, Space>;
  using Expert = MLP<T, Space>;

 public:
  /// Activations and routing of one forward pass, kept for backward. Rows of
  /// the grouped buffers are the kept token-expert slots ordered by expert,
  /// and by token index within an expert.
  struct Saved {
    Mat logits;  ///< [tokens, N] router logits u
    Mat xin;     ///< [tokens * k, D] inputs gathered by expert
    Mat eout;    ///< [tokens * k, D] expert outputs
    Mat up;      ///< [tokens * k, F or 2F] the experts' up-projections
    Mat act;     ///< [tokens * k, F] the experts' activations
    Kokkos::View<int*, Space> row_token;  ///< [tokens * k] token of each grouped row
    Kokkos::View<T*, Space> row_gate;     ///< [tokens * k] gate of each grouped row
    Kokkos::View<int*, Space> slot_row;   ///< [tokens * k] grouped row of slot t k + j (-1: dropped)
    std::vector<typename Expert::Saved> shared;  ///< the shared experts' activations
    Mat shared_out;                              ///< [tokens, D] one shared expert's output
    // Host copies of the routing decisions (small: tokens x N).
    std::vector<double> scores;          ///< [tokens * N] scores p (softmax or sigmoid of u)
    std::vector<double> u;               ///< [tokens * N] the logits u
    std::vector<double> lse;             ///< [tokens] logsumexp of u
    std::vector<int> slot_expert;        ///< [tokens * k] expert of slot t k + j (j-th choice of token t)
    std::vector<double> slot_gate;       ///< [tokens * k] gate of the slot
    std::vector<std::size_t> offsets;    ///< [N + 1] first grouped row of each expert
    std::vector<std::size_t> dropped;    ///< slots t k + j dropped by capacity, ascending
    std::vector<double> selected;        ///< [N] slots each expert was chosen for, over the whole microbatch
    double aux = 0, z = 0;               ///< the losses of the pass (with their coefficients)
    double tokens_global = 0;            ///< tokens of the whole microbatch (over the data ranks)
    /// The single-process index of each local token (tokens t of this rank
    /// are contiguous unless the sequences are split over CP); see global_slot.
    std::vector<std::size_t> token_index;
    std::size_t first_token = 0;  ///< token_index[0]
    bool contiguous = true;       ///< token t is first_token + t (token_index left empty)
    /// The single-process index of local slot q (token q / k, choice q % k):
    /// the slot's global token index x k + q % k.
    std::size_t global_slot(std::size_t q, std::size_t k) const {
      return (contiguous ? first_token + q / k : token_index[q / k]) * k + q % k;
    }
    // The expert side. Without expert parallelism gx and gy are xin and eout.
    Mat gx;    ///< [R, D] the rows this rank's experts run on, grouped by local expert
    Mat gy;    ///< [R, D] their outputs
    Mat xrecv; ///< [R, D] rows in the order they arrive (by source rank), and outputs before they go back
    Kokkos::View<int*, Space> perm;      ///< [R] grouped row g arrived as row perm(g)
    std::vector<std::size_t> goffsets;   ///< [local experts + 1] first grouped row of each local expert
    std::vector<int> send_rows, recv_rows;  ///< [ep] rows sent to / received from each EP rank
    /// The node-shared exchange (EP ranks of one node, host memory): the
    /// window that holds gx, gy and their gradients on every EP rank, and,
    /// for each of this rank's grouped rows, the EP rank and the row there
    /// that hold it. Null / empty on the all_to_allv path.
    std::shared_ptr<detail::MoEWindow> window;
    std::vector<int> row_peer, row_dest, row_slot;  ///< row_slot: the slot t k + j of each grouped row
    /// Node-shared path under a mixed Precision: the window holds 2-byte
    /// rows, and gx, gy are this pass's own float copies the experts read and write.
    bool owned_rows = false;

    Saved() = default;
    /// For config c (its tokens per forward pass).
    Saved(const std::string& n, const GPTConfig& c)
        : logits(n + ".logits", c.tokens(), c.experts),
          xin(n + ".xin", c.tokens() * c.top_k, c.d_model),
          eout(n + ".eout", c.tokens() * c.top_k, c.d_model),
          up(n + ".up", c.tokens() * c.top_k, c.expert_width() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          act(n + ".act", c.tokens() * c.top_k, c.expert_width()),
          row_token(n + ".row_token", c.tokens() * c.top_k),
          row_gate(n + ".row_gate", c.tokens() * c.top_k),
          slot_row(n + ".slot_row", c.tokens() * c.top_k),
          shared_out(c.shared_experts ? Mat(n + ".shared_out", c.tokens(), c.d_model) : Mat()) {
      const GPTConfig ec = expert_config(c);
      for (std::size_t i = 0; i < c.shared_experts; ++i) shared.emplace_back(n + ".shared." + std::to_string(i), ec);
    }
    /// Bytes held on the device.
    std::size_t bytes() const {
      std::size_t b = detail::bytes_of(logits) + detail::bytes_of(xin) + detail::bytes_of(eout) +
                      detail::bytes_of(up) + detail::bytes_of(act) + detail::bytes_of(row_token) +
                      detail::bytes_of(row_gate) + detail::bytes_of(slot_row) + detail::bytes_of(shared_out);
      if (xrecv.extent(0)) b += detail::bytes_of(gx) + detail::bytes_of(gy) + detail::bytes_of(xrecv) + detail::bytes_of(perm);
      if (owned_rows) b += detail::bytes_of(gx) + detail::bytes_of(gy);
      if (window) b += window->bytes();
      for (const auto& s : shared) b += s.bytes();
      return b;
    }
  };

  /// Backward scratch.
  struct Workspace {
    Mat dslot;  ///< [tokens * k, D] gate-weighted output gradient per grouped row
    Mat dxin;   ///< [tokens * k, D] input gradient per grouped row
    Mat dup, dact;  ///< [tokens * k, ...] the experts' MLP scratch
    Mat du;     ///< [tokens, N] gradient of the router logits
    Kokkos::View<T*, Space> dgate;  ///< [tokens * k] d/d(gate) per slot
    Mat dtmp;   ///< [tokens, D] a shared expert's input gradient
    typename Expert::Workspace shared;  ///< the shared experts' scratch
    Mat dgx, dgy, drecv;  ///< expert parallelism: [R, D] gradients on the expert side (grouped; as exchanged)
    Workspace() = default;
    /// For config c.
    explicit Workspace(const GPTConfig& c)
        : dslot("moe.dslot", c.tokens() * c.top_k, c.d_model),
          dxin("moe.dxin", c.tokens() * c.top_k, c.d_model),
          dup("moe.dup", c.tokens() * c.top_k, c.expert_width() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          dact("moe.dact", c.tokens() * c.top_k, c.expert_width()),
          du("moe.du", c.tokens(), c.experts),
          dgate("moe.dgate", c.tokens() * c.top_k),
          dtmp(c.shared_experts ? Mat("moe.dtmp", c.tokens(), c.d_model) : Mat()),
          shared(c.shared_experts ? typename Expert::Workspace(expert_config(c)) : typename Expert::Workspace()) {}
    /// Bytes held.
    std::size_t bytes() const {
      return detail::bytes_of(dslot) + detail::bytes_of(dxin) + detail::bytes_of(dup) + detail::bytes_of(dact) +
             detail::bytes_of(du) + detail::bytes_of(dgate) + detail::bytes_of(dtmp) + shared.bytes() +
             detail::bytes_of(dgx) + detail::bytes_of(dgy) + detail::bytes_of(drecv);
    }
  };

  /// The config each expert MLP is built from: c with the expert's hidden width.
  static GPTConfig expert_config(const GPTConfig& c) {
    GPTConfig e = c;
    e.ffn_hidden = c.expert_width();
    return e;
  }

  /// Parameters "<name>.router.weight" [D, N] (no bias),
  /// "<name>.experts.<e>.{up,down}.{weight,bias}", "<name>.shared.<i>...."
  /// and the selection bias "<name>.router.expert_bias" [1, N] (zero at
  /// start). The selection bias is model state, not a trained weight: its
  /// gradient is always zero (so optimizers leave it alone) and
  /// update_bias() moves it; it is a Parameter so that it is saved and
  /// loaded wherever the weights are. Under expert parallelism this rank
  /// builds only its own experts (ep rank r: e = r N/ep .. (r+1) N/ep - 1,
  /// marked ep_sharded), each initialised as in the single process.
  MoE(ContextPtr ctx, const std::string& name, const GPTConfig& c)
      : ctx_(checked(std::move(ctx), name, c)),
        inner_(std::make_shared<LayerContext>(LayerContext{ctx_->profiler, TensorSplit{}, ContextSplit{},
                                                 ctx_->deferred_weight_grads, ExpertSplit{}, ctx_->products,
                                                 nullptr})),
        cfg_(c),
        local_(c.experts / ctx_->ep.ep_size()),
        first_(ctx_->ep.ep_rank() * local_),
        router_(inner_, name + ".router", c.d_model, c.experts, false, c.seed, c.init_std),
        bias_(name + ".router.expert_bias", 1, c.experts, false),
        step_counts_(c.experts, 0.0) {
    Kokkos::deep_copy(bias_.value, T(0));
    Kokkos::deep_copy(bias_.grad, T(0));
    const GPTConfig ec = expert_config(c);
    experts_.reserve(local_);
    for (std::size_t e = first_; e < first_ + local_; ++e) {
      experts_.emplace_back(inner_, name + ".experts." + std::to_string(e), ec);
      if (ctx_->ep.active()) {
        std::vector<Parameter<T, Space>*> ps;
        experts_.back().collect(ps);
        for (auto* p : ps) p->set_ep_sharded(true);
      }
    }
    shared_.reserve(c.shared_experts);
    for (std::size_t i = 0; i < c.shared_experts; ++i) shared_.emplace_back(inner_, name + ".shared." + std::to_string(i), ec);
    stats_.selected.assign(c.experts, 0.0);
    stats_.layers = 1;
  }

  /// Slots per expert for a microbatch of `tokens` tokens (all tokens of the
  /// microbatch, over every rank that shares it): ceil(capacity_factor *
  /// tokens * k / N); with dropless routing, tokens * k (nothing can overflow).
  std::size_t capacity(std::size_t tokens) const {
    if (cfg_.dropless()) return tokens * cfg_.top_k;
    const double c = std::ceil(cfg_.capacity_factor * double(tokens) * double(cfg_.top_k) / double(cfg_.experts) - 1e-9);
    return std::min<std::size_t>(tokens * cfg_.top_k, std::size_t(std::max(c, 0.0)));
  }

  /// out = sum over the token's kept experts of gate * expert(h) (+ the
  /// shared experts), filling s. h, out: [tokens, D].
  template <class HV, class OV>
  void forward(const HV& h, Saved& s, const OV& out) {
    const std::size_t n = h.extent(0);
    WEFT_REQUIRE(s.logits.extent(0) == n && out.extent(0) == n, ShapeError, "nn::MoE: input has ", n,
                 " tokens but the saved activations hold ", s.logits.extent(0), " and the output ", out.extent(0));
    sync_inner();
    router_.forward(h, s.logits);
    route(s, n);
    dispatch_rows(h, s);
    for (std::size_t l = 0; l < local_; ++l) {
      const auto g = group(s, l);
      experts_[l].forward(rows_of(s.gx, g), expert_saved(s, g), rows_of(s.gy, g));
    }
    publish_outputs(s);
    combine_rows(s, out);
    for (std::size_t i = 0; i < shared_.size(); ++i) {
      shared_[i].forward(h, s.shared[i], s.shared_out);
      ops::add(out, out, s.shared_out);
    }
  }

  /// dh = d/dh (overwritten) of sum(dout * out) + loss_weight() * (aux + z);
  /// parameter gradients accumulate.
  template <class HV, class DOV, class DHV>
  void backward(const HV& h, const Saved& s, const DOV& dout, const DHV& dh, Workspace& w) {
    const std::size_t n = h.extent(0);
    sync_inner();
    const auto [dgy, dgx] = combine_rows_backward(s, dout, w);
    grow(w.dup, "moe.dup", s.goffsets[local_], up_cols());
    grow(w.dact, "moe.dact", s.goffsets[local_], cfg_.expert_width());
    for (std::size_t l = 0; l < local_; ++l) {
      const auto g = group(s, l);
      typename Expert::Workspace ew;
      ew.dup = rows_of(w.dup, g);
      ew.dact = rows_of(w.dact, g);
      experts_[l].backward(rows_of(s.gx, g), expert_saved(s, g), rows_of(dgy, g), rows_of(dgx, g), ew);
    }
    publish_input_gradients(s, dgx);
    dispatch_rows_backward(s, w, dh);
    for (std::size_t i = 0; i < shared_.size(); ++i) {
      shared_[i].backward(h, s.shared[i], dout, w.dtmp, w.shared);
      ops::add(dh, dh, w.dtmp);
    }
    router_logits_backward(s, n, w);
    router_.backward(h, w.du, dh, true);
  }

  /// Runs the four exchanges of the pass in `s` again -- dispatch of h,
  /// combine into out, the output gradient dout's dispatch and the input
  /// gradient's combine into dh -- with the routing and the expert-side rows
  /// that pass left and no expert in between, as forward and backward run
  /// them (gathers, counts, permutations and gate sums included). For
  /// benchmarks that time the exchange alone (bench_moe); collective over
  /// the EP ranks. h, out, dout, dh: [tokens, D]. The expert-side gradients
  /// it leaves are not those of any pass.
  template <class HV, class OV>
  void replay_exchange(const HV& h, Saved& s, const OV& out, const HV& dout, const OV& dh, Workspace& w) {
    dispatch_rows(h, s);
    publish_outputs(s);
    combine_rows(s, out);
    const auto dg = combine_rows_backward(s, dout, w);
    publish_input_gradients(s, dg.second);
    dispatch_rows_backward(s, w, dh);
  }

  /// Whether the expert-side rows are 2-byte activations: under a mixed
  /// weft::Precision (T float, BF16 or FP16 products) the experts' inputs,
  /// outputs, output gradients and input gradients are rounded to the
  /// product type, on every run (expert-parallel or not, so that every mesh
  /// computes the same values), and the expert-parallel exchange carries
  /// them in 2 bytes (docs/moe.md, "Mixed precision").
  bool narrow_rows() const { return std::is_same_v<T, float> && ctx_->products != ProductPrecision::f32; }
  /// Bytes of one element of an exchanged row: 2 under a mixed Precision, sizeof(T) otherwise.
  std::size_t row_bytes() const { return narrow_rows() ? 2 : sizeof(T); }

  /// Internal. After the experts' forward: under a mixed Precision their
  /// outputs s.gy (grouped rows) are rounded to the 2-byte type -- in place
  /// without expert parallelism, into this rank's window matrix on the
  /// node-shared path; the all_to_allv path rounds them as it sends them.
  void publish_outputs(Saved& s) {
    if (!narrow_rows()) return;
    const std::size_t R = s.goffsets[local_];
    if (!ctx_->ep.active()) return round_rows(s.gy, R);
    if (!node_exchange()) return;
    if constexpr (host_space)
      with_row_type([&]<class W>(std::type_identity<W>) {
        weft::convert(window_rows<W>(s, 1, R), rows_of(s.gy, {0, R}));
        exec().fence();
      });
  }
  /// Internal. After the experts' backward: under a mixed Precision their
  /// input gradients dgx are rounded as publish_outputs rounds the outputs.
  void publish_input_gradients(const Saved& s, const Mat& dgx) {
    if (!narrow_rows()) return;
    const std::size_t R = s.goffsets[local_];
    if (!ctx_->ep.active()) return round_rows(dgx, R);
    if (!node_exchange()) return;
    if constexpr (host_space)
      with_row_type([&]<class W>(std::type_identity<W>) {
        weft::convert(window_rows<W>(s, 3, R), rows_of(dgx, {0, R}));
        exec().fence();
      });
  }

  /// Internal (public because nvcc refuses device lambdas in private
  /// members), the four phases of the exchange that forward, backward and
  /// replay_exchange run. Forward, dispatch: the kept slots' rows of h to their experts' grouped
  /// rows s.gx (this rank's experts' inputs, grouped by local expert, source
  /// EP rank inner, token order within).
  template <class HV>
  void dispatch_rows(const HV& h, Saved& s) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_dispatch");
    const std::size_t rows = s.offsets[cfg_.experts], D = cfg_.d_model;
    if (ctx_->ep.active() && node_exchange()) {
      if constexpr (host_space) dispatch_node(h, s);
      return;
    }
    auto xin = s.xin;
    auto row_token = s.row_token;
    Kokkos::parallel_for(
        "weft::moe_gather", Kokkos::RangePolicy<exec>(0, rows), KOKKOS_LAMBDA(std::size_t r) {
          const std::size_t t = std::size_t(row_token(r));
          for (std::size_t j = 0; j < D; ++j) xin(r, j) = h(t, j);
        });
    if (ctx_->ep.active()) {
      dispatch(s);
    } else {
      s.gx = s.xin;
      s.gy = s.eout;
      s.goffsets = s.offsets;
    }
  }

  /// Internal. Forward, combine: out(t) = sum over t's kept slots of gate x expert output.
  template <class OV>
  void combine_rows(Saved& s, const OV& out) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_combine");
    const std::size_t n = out.extent(0), K = cfg_.top_k, D = cfg_.d_model;
    if (ctx_->ep.active() && node_exchange()) {
      if constexpr (host_space) {
        const auto t0 = std::chrono::steady_clock::now();
        s.window->sync("the barrier before the MoE combine");
        with_row_type([&]<class W>(std::type_identity<W>) {
          detail::moe_pull_sum<T, W>(out, s.slot_row, s.row_gate, true, *s.window, 1, s.row_peer.data(), s.row_dest.data(),
                                     n, K);
        });
        count_node_exchange(s, t0);
      }
      return;
    }
    if (ctx_->ep.active()) {
      // Outputs back to the slots' ranks, in the order they were sent.
      permute_rows(s.gy, s.perm, s.xrecv, s.goffsets[local_], false);
      exchange(s.xrecv, s.recv_rows, s.eout, s.send_rows);
    }
    auto eout = s.eout;
    auto slot_row = s.slot_row;
    auto row_gate = s.row_gate;
    Kokkos::parallel_for(
        "weft::moe_combine", Kokkos::RangePolicy<exec>(0, n), KOKKOS_LAMBDA(std::size_t t) {
          for (std::size_t j = 0; j < D; ++j) out(t, j) = T(0);
          for (std::size_t q = 0; q < K; ++q) {  // in choice order: the same sum on every run
            const int r = slot_row(t * K + q);
            if (r < 0) continue;
            const T g = row_gate(r);
            for (std::size_t j = 0; j < D; ++j) out(t, j) += g * eout(r, j);
          }
        });
  }

  /// Internal. Backward of the combine: the gates' gradients (w.dgate) and the experts'
  /// output gradients, grouped as s.gx; returns (output gradients, where the
  /// input gradients go), both [R, D] in the experts' grouped order.
  template <class DOV>
  std::pair<Mat, Mat> combine_rows_backward(const Saved& s, const DOV& dout, Workspace& w) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_combine");
    const std::size_t n = dout.extent(0), K = cfg_.top_k, D = cfg_.d_model;
    const std::size_t rows = s.offsets[cfg_.experts], grows = s.goffsets[local_];
    if (ctx_->ep.active() && node_exchange()) {
      if constexpr (host_space) {
        const auto t0 = std::chrono::steady_clock::now();
        auto& win = *s.window;
        Kokkos::deep_copy(w.dgate, T(0));  // dropped slots
        with_row_type([&]<class W>(std::type_identity<W>) {
          detail::moe_push_rows<T, W>(dout, s.row_token, s.row_gate, true, win, 2, s.row_peer.data(), s.row_dest.data(),
                                      rows, &w.dgate, s.row_slot.data());
        });
        win.sync("the barrier after sending the MoE output gradients");
        count_node_exchange(s, t0);
        const std::size_t me = ctx_->ep.ep_rank();
        if (!narrow_rows()) return {Mat(win.template mat<T>(me, 2), grows, D), Mat(win.template mat<T>(me, 3), grows, D)};
        // 2-byte window: the output gradients widened into float rows the
        // experts read; their input gradients go to w.dgx, then to the
        // window (publish_input_gradients).
        grow(w.dgx, "moe.dgx", grows, D);
        grow(w.dgy, "moe.dgy", grows, D);
        with_row_type([&]<class W>(std::type_identity<W>) {
          weft::convert(rows_of(w.dgy, {0, grows}),
                        window_rows<W>(s, 2, grows));
        });
        return {w.dgy, w.dgx};
      }
    }
    auto dslot = w.dslot;
    auto dgate = w.dgate;
    auto eout = s.eout;
    auto row_token = s.row_token;
    auto row_gate = s.row_gate;
    auto slot_row = s.slot_row;
    Kokkos::parallel_for(
        "weft::moe_combine_backward", Kokkos::RangePolicy<exec>(0, rows), KOKKOS_LAMBDA(std::size_t r) {
          const std::size_t t = std::size_t(row_token(r));
          const T g = row_gate(r);
          for (std::size_t j = 0; j < D; ++j) dslot(r, j) = g * dout(t, j);
        });
    Kokkos::parallel_for(
        "weft::moe_gate_backward", Kokkos::RangePolicy<exec>(0, n * K), KOKKOS_LAMBDA(std::size_t q) {
          const int r = slot_row(q);
          T acc = 0;
          if (r >= 0) {
            const std::size_t t = q / K;
            acc = ops::detail::lane_sum<T>(D, [=](std::size_t j) { return dout(t, j) * eout(r, j); });
          }
          dgate(q) = acc;
        });
    if (!ctx_->ep.active()) {
      round_rows(w.dslot, rows);  // a mixed Precision's 2-byte output gradients, as the exchange would carry them
      return {w.dslot, w.dxin};
    }
    grow(w.drecv, "moe.drecv", grows, D);
    grow(w.dgx, "moe.dgx", grows, D);
    grow(w.dgy, "moe.dgy", grows, D);
    exchange(w.dslot, s.send_rows, w.drecv, s.recv_rows);
    permute_rows(w.drecv, s.perm, w.dgy, grows, true);
    return {w.dgy, w.dgx};
  }

  /// Internal. Backward of the dispatch: dh(t) = sum over t's kept slots of the input
  /// gradient of its expert row (overwritten).
  template <class DHV>
  void dispatch_rows_backward(const Saved& s, Workspace& w, const DHV& dh) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_dispatch");
    const std::size_t n = dh.extent(0), K = cfg_.top_k, D = cfg_.d_model, grows = s.goffsets[local_];
    if (ctx_->ep.active() && node_exchange()) {
      if constexpr (host_space) {
        const auto t0 = std::chrono::steady_clock::now();
        s.window->sync("the barrier before gathering the MoE input gradients");
        with_row_type([&]<class W>(std::type_identity<W>) {
          detail::moe_pull_sum<T, W>(dh, s.slot_row, s.row_gate, false, *s.window, 3, s.row_peer.data(), s.row_dest.data(),
                                     n, K);
        });
        count_node_exchange(s, t0);
      }
      return;
    }
    if (ctx_->ep.active()) {
      permute_rows(w.dgx, s.perm, w.drecv, grows, false);
      exchange(w.drecv, s.recv_rows, w.dxin, s.send_rows);
    }
    auto dxin = w.dxin;
    auto slot_row = s.slot_row;
    Kokkos::parallel_for(
        "weft::moe_scatter", Kokkos::RangePolicy<exec>(0, n), KOKKOS_LAMBDA(std::size_t t) {
          for (std::size_t j = 0; j < D; ++j) dh(t, j) = T(0);
          for (std::size_t q = 0; q < K; ++q) {
            const int r = slot_row(t * K + q);
            if (r < 0) continue;
            for (std::size_t j = 0; j < D; ++j) dh(t, j) += dxin(r, j);
          }
        });
  }

  /// Whether this layer's expert-parallel exchange takes the node-shared
  /// path (every EP rank on one node, host memory; see docs/moe.md) rather
  /// than all_to_allv. Collective over the EP ranks the first time.
  bool node_exchange() {
    if (exchange_path_ < 0) {
      exchange_path_ = 0;
      if constexpr (host_space) {
        if (ctx_->ep.active() && detail::moe_node_exchange_allowed() && weft::detail::comm_within_node(*ctx_->ep.ep))
          exchange_path_ = 1;
      }
    }
    return exchange_path_ == 1;
  }

  /// The weight of the auxiliary losses' gradients in backward: the model
  /// sets it to grad_scale x tokens, so that the losses enter the gradient
  /// of the microbatch as its mean token loss does (1 by default).
  void set_loss_weight(double w) { loss_weight_ = w; }
  /// See set_loss_weight.
  double loss_weight() const { return loss_weight_; }
  /// Whether forward passes count in the statistics and the bias-update
  /// counts (off while a block recomputes its forward for backward).
  void set_recording(bool on) { recording_ = on; }

  /// Moves the selection bias from the slots counted since the last update:
  /// b_e += gamma * sign(mean_e' c_e' - c_e), so overloaded experts are
  /// chosen less and idle ones more, without a loss term. Call it after the
  /// optimizer step. Does nothing when gamma is 0 or nothing was counted.
  /// The counts are those of the whole microbatches (summed over the data
  /// group, the same on every rank of it), so every rank computes the same
  /// step and writes it where it keeps the bias: its value when whole
  /// (replicated, ZeRO<1>, ZeRO<2>) and, under FullyShard, the part of it in
  /// this rank's shard (Parameter::stored_pieces; none on most ranks).
  void update_bias(double gamma) {
    const double total = std::accumulate(step_counts_.begin(), step_counts_.end(), 0.0);
    if (gamma != 0 && total > 0) {
      const bool whole = bias_.value.extent(0) == cfg_.experts;
      WEFT_REQUIRE(whole || bias_.stored_in_pieces(), ConfigError, "nn::MoE '", bias_.name(),
                   "': the selection bias is neither held whole on this rank nor stored in pieces a data-parallel "
                   "strategy declared (Parameter::set_stored_pieces), so the aux-loss-free update cannot reach it");
      const double mean = total / double(step_counts_.size());
      std::vector<T> step(step_counts_.size());
      for (std::size_t e = 0; e < step_counts_.size(); ++e) {
        const double d = mean - step_counts_[e];
        step[e] = T(gamma * double((d > 0) - (d < 0)));
      }
      auto add = [&](const Kokkos::View<T*, Space>& v, std::size_t offset) {
        auto hv = Kokkos::create_mirror_view(v);
        Kokkos::deep_copy(hv, v);
        for (std::size_t i = 0; i < hv.extent(0); ++i) hv(i) += step[offset + i];
        Kokkos::deep_copy(v, hv);
      };
      if (whole) add(bias_.value, 0);
      // FullyShard: a gathered value is a copy of the shard; the shard is what lasts.
      for (const auto& piece : bias_.stored_pieces()) add(piece.values, piece.offset);
    }
    std::fill(step_counts_.begin(), step_counts_.end(), 0.0);
  }

  /// The route-quality sums of the last recorded forward pass (2N values
  /// appended to `out`): for each expert e the summed token_loss[t] over
  /// this rank's tokens t with a kept slot on e, then for each e the number
  /// of those slots. token_loss holds the loss of each of the pass's n
  /// tokens, in the order the layer received them. Sum them over the
  /// ExpertSplit's data ranks, then give them to record_route_losses.
  void route_loss_sums(const double* token_loss, std::size_t n, std::vector<double>& out) const {
    const std::size_t N = cfg_.experts, K = cfg_.top_k, at = out.size();
    WEFT_REQUIRE(route_expert_.size() == n * K, ShapeError, "nn::MoE::route_loss_sums: ", n,
                 " token losses, but the last recorded pass routed ", route_expert_.size() / K, " tokens");
    out.resize(at + 2 * N, 0.0);
    for (std::size_t q = 0; q < n * K; ++q)
      if (const int e = route_expert_[q]; e >= 0) {
        out[at + std::size_t(e)] += token_loss[q / K];
        out[at + N + std::size_t(e)] += 1;
      }
  }
  /// Adds 2N route-quality sums (route_loss_sums, summed over the data
  /// ranks) to the statistics, when recording.
  void record_route_losses(const double* sums) {
    if (!recording_) return;
    const std::size_t N = cfg_.experts;
    stats_.route_loss_sum.resize(N, 0.0);
    stats_.route_loss_slots.resize(N, 0.0);
    for (std::size_t e = 0; e < N; ++e) {
      stats_.route_loss_sum[e] += sums[e];
      stats_.route_loss_slots[e] += sums[N + e];
    }
  }

  /// The load-balancing loss of the last forward pass (with its coefficient).
  double last_aux_loss() const { return last_aux_; }
  /// The router z-loss of the last forward pass (with its coefficient).
  double last_z_loss() const { return last_z_; }

  /// Statistics since the last reset_statistics().
  const MoEStats& statistics() const { return stats_; }
  /// Clears the statistics.
  void reset_statistics() {
    stats_ = MoEStats{};
    stats_.selected.assign(cfg_.experts, 0.0);
    stats_.layers = 1;
  }

  /// The selection bias (value [1, N]; its gradient stays zero).
  Parameter<T, Space>& expert_bias() { return bias_; }
  /// The router's linear gate.
  Linear<T, Space>& router() { return router_; }
  /// Expert e (a global index; under expert parallelism it must be one of this rank's).
  Expert& expert(std::size_t e) {
    WEFT_REQUIRE(e >= first_ && e < first_ + local_, ConfigError, "nn::MoE::expert(", e, "): this rank holds experts ",
                 first_, "..", first_ + local_ - 1, " of ", cfg_.experts);
    return experts_[e - first_];
  }
  /// Number of routed experts (of the whole layer).
  std::size_t experts() const { return cfg_.experts; }
  /// Number of routed experts this rank holds (N / ep).
  std::size_t local_experts() const { return local_; }
  /// Global index of this rank's first expert.
  std::size_t first_expert() const { return first_; }

  /// Appends pointers to this layer's parameters: router, selection bias,
  /// experts in order, shared experts.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    router_.collect(out);
    out.push_back(&bias_);
    for (auto& e : experts_) e.collect(out);
    for (auto& e : shared_) e.collect(out);
  }

 private:
  using exec = typename Kokkos::View<T*, Space>::execution_space;
  static constexpr bool host_space =
      Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Kokkos::View<T*, Space>::memory_space>::accessible;

  static ContextPtr checked(ContextPtr ctx, const std::string& name, const GPTConfig& c) {
    WEFT_REQUIRE(c.experts > 0 && c.top_k >= 1 && c.top_k <= c.experts, ConfigError, "nn::MoE '", name, "': ",
                 c.experts, " experts and top-k ", c.top_k, "; expected experts >= 1 and 1 <= top-k <= experts");
    // Context and sequence parallelism: each CP rank (and each TP rank under
    // SequenceParallel) routes its own share of the tokens, so those ranks
    // are data ranks of the routing split.
    const std::size_t shards = ctx->cp.size() * (ctx->tp.sp() ? ctx->tp.size() : 1);
    WEFT_REQUIRE(shards == 1 || (ctx->ep.data && ctx->ep.token_shards == shards && ctx->ep.data_size() % shards == 0),
                 ConfigError, "nn::MoE '", name, "': under context parallelism (cp ", ctx->cp.size(),
                 ") or SequenceParallel (tp ", ctx->tp.size(), ", sequence parallel ", ctx->tp.sp() ? "on" : "off",
                 ") each of ", shards, " ranks routes its own share of every sequence, so the routing split must count "
                 "them among the data ranks (its token_shards is ", ctx->ep.token_shards,
                 "); build it with weft::nn::expert_split_of<Strategy>(mesh, cfg)");
    const std::size_t ep = ctx->ep.ep_size();
    WEFT_REQUIRE(c.experts % ep == 0, ConfigError, "nn::MoE '", name, "': ", c.experts,
                 " routed experts do not divide by ep ", ep, " (each EP rank holds N / ep whole experts); ep sizes that work: ",
                 weft::detail::divisors_text(c.experts));
    WEFT_REQUIRE(!ctx->ep.active() || (ctx->ep.data && ctx->ep.data_size() % ep == 0), ConfigError, "nn::MoE '", name,
                 "': expert parallelism needs the group of ranks that share the microbatch (DP x EP), a multiple of ep ",
                 ep, " ranks");
    return ctx;
  }

  static auto rows_of(const Mat& m, std::pair<std::size_t, std::size_t> g) {
    return Mat(Kokkos::subview(m, g, Kokkos::ALL));
  }
  static std::pair<std::size_t, std::size_t> group(const Saved& s, std::size_t l) {
    return {s.goffsets[l], s.goffsets[l + 1]};
  }
  // The experts' layers see the model's profiler, deferred-work queue and,
  // under a mixed Precision, its product staging (one scratch per model,
  // which the model's memory ledger counts).
  void sync_inner() {
    inner_->profiler = ctx_->profiler;
    inner_->deferred_weight_grads = ctx_->deferred_weight_grads;
    if (ctx_->products != ProductPrecision::f32) {
      product_staging<Space>(*ctx_);
      inner_->staging = ctx_->staging;
    }
  }
  // m gets at least `rows` rows (grow only; contents not kept).
  static void grow(Mat& m, const char* label, std::size_t rows, std::size_t cols) {
    if (m.extent(0) >= rows && m.extent(1) == cols) return;
    m = Mat(std::string(label), std::max<std::size_t>(rows, 1), cols);
  }
  std::size_t up_cols() const { return cfg_.expert_width() * (cfg_.mlp == MlpKind::swiglu ? 2 : 1); }
  static void permute_rows(const Mat& src, const Kokkos::View<int*, Space>& perm, const Mat& dst, std::size_t rows,
                           bool gather) {
    detail::moe_permute_rows(src, perm, dst, rows, gather);
  }
  // One node-shared exchange's time and the bytes it moved to or from other
  // EP ranks (as exchange() counts an all_to_allv's).
  void count_node_exchange(const Saved& s, std::chrono::steady_clock::time_point t0) {
    stats_.a2a_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double rows = 0;
    for (std::size_t d = 0; d < s.send_rows.size(); ++d)
      if (d != ctx_->ep.ep_rank()) rows += double(s.send_rows[d]);
    stats_.a2a_bytes += rows * double(cfg_.d_model) * double(row_bytes());
  }
  // f(std::type_identity<W>{}) with W the type of the expert-side rows on
  // the wire and in the node-shared window: T, or under a mixed Precision
  // (T float) the 2-byte product type.
  template <class F>
  void with_row_type(F&& f) const {
    if constexpr (std::is_same_v<T, float>) {
      if (ctx_->products == ProductPrecision::bf16) return f(std::type_identity<bf16>{});
      if (ctx_->products == ProductPrecision::fp16) return f(std::type_identity<fp16>{});
    }
    f(std::type_identity<T>{});
  }
  // The first `rows` rows of m rounded to the 2-byte type in place (a mixed Precision only).
  void round_rows(const Mat& m, std::size_t rows) const {
    if (!narrow_rows() || rows == 0) return;
    with_row_type([&]<class W>(std::type_identity<W>) {
      if constexpr (!std::is_same_v<W, T>)
        weft::round_through<W>(rows_of(m, {0, rows}));
    });
  }
  // The first `rows` rows of matrix m of this rank's node-shared window, as W.
  template <class W>
  MatrixRef<W, Space> window_rows(const Saved& s, int m, std::size_t rows) const {
    return MatrixRef<W, Space>(s.window->template mat<W>(ctx_->ep.ep_rank(), m), rows, cfg_.d_model);
  }

  // Expert parallelism on the node-shared path, forward: every EP rank's
  // kept-slot counts per expert go to every EP rank (one all_gather), from
  // which each rank knows where its rows go in its peers' grouped buffers;
  // it writes them there straight from h, and a barrier makes them visible.
  // The window (allocated at the first pass, collectively) has room for the
  // most rows an EP rank can receive: min(cap, tokens x ep) per local expert
  // and tokens x ep x k in all, with cap the capacity of the microbatch.
  template <class HV>
  void dispatch_node(const HV& h, Saved& s) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t N = cfg_.experts, E = ctx_->ep.ep_size(), L = local_, D = cfg_.d_model, K = cfg_.top_k;
    const std::size_t me = ctx_->ep.ep_rank(), n = h.extent(0), rows = s.offsets[N];
    std::vector<int> mine(N), all(E * N);
    for (std::size_t e = 0; e < N; ++e) mine[e] = int(s.offsets[e + 1] - s.offsets[e]);
    using HostInts = Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    // Also the point after which every peer is done with this pass's previous
    // buffers (they entered this dispatch), so its rows may be overwritten.
    ctx_->ep.ep->all_gather(HostInts(mine.data(), N), HostInts(all.data(), E * N));
    const auto count = [&](std::size_t src, std::size_t e) { return std::size_t(all[src * N + e]); };
    s.send_rows.assign(E, 0);
    s.recv_rows.assign(E, 0);
    s.goffsets.assign(L + 1, 0);
    for (std::size_t l = 0; l < L; ++l) {
      std::size_t g = 0;
      for (std::size_t d = 0; d < E; ++d) {
        g += count(d, me * L + l);
        s.recv_rows[d] += int(count(d, me * L + l));
      }
      s.goffsets[l + 1] = s.goffsets[l] + g;
    }
    s.row_peer.resize(rows);
    s.row_dest.resize(rows);
    s.row_slot.resize(rows);
    for (std::size_t q = 0; q < n * K; ++q)
      if (s.slot_row(q) >= 0) s.row_slot[std::size_t(s.slot_row(q))] = int(q);
    for (std::size_t r = 0; r < E; ++r) {
      std::size_t start = 0;  // first row of expert r L + l in rank r's buffers
      for (std::size_t l = 0; l < L; ++l) {
        const std::size_t e = r * L + l;
        std::size_t at = start;
        for (std::size_t d = 0; d < me; ++d) at += count(d, e);
        for (std::size_t i = 0; i < count(me, e); ++i) {
          s.row_peer[s.offsets[e] + i] = int(r);
          s.row_dest[s.offsets[e] + i] = int(at + i);
        }
        s.send_rows[r] += int(count(me, e));
        for (std::size_t d = 0; d < E; ++d) start += count(d, e);
      }
    }
    const std::size_t R = s.goffsets[L];
    if (!s.window) {
      const std::size_t per_expert = std::min(capacity(n * ctx_->ep.data_size()), n * E);
      const std::size_t most = std::max<std::size_t>(1, std::min(L * per_expert, n * E * K));
      s.window = std::make_shared<detail::MoEWindow>(*ctx_->ep.ep, most, D, row_bytes());
    }
    WEFT_REQUIRE(R <= s.window->rows, ShapeError, "nn::MoE: EP rank ", me, " receives ", R,
                 " rows but its exchange window holds ", s.window->rows, " (internal error)");
    WEFT_REQUIRE(s.window->elem == row_bytes(), ConfigError, "nn::MoE: the saved activations' exchange window holds ",
                 s.window->elem, "-byte rows but this layer exchanges ", row_bytes(),
                 "-byte ones: a MoE::Saved serves layers of one precision");
    // Under a mixed Precision the window holds 2-byte rows and the experts
    // compute on float copies of their own (s.owned_rows).
    s.owned_rows = narrow_rows();
    if (s.owned_rows) {
      grow(s.gx, "moe.gx", R, D);
      grow(s.gy, "moe.gy", R, D);
    } else {
      s.gx = Mat(s.window->template mat<T>(me, 0), R, D);
      s.gy = Mat(s.window->template mat<T>(me, 1), R, D);
    }
    grow(s.up, "moe.up", R, up_cols());
    grow(s.act, "moe.act", R, cfg_.expert_width());
    with_row_type([&]<class W>(std::type_identity<W>) {
      detail::moe_push_rows<T, W>(h, s.row_token, s.row_gate, false, *s.window, 0, s.row_peer.data(), s.row_dest.data(),
                                  rows, static_cast<const Kokkos::View<T*, Space>*>(nullptr), nullptr);
    });
    s.window->sync("the barrier after dispatching the MoE rows");
    if (s.owned_rows)
      with_row_type([&]<class W>(std::type_identity<W>) {
        weft::convert(rows_of(s.gx, {0, R}), window_rows<W>(s, 0, R));
        exec().fence();
      });
    count_node_exchange(s, t0);
  }

  // all_to_allv over EP of whole rows (send_rows[d] rows to rank d), timed.
  // Under a mixed Precision the rows travel in the 2-byte type: `send`'s
  // rows rounded into product staging slot 6, exchanged into slot 7, widened
  // (exactly) into `recv`.
  void exchange(const Mat& send, const std::vector<int>& send_rows, const Mat& recv, const std::vector<int>& recv_rows) {
    const std::size_t D = cfg_.d_model, E = ctx_->ep.ep_size();
    std::vector<int> sc(E), rc(E);
    double bytes = 0;
    std::size_t S = 0, R = 0;
    for (std::size_t d = 0; d < E; ++d) {
      sc[d] = int(std::size_t(send_rows[d]) * D);
      rc[d] = int(std::size_t(recv_rows[d]) * D);
      S += std::size_t(send_rows[d]);
      R += std::size_t(recv_rows[d]);
      if (d != ctx_->ep.ep_rank()) bytes += double(sc[d]) * double(row_bytes());
    }
    const auto timed = [&](const auto& snd, const auto& rcv) {
      // Comm fences the view's space itself; fencing first keeps the kernels
      // that filled `send` out of the exchange's measured time.
      Kokkos::fence();
      const auto t0 = std::chrono::steady_clock::now();
      ctx_->ep.ep->all_to_allv(snd, std::span<const int>(sc), rcv, std::span<const int>(rc));
      stats_.a2a_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats_.a2a_bytes += bytes;
    };
    with_row_type([&]<class W>(std::type_identity<W>) {
      if constexpr (std::is_same_v<W, T>) {
        timed(send, recv);
      } else {
        using Rows = std::pair<std::size_t, std::size_t>;
        auto& st = product_staging<Space>(*ctx_);
        const auto ws = st.template matrix<W>(6, std::max<std::size_t>(S, 1), D);
        const auto wr = st.template matrix<W>(7, std::max<std::size_t>(R, 1), D);
        weft::convert(Kokkos::subview(ws, Rows(0, S), Kokkos::ALL), Kokkos::subview(send, Rows(0, S), Kokkos::ALL));
        timed(ws, wr);
        weft::convert(Kokkos::subview(recv, Rows(0, R), Kokkos::ALL), Kokkos::subview(wr, Rows(0, R), Kokkos::ALL));
      }
    });
  }
  // Expert parallelism, forward: the counts of kept slots per expert go to
  // the experts' ranks, the gathered rows (s.xin, grouped by expert, i.e. by
  // destination rank) follow with all_to_allv, and the rows that arrive are
  // regrouped by local expert (source rank inner) into s.gx.
  void dispatch(Saved& s) {
    const std::size_t N = cfg_.experts, E = ctx_->ep.ep_size(), L = local_;
    std::vector<int> mine(N), theirs(E * L);
    for (std::size_t e = 0; e < N; ++e) mine[e] = int(s.offsets[e + 1] - s.offsets[e]);
    using HostInts = Kokkos::View<int*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    ctx_->ep.ep->all_to_all(HostInts(mine.data(), N), HostInts(theirs.data(), E * L));
    s.send_rows.assign(E, 0);
    s.recv_rows.assign(E, 0);
    for (std::size_t d = 0; d < E; ++d)
      for (std::size_t l = 0; l < L; ++l) {
        s.send_rows[d] += mine[d * L + l];
        s.recv_rows[d] += theirs[d * L + l];
      }
    std::vector<std::size_t> base(E + 1, 0);
    for (std::size_t d = 0; d < E; ++d) base[d + 1] = base[d] + std::size_t(s.recv_rows[d]);
    const std::size_t R = base[E];
    const std::size_t D = cfg_.d_model;
    grow(s.gx, "moe.gx", R, D);
    grow(s.gy, "moe.gy", R, D);
    grow(s.xrecv, "moe.xrecv", R, D);
    grow(s.up, "moe.up", R, up_cols());
    grow(s.act, "moe.act", R, cfg_.expert_width());
    if (s.perm.extent(0) < R) s.perm = Kokkos::View<int*, Space>("moe.perm", R);
    auto perm = Kokkos::create_mirror_view(s.perm);
    s.goffsets.assign(L + 1, 0);
    std::vector<std::size_t> run(E);  // next row of each source's block
    for (std::size_t d = 0; d < E; ++d) run[d] = base[d];
    std::size_t g = 0;
    for (std::size_t l = 0; l < L; ++l) {
      s.goffsets[l] = g;
      for (std::size_t d = 0; d < E; ++d)
        for (int i = 0; i < theirs[d * L + l]; ++i) perm(g++) = int(run[d]++);
    }
    s.goffsets[L] = g;
    Kokkos::deep_copy(s.perm, perm);
    exchange(s.xin, s.send_rows, s.xrecv, s.recv_rows);
    permute_rows(s.xrecv, s.perm, s.gx, R, true);
  }
  static typename Expert::Saved expert_saved(const Saved& s, std::pair<std::size_t, std::size_t> g) {
    typename Expert::Saved es;
    es.up = rows_of(s.up, g);
    es.act = rows_of(s.act, g);
    return es;
  }

  // Scores, top-k, gates, capacity and drops, the losses and the statistics;
  // the grouped-row maps go to the device. Over the data ranks of an
  // ExpertSplit, the counts, score sums and losses are summed over them and
  // an expert over capacity ranks the candidates of every rank, so that the
  // decisions are those of one process holding the whole microbatch.
  void route(Saved& s, std::size_t n) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_route");
    const std::size_t N = cfg_.experts, K = cfg_.top_k;
    const ExpertSplit& x = ctx_->ep;
    const std::size_t G = x.data_size();
    auto lh = Kokkos::create_mirror_view(s.logits);
    Kokkos::deep_copy(lh, s.logits);
    auto bh = Kokkos::create_mirror_view(bias_.value);
    Kokkos::deep_copy(bh, bias_.value);
    const bool softmax = cfg_.router == RouterKind::softmax;
    s.scores.assign(n * N, 0.0);
    s.u.assign(n * N, 0.0);
    s.lse.assign(n, 0.0);
    s.slot_expert.assign(n * K, 0);
    s.slot_gate.assign(n * K, 0.0);
    // sums[0..N): local slots per expert; [N..2N): sum of scores; 2N: sum lse^2; 2N+1: entropy.
    std::vector<double> sums(2 * N + 2, 0.0);
    std::vector<int> order(N);
    std::vector<double> key(N);
    for (std::size_t t = 0; t < n; ++t) {
      double mx = -std::numeric_limits<double>::infinity();
      for (std::size_t e = 0; e < N; ++e) mx = std::max(mx, double(lh(t, e)));
      double se = 0;
      for (std::size_t e = 0; e < N; ++e) se += std::exp(double(lh(t, e)) - mx);
      s.lse[t] = mx + std::log(se);
      double* p = &s.scores[t * N];
      double psum = 0;
      for (std::size_t e = 0; e < N; ++e) {
        const double u = double(lh(t, e));
        s.u[t * N + e] = u;
        p[e] = softmax ? std::exp(u - s.lse[t]) : 1.0 / (1.0 + std::exp(-u));
        psum += p[e];
        sums[N + e] += p[e];
      }
      for (std::size_t e = 0; e < N; ++e) {
        const double q = p[e] / psum;
        if (q > 0) sums[2 * N + 1] -= q * std::log(q);
      }
      sums[2 * N] += s.lse[t] * s.lse[t];
      // Top k by score + selection bias; ties go to the lower expert index.
      for (std::size_t e = 0; e < N; ++e) key[e] = p[e] + double(bh(e));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + long(K), order.end(), [&](int a, int b) {
        return key[a] > key[b] || (key[a] == key[b] && a < b);
      });
      double gsum = 0;
      for (std::size_t q = 0; q < K; ++q) gsum += p[order[q]];
      for (std::size_t q = 0; q < K; ++q) {
        const int e = order[q];
        s.slot_expert[t * K + q] = e;
        s.slot_gate[t * K + q] = cfg_.normalize_gates ? p[e] / gsum : p[e];
        sums[std::size_t(e)] += 1;
      }
    }
    // Per-rank counts (for ranking candidates) and the sums over the data ranks.
    std::vector<double> counts(sums.begin(), sums.begin() + long(N));  // [G][N] once gathered
    using HostD = Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    if (x.global()) {
      std::vector<double> all(G * N);
      x.data->all_gather(HostD(counts.data(), N), HostD(all.data(), G * N));
      counts.swap(all);
      x.data->all_reduce(HostD(sums.data(), sums.size()));
    }
    const double ng = double(n * G);
    s.tokens_global = ng;
    s.contiguous = ctx_->cp.size() == 1;
    s.first_token = global_token(0, n);
    s.token_index.resize(s.contiguous ? 0 : n);
    for (std::size_t t = 0; t < s.token_index.size(); ++t) s.token_index[t] = global_token(t, n);
    s.selected.assign(sums.begin(), sums.begin() + long(N));
    // Capacity: an expert keeps its C slots of highest score, ties by global
    // slot index (token index) -- a rule on global indices and scores alone,
    // so the same slots are dropped whatever the layout.
    const std::size_t cap = capacity(n * G);
    std::vector<std::vector<std::size_t>> cand(N);
    for (std::size_t q = 0; q < n * K; ++q) cand[std::size_t(s.slot_expert[q])].push_back(q);
    std::vector<std::size_t> over;
    double dropped_total = 0;
    for (std::size_t e = 0; e < N; ++e)
      if (s.selected[e] > double(cap)) {
        over.push_back(e);
        dropped_total += s.selected[e] - double(cap);
      }
    // For each expert over capacity, the threshold (score, global slot) of its
    // cap-th kept slot: a slot is kept when it ranks at or before it.
    std::vector<std::pair<double, double>> last_kept(N, {0.0, -1.0});
    if (!over.empty()) {
      std::size_t M = 0;  // the most candidates any rank holds for those experts
      for (std::size_t r = 0; r < (x.global() ? G : 1); ++r) {
        std::size_t m = 0;
        for (std::size_t e : over) m += std::size_t(counts[r * N + e]);
        M = std::max(M, m);
      }
      std::vector<double> mine(2 * M, 0.0), all;
      std::size_t i = 0;
      for (std::size_t e : over)
        for (std::size_t q : cand[e]) {
          mine[i++] = s.scores[(q / K) * N + e];
          mine[i++] = double(s.global_slot(q, K));
        }
      if (x.global()) {
        all.resize(2 * M * G);
        x.data->all_gather(HostD(mine.data(), mine.size()), HostD(all.data(), all.size()));
      } else {
        all = mine;
      }
      const std::size_t ranks = x.global() ? G : 1;
      std::vector<std::size_t> at(ranks, 0);  // read position in each rank's block
      std::vector<std::pair<double, double>> list;
      for (std::size_t e : over) {
        list.clear();
        for (std::size_t r = 0; r < ranks; ++r) {
          const std::size_t c = std::size_t(counts[r * N + e]);
          for (std::size_t j = 0; j < c; ++j, ++at[r])
            list.emplace_back(all[r * 2 * M + 2 * at[r]], all[r * 2 * M + 2 * at[r] + 1]);
        }
        std::nth_element(list.begin(), list.begin() + long(cap ? cap - 1 : 0), list.end(), ranks_before);
        last_kept[e] = cap ? list[cap - 1] : std::pair<double, double>{std::numeric_limits<double>::infinity(), -1.0};
      }
    }
    // The grouped-row maps are built in host mirrors of the device views.
    auto row_token = Kokkos::create_mirror_view(s.row_token);
    auto row_gate = Kokkos::create_mirror_view(s.row_gate);
    auto slot_row = Kokkos::create_mirror_view(s.slot_row);
    Kokkos::deep_copy(row_token, 0);
    Kokkos::deep_copy(row_gate, T(0));
    Kokkos::deep_copy(slot_row, -1);
    s.offsets.assign(N + 1, 0);
    s.dropped.clear();
    std::size_t r = 0;
    for (std::size_t e = 0; e < N; ++e) {
      s.offsets[e] = r;
      const bool capped = s.selected[e] > double(cap);
      for (std::size_t q : cand[e]) {  // ascending slot index = ascending token index
        if (capped && ranks_before(last_kept[e], {s.scores[(q / K) * N + e], double(s.global_slot(q, K))})) {
          s.dropped.push_back(s.global_slot(q, K));
          continue;
        }
        slot_row(q) = int(r);
        row_token(r) = int(q / K);
        row_gate(r) = T(s.slot_gate[q]);
        ++r;
      }
    }
    s.offsets[N] = r;
    std::sort(s.dropped.begin(), s.dropped.end());
    // The losses: alpha N sum_e f_e P_e and beta mean_t lse_t^2, over the microbatch.
    double aux = 0;
    for (std::size_t e = 0; e < N; ++e) aux += s.selected[e] / (ng * double(K)) * (sums[N + e] / ng);
    aux *= cfg_.aux_loss * double(N);
    const double z = cfg_.z_loss * sums[2 * N] / ng;
    s.aux = last_aux_ = aux;
    s.z = last_z_ = z;
    if (recording_) {
      for (std::size_t e = 0; e < N; ++e) {
        stats_.selected[e] += s.selected[e];
        step_counts_[e] += s.selected[e];
      }
      stats_.tokens += ng;
      stats_.slots += ng * double(K);
      stats_.dropped += dropped_total;
      stats_.entropy_sum += sums[2 * N + 1];
      stats_.aux_loss += aux;
      stats_.z_loss += z;
      stats_.passes += 1;
    }
    if (recording_) {  // each slot's expert, -1 when dropped (route_loss_sums)
      route_expert_.resize(n * K);
      for (std::size_t q = 0; q < n * K; ++q) route_expert_[q] = slot_row(q) >= 0 ? s.slot_expert[q] : -1;
    }
    Kokkos::deep_copy(s.row_token, row_token);
    Kokkos::deep_copy(s.row_gate, row_gate);
    Kokkos::deep_copy(s.slot_row, slot_row);
  }

  // The single-process index of local token t of this rank's n: the rank's
  // rows are its samples' (ExpertSplit::sample_index) share of every
  // sequence; under sequence parallelism TP rank r holds rows r n .. (r + 1)
  // n - 1 of that share, and under context parallelism a sequence's local
  // positions are the balanced layout's (context::global_index).
  std::size_t global_token(std::size_t t, std::size_t n) const {
    const std::size_t sp = ctx_->tp.sp() ? ctx_->tp.size() : 1, row = (ctx_->tp.sp() ? ctx_->tp.rank() : 0) * n + t;
    const std::size_t rows = n * sp, cp = ctx_->cp.size();
    if (cp == 1) return ctx_->ep.sample_index() * rows + row;
    const std::size_t seq = cfg_.seq, whole = seq * cp;  // cfg_.seq: this rank's share of a sequence
    WEFT_REQUIRE(seq > 0 && rows % seq == 0 && cfg_.seq_shards == cp, ShapeError, "nn::MoE: ", rows,
                 " rows under context parallelism (cp ", cp, ") are not whole sequence shares of ", seq,
                 " tokens (config seq_shards ", cfg_.seq_shards, ")");
    return ctx_->ep.sample_index() * rows * cp + (row / seq) * whole + context::global_index(row % seq, whole, cp, ctx_->cp.rank());
  }

  // The capacity order of candidate slots (score, global slot index): higher
  // score first, then the lower slot.
  static bool ranks_before(const std::pair<double, double>& a, const std::pair<double, double>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }

  // w.du = d/du of sum(dout * out) (through the gates) + loss_weight * (aux + z).
  void router_logits_backward(const Saved& s, std::size_t n, Workspace& w) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_route");
    const std::size_t N = cfg_.experts, K = cfg_.top_k;
    auto dg = Kokkos::create_mirror_view(w.dgate);
    Kokkos::deep_copy(dg, w.dgate);
    auto du = Kokkos::create_mirror_view(w.du);
    const bool softmax = cfg_.router == RouterKind::softmax;
    const double lw = loss_weight_;
    const double ng = s.tokens_global;
    std::vector<double> ds(N);
    for (std::size_t t = 0; t < n; ++t) {
      const double* p = &s.scores[t * N];
      // Aux loss: alpha N f_e / n per score (f_e is a count: no gradient; n:
      // the microbatch's tokens over every data rank).
      for (std::size_t e = 0; e < N; ++e)
        ds[e] = lw * cfg_.aux_loss * double(N) * (s.selected[e] / (ng * double(K))) / ng;
      // Gates: g_j = p_j / S over the chosen set (or g_j = p_j).
      if (cfg_.normalize_gates) {
        double S = 0, gdg = 0;
        for (std::size_t q = 0; q < K; ++q) {
          S += p[s.slot_expert[t * K + q]];
          gdg += s.slot_gate[t * K + q] * double(dg(t * K + q));
        }
        for (std::size_t q = 0; q < K; ++q) ds[std::size_t(s.slot_expert[t * K + q])] += (double(dg(t * K + q)) - gdg) / S;
      } else {
        for (std::size_t q = 0; q < K; ++q) ds[std::size_t(s.slot_expert[t * K + q])] += double(dg(t * K + q));
      }
      if (softmax) {
        double dot = 0;
        for (std::size_t e = 0; e < N; ++e) dot += p[e] * ds[e];
        for (std::size_t e = 0; e < N; ++e) du(t, e) = T(p[e] * (ds[e] - dot));
      } else {
        for (std::size_t e = 0; e < N; ++e) du(t, e) = T(ds[e] * p[e] * (1 - p[e]));
      }
      // z-loss: 2 beta lse_t softmax(u_t) / n.
      if (cfg_.z_loss != 0) {
        const double c = lw * 2 * cfg_.z_loss * s.lse[t] / ng;
        for (std::size_t e = 0; e < N; ++e) du(t, e) += T(c * std::exp(s.u[t * N + e] - s.lse[t]));
      }
    }
    Kokkos::deep_copy(w.du, du);
  }

  ContextPtr ctx_;
  ContextPtr inner_;  // the experts' and router's context: no TP, CP or EP split (they are whole)
  GPTConfig cfg_;
  std::size_t local_, first_;  // this rank's experts: first_ .. first_ + local_ - 1
  Linear<T, Space> router_;
  Parameter<T, Space> bias_;
  std::vector<Expert> experts_, shared_;
  std::vector<double> step_counts_;
  MoEStats stats_;
  double loss_weight_ = 1;
  double last_aux_ = 0, last_z_ = 0;
  bool recording_ = true;
  std::vector<int> route_expert_;  // the last recorded pass: each slot's expert, -1 when dropped
  int exchange_path_ = -1;  // node_exchange(): -1 not decided yet, 0 all_to_allv, 1 node-shared
};

namespace detail {
// The communicator over those of the axes Tags... that MeshT has (mesh order,
// whatever the order named); null when it has none of them.
template <class MeshT, class... Have>
Comm* axes_of(MeshT& mesh, std::tuple<Have...>*) {
  if constexpr (sizeof...(Have) == 0) return nullptr;
  else return &mesh.template axes<Have...>();
}
template <class MeshT, class Tag, bool Want>
using axis_if_t = std::conditional_t<Want && MeshT::template has_axis<Tag>, std::tuple<Tag>, std::tuple<>>;
}  // namespace detail

/// The ExpertSplit a strategy S gives a MoE model of config c on `mesh`:
/// with On<EP, Experts<N>>, the experts are split over mesh.axis<EP>(). The
/// microbatch is shared by the mesh's DP and EP axes (the ranks that hold
/// different samples: sample_rank = DP coordinate x ep + EP coordinate), its
/// CP axis (each CP rank holds a share of every sequence) and, under
/// TensorParallel<SequenceParallel>, its TP axis (each TP rank routes a
/// shard of those tokens); token_shards = cp x (tp under sequence
/// parallelism). Without an EP policy the routing still covers those ranks,
/// so that the capacity and the losses are the whole microbatch's under
/// plain data parallelism too. Throws ConfigError when N is not c.experts,
/// when N does not divide by ep (naming the ep sizes that work), and for an
/// EP axis of more than one rank without an Experts policy.
template <StrategyType S, class MeshT>
ExpertSplit expert_split_of(MeshT& mesh, const GPTConfig& c) {
  static_assert(check_strategy_mesh<S, MeshT>());
  ExpertSplit x;
  constexpr bool split_experts = S::expert_parallel_v;
  if constexpr (split_experts) {
    constexpr std::size_t n = S::expert_parallel::experts;
    const std::size_t ep = std::size_t(mesh.template extent<EP>());
    WEFT_REQUIRE(c.experts == n, ConfigError, S::name(), ": the strategy's Experts<", n, "> does not match the model's ",
                 c.experts, " routed experts (GPTConfig::experts, --experts); instantiate Experts<", c.experts, ">");
    WEFT_REQUIRE(n % ep == 0, ConfigError,
                 "weft::Experts<N>: the routed experts do not divide by the EP axis' extent (each EP rank holds N / ep "
                 "whole experts); choose ep among the divisors of N (N ",
                 n, ", ep ", ep, "; ep sizes that work: ", weft::detail::divisors_text(n), ")");
    x.ep = &mesh.template axis<EP>();
  } else {
    if constexpr (MeshT::template has_axis<EP>)
      WEFT_REQUIRE(mesh.template extent<EP>() == 1, ConfigError, S::name(), ": the mesh's ep axis has extent ",
                   mesh.template extent<EP>(), " but the strategy gives it no policy; add On<EP, Experts<", c.experts,
                   ">> to the strategy or set ep=1");
  }
  // The ranks whose tokens form the microbatch, in one communicator (an axis
  // of extent 1 changes nothing); the samples' index from the coordinates.
  constexpr bool sp = [] {
    if constexpr (MeshT::template has_axis<TP>) return S::sequence_parallel;
    else return false;
  }();
  using Data = decltype(std::tuple_cat(
      std::declval<detail::axis_if_t<MeshT, DP, true>>(), std::declval<detail::axis_if_t<MeshT, CP, true>>(),
      std::declval<detail::axis_if_t<MeshT, EP, split_experts>>(), std::declval<detail::axis_if_t<MeshT, TP, sp>>()));
  x.data = detail::axes_of(mesh, static_cast<Data*>(nullptr));
  std::size_t sample = 0;
  if constexpr (MeshT::template has_axis<DP>) sample = std::size_t(mesh.template coord<DP>());
  if constexpr (split_experts) sample = sample * std::size_t(mesh.template extent<EP>()) + std::size_t(mesh.template coord<EP>());
  x.sample_rank = sample;
  if constexpr (MeshT::template has_axis<CP>) x.token_shards *= std::size_t(mesh.template extent<CP>());
  if constexpr (sp) x.token_shards *= std::size_t(mesh.template extent<TP>());
  if (x.data && x.data->size() == 1) x.data = nullptr;
  if (x.ep && x.ep->size() == 1) x.ep = nullptr;
  return x;
}

}  // namespace weft::nn
