// What nn::Attention needs of a context-parallel strategy: attention of one
// sequence whose tokens are sharded over the CP axis, behind an interface,
// so that the model's type depends on the tensor-parallel policy alone and
// the CP variant (a type, weft::Context<Ring | AllGather | AllToAll>) is
// chosen where the model is built. parallel/context.hpp implements it with
// context::ContextAttention<Variant, T, Space>; context::attention_of makes one.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>

#include <weft/comm/comm.hpp>
#include <weft/core/error.hpp>
#include <weft/ops/common.hpp>
#include <weft/precision/policy.hpp>

namespace weft::nn {

/// The element type the K/V blocks of a context-parallel attention travel
/// and are read in, for a model computing in T under the weft::Precision
/// Prec: Prec's 2-byte param_type (weft::bf16, weft::fp16) when Prec is
/// mixed, else T.
template <class T, class Prec>
using context_kv_t = std::conditional_t<Prec::mixed, typename Prec::param_type, T>;

/// Attention of one sequence over the CP axis: this rank's queries against
/// every key, for [heads, T / cp, head_dim] views of this rank's tokens (a
/// contiguous last dimension), in the balanced layout.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class SequenceAttention {
 public:
  /// [heads, tokens, head_dim] over a [tokens, columns] matrix (no copy).
  using View3 = Kokkos::View<T***, Kokkos::LayoutStride, typename ops::Matrix<T, Space>::device_type,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  /// [heads, tokens] (the log-sum-exp of each query row).
  using View2 = Kokkos::View<T**, Kokkos::LayoutStride, typename ops::Matrix<T, Space>::device_type,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  virtual ~SequenceAttention() = default;
  /// O = causal softmax(scale Q K^T) V over the whole sequence; lse per row.
  /// Q, K, V, O and lse must stay unchanged until backward.
  virtual void forward(const View3& q, const View3& k, const View3& v, T scale, const View3& o, const View2& lse) = 0;
  /// dQ, dK, dV (overwritten) from dO for the last forward.
  virtual void backward(const View3& dO, const View3& dq, const View3& dk, const View3& dv) = 0;
  /// Bytes the layer itself keeps from forward to backward (beyond the views it was given).
  virtual std::size_t owned_bytes() const = 0;
  /// The most bytes of exchange and scratch buffers the layer has held at
  /// once during one forward or backward so far (freed when each returns).
  virtual std::size_t peak_buffer_bytes() const = 0;
};

/// A model's context parallelism: the CP communicator and how to build the
/// attention of one sequence (from the CP policy type, see
/// context::attention_of). Empty (no communicator): whole sequences.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
struct ContextParallel {
  Comm* comm = nullptr;  ///< the CP axis
  std::string policy;    ///< "Context<Ring>", ...
  /// The element type the K/V blocks travel in, as weft::mpi_datatype
  /// spells it ("float", "weft::bf16", ...; context_kv_t<T, Prec> for the
  /// precision the attention was made for): a model refuses at construction
  /// a ContextParallel made for another precision than its own (ConfigError).
  std::string kv_type = mpi_datatype<T>::name;
  /// make(heads, kv_heads, seq, head_dim): attention of one sequence of seq global tokens.
  std::function<std::unique_ptr<SequenceAttention<T, Space>>(std::size_t, std::size_t, std::size_t, std::size_t)> make;
  /// Number of CP ranks (1 without a communicator).
  std::size_t size() const { return comm ? static_cast<std::size_t>(comm->size()) : 1; }
};

/// Throws ConfigError unless `cp` (with more than one rank) was made for the
/// precision Prec of a model computing in T: its kv_type must be
/// mpi_datatype<context_kv_t<T, Prec>>::name. `who` names the model in the
/// message ("nn::GPT", "pipeline::Stage").
template <class T, class Prec, class Space>
void check_context_precision(const ContextParallel<T, Space>& cp, const char* who) {
  if (cp.size() <= 1) return;
  const char* want = mpi_datatype<context_kv_t<T, Prec>>::name;
  WEFT_REQUIRE(cp.kv_type == want, ConfigError, who, ": the model's precision moves its K/V blocks over CP in ", want,
               ", but its ContextParallel (", cp.policy, ") was made for ", cp.kv_type,
               " blocks; make it with weft::context::attention_of<S, T>(mesh), which takes the precision from the "
               "model's strategy S, or with attention_of<Policy, T, Space, Prec> and the model's weft::Precision");
}

}  // namespace weft::nn
