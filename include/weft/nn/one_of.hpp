// nn::OneOf<Kinds...>: a block that is one of several block kinds, chosen per
// block when the model builds it. A LayeredModel has one Block type; a model
// whose blocks differ (dense and mixture-of-experts blocks, attention and
// convolution blocks, a wider last block) names OneOf<A, B, ...> as that type
// and builds each block as the kind its index calls for. The stages, the
// data-parallel modes and every schedule then run it like any other block.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/nn/layer.hpp>

namespace weft::nn {

namespace detail {
template <class T, class... Ts>
inline constexpr bool one_of_distinct_v = (!std::is_same_v<T, Ts> && ...) && one_of_distinct_v<Ts...>;
template <class T>
inline constexpr bool one_of_distinct_v<T> = true;
template <class T, class... Ts>
inline constexpr std::size_t one_of_index_v = [] {
  constexpr bool same[] = {std::is_same_v<T, Ts>...};
  for (std::size_t i = 0; i < sizeof...(Ts); ++i)
    if (same[i]) return i;
  return sizeof...(Ts);
}();
}  // namespace detail

/// A block of one of the kinds Kinds... (at least one, all distinct), each
/// of which meets nn::Layer with the same value_type and execution_space.
/// It meets nn::Layer itself, and nn::SplitBackwardLayer when every kind
/// does (so zero-bubble schedules run a model of such blocks):
///   - `Saved` is std::variant<Kinds::Saved...>: make_saved(rows) returns the
///     held kind's Saved (the stage keeps one per block and in-flight
///     microbatch, so each block's Saved stays of its kind);
///   - forward, backward, backward_input, collect and saved_bytes call the
///     held kind's member of the same name with the same arguments and the
///     Saved of that kind; a Saved of another kind is a weft::Error naming
///     both kinds (it cannot happen through a stage).
/// Building one: OneOf(std::unique_ptr<K>) for a K among Kinds, or
/// OneOf::make<K>(args...), which constructs a K from args. kind() is the
/// index of the held kind in Kinds..., get<K>() the held block (null when it
/// is of another kind).
template <class... Kinds>
class OneOf {
  static_assert(sizeof...(Kinds) >= 1, "weft::nn::OneOf<Kinds...>: name at least one block kind");
  static_assert(detail::one_of_distinct_v<Kinds...>,
                "weft::nn::OneOf<Kinds...>: a kind is named twice; name each block kind once");
  static_assert((Layer<Kinds> && ...),
                "weft::nn::OneOf<Kinds...>: every kind must meet weft::nn::Layer (value_type, execution_space, Saved, "
                "make_saved, saved_bytes, forward, backward, collect)");
  using First = std::tuple_element_t<0, std::tuple<Kinds...>>;

 public:
  using value_type = typename First::value_type;
  using execution_space = typename First::execution_space;
  static_assert((std::is_same_v<typename Kinds::value_type, value_type> && ...),
                "weft::nn::OneOf<Kinds...>: the kinds have different value_types; every block of a model works on "
                "one residual stream type");
  static_assert((std::is_same_v<typename Kinds::execution_space, execution_space> && ...),
                "weft::nn::OneOf<Kinds...>: the kinds have different execution_spaces; every block of a model runs "
                "on one");
  using Saved = std::variant<typename Kinds::Saved...>;
  using Param = Parameter<value_type, execution_space>;
  /// Number of kinds.
  static constexpr std::size_t kinds = sizeof...(Kinds);
  /// The index of kind K in Kinds... (kinds when K is not among them).
  template <class K>
  static constexpr std::size_t index_of = detail::one_of_index_v<K, Kinds...>;

  /// Holds `block` (not null), of kind K.
  template <class K>
    requires(detail::one_of_index_v<K, Kinds...> < sizeof...(Kinds))
  explicit OneOf(std::unique_ptr<K> block) : b_(std::in_place_index<index_of<K>>, std::move(block)) {
    WEFT_REQUIRE(std::get<index_of<K>>(b_) != nullptr, Error, "weft::nn::OneOf: a null block of kind ", index_of<K>);
  }
  /// A block of kind K built from args.
  template <class K, class... Args>
    requires(detail::one_of_index_v<K, Kinds...> < sizeof...(Kinds))
  static OneOf make(Args&&... args) {
    return OneOf(std::make_unique<K>(std::forward<Args>(args)...));
  }

  /// The index in Kinds... of the kind held.
  std::size_t kind() const { return b_.index(); }
  /// The block held when it is of kind K, else null.
  template <class K>
  K* get() {
    auto* p = std::get_if<index_of<K>>(&b_);
    return p ? p->get() : nullptr;
  }
  template <class K>
  const K* get() const {
    auto* p = std::get_if<index_of<K>>(&b_);
    return p ? p->get() : nullptr;
  }

  /// The held kind's Saved for `rows` rows.
  Saved make_saved(std::size_t rows) {
    return visit([&]<std::size_t I>(auto& b) { return Saved(std::in_place_index<I>, b.make_saved(rows)); });
  }
  /// Bytes the held kind says s holds.
  std::size_t saved_bytes(const Saved& s) const {
    return visit([&]<std::size_t I>(const auto& b) -> std::size_t { return b.saved_bytes(saved_of<I>(s)); });
  }
  /// The held kind's forward.
  template <class XV, class YV>
  void forward(const XV& x, const YV& y, Saved& s) {
    visit([&]<std::size_t I>(auto& b) { b.forward(x, y, saved_of<I>(s)); });
  }
  /// The held kind's backward.
  template <class XV, class DYV, class DXV>
  void backward(const XV& x, const DYV& dy, const DXV& dx, Saved& s) {
    visit([&]<std::size_t I>(auto& b) { b.backward(x, dy, dx, saved_of<I>(s)); });
  }
  /// The held kind's input-gradient half (when every kind splits its backward).
  template <class XV, class DYV, class DXV>
    requires(SplitBackwardLayer<Kinds> && ...)
  void backward_input(const XV& x, const DYV& dy, const DXV& dx, Saved& s, DeferredWork& work) {
    visit([&]<std::size_t I>(auto& b) { b.backward_input(x, dy, dx, saved_of<I>(s), work); });
  }
  /// Appends the held block's parameters.
  void collect(std::vector<Param*>& ps) {
    visit([&]<std::size_t I>(auto& b) { b.collect(ps); });
  }

 private:
  // f.template operator()<I>(block) for the held kind I.
  template <class F>
  decltype(auto) visit(F&& f) {
    return visit_at<0>(b_, f);
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_at<0>(b_, f);
  }
  template <std::size_t I, class V, class F>
  static decltype(auto) visit_at(V& v, F& f) {
    if constexpr (I + 1 < sizeof...(Kinds)) {
      if (v.index() != I) return visit_at<I + 1>(v, f);
    }
    return f.template operator()<I>(*std::get<I>(v));
  }
  template <std::size_t I, class S>
  static auto& saved_of(S& s) {
    WEFT_REQUIRE(s.index() == I, Error, "weft::nn::OneOf: a block of kind ", I, " was given the Saved of kind ",
                 s.index(), "; each block keeps the Saved its own make_saved returned");
    return std::get<I>(s);
  }

  std::variant<std::unique_ptr<Kinds>...> b_;
};

}  // namespace weft::nn
