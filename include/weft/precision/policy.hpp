// The precision policy of a strategy, weft::Precision<Param, Reduce, LossScale>:
// the type the compute copy of the parameters, the activations and the
// transfers are stored in, the type gradients are reduced in, and whether
// fp16 gradients are loss-scaled. Pure types and checks, like the axis policies.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include <weft/core/half.hpp>

namespace weft {

// ---------------------------------------------------------------------------
// Precision tags: a floating-point format by name, with its storage type.

/// IEEE single precision: weft's full precision, and the default of every
/// part of a Precision.
struct F32 {
  using type = float;                             ///< the storage type
  static constexpr std::size_t bytes = 4;         ///< bytes per element
  static constexpr std::string_view name = "F32";
};
/// bfloat16 (weft::bf16): float's exponent range, 8 significant bits.
struct BF16 {
  using type = bf16;
  static constexpr std::size_t bytes = 2;
  static constexpr std::string_view name = "BF16";
};
/// IEEE half precision (weft::fp16): 11 significant bits, magnitudes from
/// 2^-24 to 65504; gradients need a loss scaler to stay in that range.
struct FP16 {
  using type = fp16;
  static constexpr std::size_t bytes = 2;
  static constexpr std::string_view name = "FP16";
};

/// True for the precision tags F32, BF16 and FP16.
template <class X>
inline constexpr bool is_precision_tag_v = std::is_same_v<X, F32> || std::is_same_v<X, BF16> || std::is_same_v<X, FP16>;

// ---------------------------------------------------------------------------
// Loss-scaling policies.

/// No loss scaling: the loss's gradient is back-propagated as is (F32 and BF16).
struct NoLossScale {
  static constexpr std::string_view name = "NoLossScale";
};
/// Dynamic loss scaling (fp16): the loss is multiplied by a scale before the
/// backward pass and the gradients divided by it before the optimizer step;
/// a step whose gradients overflow is skipped and the scale lowered, and the
/// scale grows again after a window of clean steps. The state machine is
/// weft::DynamicLossScaler (precision/loss_scale.hpp), Megatron's defaults.
struct DynamicLossScale {
  static constexpr std::string_view name = "DynamicLossScale";
};

/// True for the loss-scaling policies NoLossScale and DynamicLossScale.
template <class X>
inline constexpr bool is_loss_scale_policy_v = std::is_same_v<X, NoLossScale> || std::is_same_v<X, DynamicLossScale>;

// ---------------------------------------------------------------------------
// The policy.

/// The precision of a training or serving run, an entry of weft::Strategy
/// beside the axis policies (not a policy of an axis):
///
///   weft::Strategy<weft::On<weft::DP, weft::FullyShard>, weft::Precision<weft::BF16, weft::F32>>
///
/// - Param: the type of the compute copy of the parameters, of the
///   activations (saved ones included) and of every transfer of them (FSDP
///   all-gathers, TP, CP, EP and pipeline messages).
/// - Reduce: the type gradients are reduced in over data parallelism: F32, or
///   the parameter type itself (bf16 reduction as an option).
/// - LossScale: DynamicLossScale for FP16 (required), NoLossScale otherwise.
///
/// Whatever the policy, the master weights, the optimizer's moments, the
/// gradient accumulation over microbatches, and the numerically delicate
/// statistics (norms, softmax and log-sum-exp, rotary angles, the
/// cross-entropy and its logits, the router's scores) stay float:
/// `master_type` and `accumulation_type`. A Strategy without a Precision entry
/// means Precision<> = Precision<F32, F32, NoLossScale>: everything fp32.
///
/// Compositions that mean nothing do not compile: FP16 without a loss scaler,
/// a loss scaler without FP16, a reduce type narrower than the parameter type.
template <class Param = F32, class Reduce = F32, class LossScale = NoLossScale>
struct Precision {
  static_assert(is_precision_tag_v<Param>,
                "weft::Precision<Param, Reduce, LossScale>: Param must be a precision tag, weft::F32, weft::BF16 or "
                "weft::FP16 (not a storage type such as float or weft::bf16)");
  static_assert(is_precision_tag_v<Reduce>,
                "weft::Precision<Param, Reduce, LossScale>: Reduce must be a precision tag, weft::F32, weft::BF16 or "
                "weft::FP16 (not a storage type such as float or weft::bf16)");
  static_assert(is_loss_scale_policy_v<LossScale>,
                "weft::Precision<Param, Reduce, LossScale>: LossScale must be weft::DynamicLossScale (with FP16) or "
                "weft::NoLossScale");
  static_assert(!(std::is_same_v<Param, F32> && !std::is_same_v<Reduce, F32>),
                "weft::Precision<F32, BF16 or FP16>: the reduce type is narrower than the parameter type -- fp32 "
                "gradients reduced in 2 bytes lose the precision the fp32 parameters keep; use weft::Precision<> "
                "(everything F32) or make the parameters 2-byte too: weft::Precision<weft::BF16, weft::BF16>");
  static_assert(!(std::is_same_v<Param, BF16> && std::is_same_v<Reduce, FP16>),
                "weft::Precision<BF16, FP16>: the reduce type is narrower than the parameter type -- fp16's range ends "
                "at 65504 where bf16's reaches 3e38, so reducing bf16 gradients in fp16 can overflow; use "
                "weft::Precision<weft::BF16, weft::F32> (or weft::BF16 as the reduce type)");
  static_assert(!(std::is_same_v<Param, FP16> && std::is_same_v<Reduce, BF16>),
                "weft::Precision<FP16, BF16, ...>: the reduce type is narrower than the parameter type -- bf16 keeps "
                "8 significant bits where fp16 keeps 11, so the reduction would drop what the parameters hold; use "
                "weft::Precision<weft::FP16, weft::F32, weft::DynamicLossScale> (or weft::FP16 as the reduce type)");
  static_assert(!(std::is_same_v<Param, FP16> && std::is_same_v<LossScale, NoLossScale>),
                "weft::Precision<FP16, ...> without a loss scaler: fp16 gradients below 2^-24 flush to zero and "
                "above 65504 overflow, so fp16 training needs loss scaling; write weft::Precision<weft::FP16, "
                "weft::F32, weft::DynamicLossScale>");
  static_assert(!(!std::is_same_v<Param, FP16> && std::is_same_v<LossScale, DynamicLossScale>),
                "weft::Precision<F32 or BF16, ..., DynamicLossScale>: a loss scaler serves fp16 only -- fp32 and bf16 "
                "share float's exponent range, so their gradients do not underflow where fp32's would not, and the "
                "scaler could only skip steps; drop weft::DynamicLossScale (e.g. weft::Precision<weft::BF16, "
                "weft::F32>)");

  /// No mesh axis: the precision holds for the whole model and is a Strategy
  /// entry of its own. (Declaring it lets On<Axis, Precision<...>> name the
  /// mistake through Strategy's own message rather than On's generic one.)
  using policy_axis = void;
  using param = Param;           ///< the parameter tag (F32, BF16, FP16)
  using reduce = Reduce;         ///< the gradient reduction's tag
  using loss_scale = LossScale;  ///< NoLossScale or DynamicLossScale
  /// The storage type of the compute copy of the parameters, the activations
  /// and the transfers: float, weft::bf16 or weft::fp16.
  using param_type = typename Param::type;
  /// The element type of the gradient reduction over DP: float, or param_type.
  using reduce_type = typename Reduce::type;
  /// The master weights' and the optimizer moments' type: always float.
  using master_type = float;
  /// What kernels accumulate in: always float (weft::accumulation_t<param_type>).
  using accumulation_type = float;
  static_assert(std::is_same_v<accumulation_t<param_type>, accumulation_type>);

  /// Whether anything is stored in 2 bytes (Param is not F32).
  static constexpr bool mixed = !std::is_same_v<Param, F32>;
  /// Whether gradients are loss-scaled (a DynamicLossScaler runs).
  static constexpr bool loss_scaled = std::is_same_v<LossScale, DynamicLossScale>;

  /// "Precision<BF16, F32>", "Precision<FP16, F32, DynamicLossScale>", ...;
  /// run records and Strategy::name() use it.
  static std::string policy_name() {
    std::string s = "Precision<" + std::string(Param::name) + ", " + std::string(Reduce::name);
    if constexpr (loss_scaled) s += ", " + std::string(LossScale::name);
    return s + ">";
  }
};

/// True for Precision<...> types.
template <class X>
inline constexpr bool is_precision_v = false;
template <class P, class R, class L>
inline constexpr bool is_precision_v<Precision<P, R, L>> = true;

/// Full precision: everything fp32 (what a Strategy without a Precision entry means).
using FullPrecision = Precision<>;

}  // namespace weft
