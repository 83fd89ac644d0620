// The oneDNN GEMM provider: C = alpha op(A) op(B) + beta C through oneDNN's
// matmul primitive on the host, with the primitive built once per shape,
// strides, transposes and coefficients and reused from a cache. Included by
// weft/ops/gemm.hpp when weft is configured with oneDNN.
#pragma once

#include <weft/config.hpp>
#include <weft/ops/gemm_provider.hpp>

#if WEFT_ONEDNN_PROVIDER

#include <oneapi/dnnl/dnnl.hpp>

#include <bit>
#include <cstdint>
#include <list>
#include <unordered_map>


namespace weft::ops {

namespace detail::onednn {

/// oneDNN's data type of value type T.
template <class T>
struct data_type;
template <>
struct data_type<float> {
  static constexpr dnnl::memory::data_type value = dnnl::memory::data_type::f32;
};
template <>
struct data_type<bf16> {
  static constexpr dnnl::memory::data_type value = dnnl::memory::data_type::bf16;
};

/// Everything that decides a matmul primitive: shapes, the strides of each
/// operand as oneDNN sees op(X) (row stride, column stride), the data types
/// and the coefficients (alpha and beta are baked into the primitive's
/// post-ops).
struct Key {
  std::int64_t m, n, k;
  std::int64_t sa0, sa1, sb0, sb1, sc0, sc1;
  int ta, tb, tc;
  float alpha, beta;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  std::size_t operator()(const Key& key) const {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (std::int64_t v : {key.m, key.n, key.k, key.sa0, key.sa1, key.sb0, key.sb1, key.sc0, key.sc1})
      mix(static_cast<std::uint64_t>(v));
    mix(static_cast<std::uint64_t>(key.ta * 64 + key.tb * 8 + key.tc));
    mix(std::bit_cast<std::uint32_t>(key.alpha));
    mix(std::bit_cast<std::uint32_t>(key.beta));
    return static_cast<std::size_t>(h);
  }
};

/// A primitive ready to execute, with memory objects for its three operands
/// whose data handles are set per call (making three dnnl::memory objects
/// per call cost about a microsecond, a fifth of a 128 x 32 x 128 product).
struct Entry {
  dnnl::matmul prim;
  dnnl::memory a, b, c;
};

/// The CPU engine, a stream and the primitive cache of one host thread.
/// Building a matmul primitive costs tens of microseconds (descriptor checks
/// and the JIT of its kernels); a training step makes the same few hundred
/// products every time, so each is built once per thread that multiplies
/// (in weft, the thread that runs the step). Being per thread, the cache
/// needs no lock and its entries' memory objects can be re-pointed freely.
/// It holds at most `capacity` primitives and forgets the least recently
/// used one beyond that.
class Context {
 public:
  static constexpr std::size_t capacity = 1024;

  /// The calling thread's context.
  static Context& get() {
    static thread_local Context ctx;
    return ctx;
  }

  dnnl::engine& engine() { return engine_; }
  dnnl::stream& stream() { return stream_; }

  /// The primitive of `key`, built by `make` on a miss. The reference stays
  /// valid until `capacity` other keys have been used since on this thread.
  template <class Make>
  Entry& lookup(const Key& key, Make&& make) {
    if (auto it = map_.find(key); it != map_.end()) {
      order_.splice(order_.begin(), order_, it->second.second);
      return it->second.first;
    }
    Entry e = make(engine_);
    if (map_.size() >= capacity) {
      map_.erase(order_.back());
      order_.pop_back();
    }
    order_.push_front(key);
    ++builds_;
    return map_.emplace(key, std::make_pair(std::move(e), order_.begin())).first->second.first;
  }

  /// Primitives this thread has built (a cache miss each).
  std::uint64_t builds() const { return builds_; }

 private:
  Context() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::list<Key> order_;
  std::unordered_map<Key, std::pair<Entry, std::list<Key>::iterator>, KeyHash> map_;
  std::uint64_t builds_ = 0;
};

/// Row and column strides of op(X) for a rank-2 view X: a transpose swaps them.
template <class V>
std::array<std::int64_t, 2> op_strides(const V& x, bool trans) {
  const auto s0 = static_cast<std::int64_t>(x.stride(0)), s1 = static_cast<std::int64_t>(x.stride(1));
  return trans ? std::array<std::int64_t, 2>{s1, s0} : std::array<std::int64_t, 2>{s0, s1};
}

/// Builds the matmul of `key`: alpha as an eltwise_linear post-op applied to
/// the product, then beta as a sum post-op (dst = alpha A B + beta dst). Both
/// are post-ops rather than output scales so that the same code holds for
/// oneDNN 2.x and 3.x, which changed how scales are given.
inline Entry make_entry(const Key& key, dnnl::engine& eng) {
  using md = dnnl::memory::desc;
  using dt = dnnl::memory::data_type;
  const md a({key.m, key.k}, static_cast<dt>(key.ta), dnnl::memory::dims{key.sa0, key.sa1});
  const md b({key.k, key.n}, static_cast<dt>(key.tb), dnnl::memory::dims{key.sb0, key.sb1});
  const md c({key.m, key.n}, static_cast<dt>(key.tc), dnnl::memory::dims{key.sc0, key.sc1});
  dnnl::post_ops po;
  if (key.alpha != 1.0f) {
#if DNNL_VERSION_MAJOR >= 3
    po.append_eltwise(dnnl::algorithm::eltwise_linear, key.alpha, 0.0f);
#else
    po.append_eltwise(1.0f, dnnl::algorithm::eltwise_linear, key.alpha, 0.0f);
#endif
  }
  if (key.beta != 0.0f) po.append_sum(key.beta);
  dnnl::primitive_attr attr;
  attr.set_post_ops(po);
#if DNNL_VERSION_MAJOR >= 3
  dnnl::matmul::primitive_desc pd(eng, a, b, c, attr);
#else
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, eng);
#endif
  // Memory objects without a buffer of their own: each call points them at its operands.
  return Entry{dnnl::matmul(pd), dnnl::memory(a, eng, DNNL_MEMORY_NONE), dnnl::memory(b, eng, DNNL_MEMORY_NONE),
               dnnl::memory(c, eng, DNNL_MEMORY_NONE)};
}

}  // namespace detail::onednn

/// The oneDNN provider's product (declared in weft/ops/gemm_provider.hpp).
/// Operands are host views of float, or bf16 A and B with a float or bf16
/// C (oneDNN accumulates in fp32), in one layout; their strides go to oneDNN as they are, so row
/// slices of a wider matrix (a head inside fused QKV) need no copy. A
/// dnnl::error becomes weft::Error naming the shapes.
template <class AV, class BV, class CV>
void onednn_gemm(Trans ta, Trans tb, float alpha, const AV& A, const BV& B, float beta, const CV& C) {
  namespace od = detail::onednn;
  using TA = typename AV::non_const_value_type;
  using TB = typename BV::non_const_value_type;
  using TC = typename CV::non_const_value_type;
  const bool at = ta == Trans::T, bt = tb == Trans::T;
  const auto sa = od::op_strides(A, at), sb = od::op_strides(B, bt), sc = od::op_strides(C, false);
  od::Key key{static_cast<std::int64_t>(C.extent(0)),
              static_cast<std::int64_t>(C.extent(1)),
              static_cast<std::int64_t>(at ? A.extent(0) : A.extent(1)),
              sa[0], sa[1], sb[0], sb[1], sc[0], sc[1],
              static_cast<int>(od::data_type<TA>::value),
              static_cast<int>(od::data_type<TB>::value),
              static_cast<int>(od::data_type<TC>::value),
              alpha,
              beta};
  auto& ctx = od::Context::get();
  try {
    od::Entry& e = ctx.lookup(key, [&](dnnl::engine& eng) { return od::make_entry(key, eng); });
    e.a.set_data_handle(const_cast<TA*>(A.data()));
    e.b.set_data_handle(const_cast<TB*>(B.data()));
    e.c.set_data_handle(C.data());
    e.prim.execute(ctx.stream(), {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}});
    ctx.stream().wait();
  } catch (const dnnl::error& err) {
    weft::detail::throw_error<Error>("weft::ops::gemm (oneDNN provider): oneDNN refused the product of op(A) ", key.m, "x",
                               key.k, " (strides ", key.sa0, ", ", key.sa1, ") and op(B) ", key.k, "x", key.n,
                               " (strides ", key.sb0, ", ", key.sb1, ") into C (strides ", key.sc0, ", ", key.sc1,
                               "): ", err.what(), " (status ", static_cast<int>(err.status),
                               "); configure weft with -DWEFT_ENABLE_ONEDNN=OFF to use Kokkos Kernels instead");
  }
}

template <>
struct gemm_provider_runner<OneDnnGemm> {
  template <class AV, class BV, class CV>
  static void run(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
                  typename CV::const_value_type beta, const CV& C) {
    onednn_gemm(ta, tb, to_float(alpha), A, B, to_float(beta), C);
  }
};

/// Primitives the oneDNN provider has built on the calling thread (a cache
/// miss each; every thread that multiplies keeps its own cache).
inline std::uint64_t onednn_primitive_builds() { return detail::onednn::Context::get().builds(); }

}  // namespace weft::ops

#endif  // WEFT_ONEDNN_PROVIDER
