// Compile-time properties of pipeline schedules: a translation unit of
// static_asserts. Building it is the test; plans, their order and the bubble
// formulas are all evaluated by the compiler.
#include <algorithm>

#include <weft/vocabulary/schedule.hpp>

using namespace weft;

namespace {

// Every forward precedes the backward of the same (microbatch, chunk), and each
// compute runs exactly once: the local half of what the simulator checks.
template <class Schedule, std::size_t P, std::size_t M, int Rank>
constexpr bool backward_follows_forward() {
  constexpr auto plan = Pipeline<Schedule, P, M>::template static_plan<Rank>();
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const PipeAction& a = plan[i];
    if (!is_compute(a.op)) continue;
    int same = 0;
    for (const PipeAction& b : plan) same += (b.op == a.op && b.microbatch == a.microbatch && b.chunk == a.chunk);
    if (same != 1) return false;
    if (a.op == PipeOp::forward) continue;
    const PipeOp before = a.op == PipeOp::backward_weight ? PipeOp::backward_input : PipeOp::forward;
    bool found = false;
    for (std::size_t j = 0; j < i; ++j)
      found |= plan[j].op == before && plan[j].microbatch == a.microbatch && plan[j].chunk == a.chunk;
    if (!found) return false;
  }
  return true;
}

template <class Schedule, std::size_t P, std::size_t M, int Rank>
constexpr int count(PipeOp op) {
  constexpr auto plan = Pipeline<Schedule, P, M>::template static_plan<Rank>();
  return int(std::count_if(plan.begin(), plan.end(), [op](const PipeAction& a) { return a.op == op; }));
}

}  // namespace

// Sizes and the order of the first steps.
using G = Pipeline<GPipe, 4, 6>;
static_assert(G::static_plan<0>().size() == 6 * 2 + 6 * 2);
static_assert(G::static_plan<0>()[0] == PipeAction{PipeOp::forward, 0, 0, -1});
static_assert(G::static_plan<0>()[1] == PipeAction{PipeOp::send_activation, 0, 0, 1});
static_assert(G::static_plan<2>().size() == 6 * 3 + 6 * 3);  // a middle stage receives and sends both ways
static_assert(count<GPipe, 4, 6, 3>(PipeOp::send_activation) == 0);

using O = Pipeline<OneFOneB, 4, 8>;
static_assert(O::static_plan<3>()[0] == PipeAction{PipeOp::recv_activation, 0, 0, 2});
static_assert(O::static_plan<3>()[2] == PipeAction{PipeOp::backward, 0, 0, -1});  // no warm-up on the last stage
static_assert(O{}.peak_in_flight(0) == 4 && O{}.peak_in_flight(3) == 1);
static_assert(backward_follows_forward<OneFOneB, 4, 8, 0>());
static_assert(backward_follows_forward<OneFOneB, 4, 8, 3>());

using I = Pipeline<Interleaved1F1B<2>, 4, 8>;
static_assert(I::chunks == 2);
static_assert(count<Interleaved1F1B<2>, 4, 8, 1>(PipeOp::forward) == 16);
static_assert(backward_follows_forward<Interleaved1F1B<2>, 4, 8, 0>());
static_assert(backward_follows_forward<Interleaved1F1B<3>, 2, 4, 1>());

using Z = Pipeline<ZeroBubble, 3, 5>;
static_assert(count<ZeroBubble, 3, 5, 0>(PipeOp::backward_input) == 5);
static_assert(count<ZeroBubble, 3, 5, 0>(PipeOp::backward_weight) == 5);
static_assert(count<ZeroBubble, 3, 5, 0>(PipeOp::backward) == 0);
static_assert(backward_follows_forward<ZeroBubble, 3, 5, 0>());
static_assert(backward_follows_forward<ZeroBubble, 3, 5, 2>());

// The analytic bubbles, as constants.
static_assert(G{}.bubble_fraction() == 3.0 / 9.0);
static_assert(O{}.bubble_fraction() == 3.0 / 11.0);
static_assert(I{}.bubble_fraction() == 3.0 / 19.0);
static_assert(Z{}.bubble_fraction() == 2.0 / 17.0);  // (p-1) / (3m + p-1) at unit costs

// Static and dynamic sizes mix, as in Mesh.
static_assert(Pipeline<OneFOneB, 4>::static_stages == 4);
static_assert(Pipeline<OneFOneB, 4>::static_microbatches == dynamic_extent);
static_assert(!std::is_default_constructible_v<Pipeline<OneFOneB, 4>>);
static_assert(std::is_default_constructible_v<O>);

// What counts as a schedule.
static_assert(PipelineSchedule<GPipe> && PipelineSchedule<OneFOneB> && PipelineSchedule<ZeroBubble>);
static_assert(PipelineSchedule<Interleaved1F1B<4>>);
static_assert(!PipelineSchedule<int>);

int main() { return 0; }
