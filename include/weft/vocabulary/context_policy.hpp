// Context parallelism as a type: weft::Context<Ring | AllGather | AllToAll>,
// the policy of the CP axis, and the causally balanced layout of a sequence
// over it. Pure types and arithmetic, no run time (parallel/context.hpp runs
// the attention of each variant).
//
// The layout: with cp ranks the sequence of T tokens is cut into 2·cp chunks
// of C = T / (2·cp), and rank r holds chunks r and 2·cp−1−r, in that order.
// Under a causal mask the attention work of chunk c grows with c, so pairing
// the c-th chunk from the front with the c-th from the back gives every rank
// the same work. Every position, target and loss index of a CP rank comes
// from context_global_index, so nothing is left to the user (rotary offsets
// included).
#pragma once

#include <Kokkos_Macros.hpp>  // KOKKOS_INLINE_FUNCTION: the index rules run in kernels too
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/mesh/axis.hpp>

namespace weft {

/// Context<Ring>: K/V blocks travel round the CP ring by non-blocking
/// point-to-point, overlapped with the current block's attention; partial
/// outputs merge by log-sum-exp. In backward, dK/dV travel with their block
/// and arrive back at their owner after cp hops.
struct Ring {
  static constexpr const char* name = "Ring";  ///< the variant's spelling
};
/// Context<AllGather>: all-gather K/V over CP, attention of the local queries
/// against the whole sequence, reduce-scatter of dK/dV. Cheap when K/V heads
/// are few (grouped-query attention).
struct AllGather {
  static constexpr const char* name = "AllGather";  ///< the variant's spelling
};
/// Context<AllToAll> (Ulysses): an all-to-all turns sequence shards into head
/// shards, attention runs over the whole sequence for heads / cp heads, and
/// the reverse all-to-all turns the output back. Query heads must divide by
/// cp; K/V heads must divide by cp or divide cp (then they are replicated).
struct AllToAll {
  static constexpr const char* name = "AllToAll";  ///< the variant's spelling
};

/// True for the three context-parallel variants.
template <class V>
inline constexpr bool is_context_variant_v =
    std::is_same_v<V, Ring> || std::is_same_v<V, AllGather> || std::is_same_v<V, AllToAll>;

/// The CP axis' policy: attention over a sequence sharded in the balanced
/// layout, by the variant's communication. On<CP, Context<Ring>>.
template <class Variant>
struct Context {
  static_assert(is_context_variant_v<Variant>,
                "weft::Context<Variant>: the variant must be weft::Ring, weft::AllGather or weft::AllToAll");
  using policy_axis = CP;     ///< the axis this policy belongs on
  using variant = Variant;    ///< Ring, AllGather or AllToAll
  /// "Context<Ring>", "Context<AllGather>" or "Context<AllToAll>".
  static std::string policy_name() { return std::string("Context<") + Variant::name + ">"; }
};

template <class X>
struct is_context_policy : std::false_type {};
template <class V>
struct is_context_policy<Context<V>> : std::true_type {};
/// True for Context<Variant>.
template <class X>
inline constexpr bool is_context_policy_v = is_context_policy<X>::value;

namespace context {

/// The tokens of one chunk: T / (2·cp).
KOKKOS_INLINE_FUNCTION constexpr std::size_t chunk_tokens(std::size_t T, std::size_t cp) { return T / (2 * cp); }

/// The global chunk index of part p (0 or 1) of rank r: r, then 2·cp−1−r.
KOKKOS_INLINE_FUNCTION constexpr std::size_t chunk_of(std::size_t rank, std::size_t part, std::size_t cp) {
  return part == 0 ? rank : 2 * cp - 1 - rank;
}

/// The global token index of rank r's local token t (0 <= t < T / cp) in the
/// balanced layout of T tokens over cp ranks.
KOKKOS_INLINE_FUNCTION constexpr std::size_t global_index(std::size_t t, std::size_t T, std::size_t cp, std::size_t rank) {
  const std::size_t c = chunk_tokens(T, cp);
  return t < c ? rank * c + t : (2 * cp - 1 - rank) * c + (t - c);
}

/// True when T tokens can be laid out over cp ranks: T is a positive multiple of 2·cp.
constexpr bool sequence_fits(std::size_t T, std::size_t cp) { return cp > 0 && T > 0 && T % (2 * cp) == 0; }

/// Throws ConfigError unless T is a multiple of 2·cp, naming the nearest
/// lengths that work: tokens are never dropped to make a length fit.
inline void check_sequence(std::size_t T, std::size_t cp, const char* what = "the sequence length") {
  WEFT_REQUIRE(cp > 0, ConfigError, "context parallelism: cp must be at least 1");
  if (sequence_fits(T, cp)) return;
  const std::size_t m = 2 * cp, below = T / m * m, above = (T / m + 1) * m;
  std::string works = below > 0 ? std::to_string(below) + " or " + std::to_string(above) : std::to_string(above);
  WEFT_REQUIRE(false, ConfigError, "context parallelism: ", what, " ", T, " does not divide into 2·cp = ", m,
               " equal chunks (the causally balanced layout gives rank r chunks r and 2·cp−1−r); lengths that work "
               "are the multiples of ",
               m, ", e.g. ", works, ". No token is dropped to make it fit.");
}

/// True when AllToAll can shard `heads` query heads and `kv_heads` K/V heads over cp ranks.
constexpr bool alltoall_fits(std::size_t heads, std::size_t kv_heads, std::size_t cp) {
  return cp > 0 && kv_heads > 0 && heads % cp == 0 && heads % kv_heads == 0 &&
         (kv_heads % cp == 0 || cp % kv_heads == 0);
}

/// The cp sizes (up to `heads`) AllToAll accepts for these head counts.
inline std::vector<std::size_t> alltoall_sizes(std::size_t heads, std::size_t kv_heads) {
  std::vector<std::size_t> out;
  for (std::size_t cp = 1; cp <= heads; ++cp)
    if (alltoall_fits(heads, kv_heads, cp)) out.push_back(cp);
  return out;
}

/// Throws ConfigError unless AllToAll fits, listing the cp sizes that do.
inline void check_alltoall(std::size_t heads, std::size_t kv_heads, std::size_t cp) {
  if (alltoall_fits(heads, kv_heads, cp)) return;
  std::string sizes;
  for (std::size_t s : alltoall_sizes(heads, kv_heads)) sizes += (sizes.empty() ? "" : ", ") + std::to_string(s);
  WEFT_REQUIRE(false, ConfigError, "Context<AllToAll>: ", heads, " query heads and ", kv_heads,
               " K/V heads cannot be sharded over cp = ", cp,
               " (query heads must divide by cp; K/V heads must divide by cp or divide cp, and are then "
               "replicated); cp sizes that work: ",
               sizes.empty() ? std::string("none") : sizes);
}

/// Compile-time form of check_alltoall for static sizes.
template <std::size_t Heads, std::size_t KVHeads, std::size_t CPSize>
constexpr bool static_alltoall_check() {
  static_assert(alltoall_fits(Heads, KVHeads, CPSize),
                "Context<AllToAll>: the heads cannot be sharded over cp (query heads must divide by cp; K/V heads "
                "must divide by cp or divide cp); pick a cp from weft::context::alltoall_sizes(heads, kv_heads) or "
                "use Context<Ring> / Context<AllGather>");
  return true;
}

/// Compile-time form of check_sequence for static sizes.
template <std::size_t T, std::size_t CPSize>
constexpr bool static_sequence_check() {
  static_assert(sequence_fits(T, CPSize),
                "context parallelism: the sequence length must be a multiple of 2·cp (the causally balanced layout "
                "gives rank r chunks r and 2·cp−1−r); no token is dropped to make it fit");
  return true;
}

}  // namespace context
}  // namespace weft
