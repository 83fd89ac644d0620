// bench_collectives: what weft::Comm costs on top of MPI. Each collective runs
// on Kokkos views through weft and as the raw MPI call on the same buffers and
// communicator, in the same run, in batches ordered weft, raw, raw, weft, each
// after a memcpy batch that resets the cache to the same state (so a
// noisy, shared machine and cache effects of the order hit both alike); a memcpy of the same size, also interleaved, is the
// physical limit of one node. Reports the median over repetitions.
//
//   mpirun -n 2 ./bench_collectives [--min-bytes 4096] [--max-bytes 67108864] [--step 2]
//                                   [--reps 11] [--batch-ms 10] [--check]
//
// Bytes follow nccl-tests' "size" (the full buffer a rank holds; see
// weft/comm/stats.hpp) and bandwidth is size / time. weft/raw is the median
// over repetitions of the ratio within one weft-raw-raw-weft group (a group
// sees the same machine load); the bandwidths are medians too. Targets: weft/raw >= 0.95
// at >= 1 MiB for every collective; weft's extra cost per call < 2 us for
// 8-byte messages. A last section measures the default mode's bounded wait
// against the same calls with the bound off (Comm::set_deadline(0)), paired
// and with a same-against-same control (--paired-reps groups per size):
// targets <= 2 % at >= 1 MiB and <= 0.5 us per call at 8 bytes. --check
// makes a missed target the exit status.
#include <weft/weft.hpp>

#include "bench_args.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

using T = float;
using Buf = Kokkos::View<T*, Kokkos::HostSpace>;

struct Options {
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = std::size_t(64) << 20;
  std::size_t step = 2;
  int reps = 11;
  double batch_s = 0.010;
  int overhead_reps = 9;
  int overhead_iters = 5000;
  int paired_reps = 101;
  bool bounded_only = false;
  bool check = false;
};

// 0: run; 1: --help was printed; 2: bad flags (said on rank 0).
int parse(int argc, char** argv, bool print, Options& o) {
  double batch_ms = o.batch_s * 1000.0;
  weft::bench::Flags f("bench_collectives");
  f.add("--min-bytes", o.min_bytes, "smallest size", 8)
      .add("--max-bytes", o.max_bytes, "largest size", 8)
      .add("--step", o.step, "factor between sizes", 2)
      .add("--reps", o.reps, "groups of weft,raw,raw,weft batches per size", 1)
      .add("--batch-ms", batch_ms, "length of one timed batch in ms", 0.001)
      .add("--overhead-reps", o.overhead_reps, "groups for the 8-byte per-call cost", 1)
      .add("--overhead-iters", o.overhead_iters, "calls per 8-byte batch", 1)
      .add("--paired-reps", o.paired_reps, "paired groups per size of the bounded wait's cost", 1)
      .add_switch("--bounded-only", o.bounded_only, "measure only the bounded wait against the unbounded path")
      .add_switch("--check", o.check, "also check every result");
  if (const int rc = f.parse(argc, argv, print)) return rc;
  o.batch_s = batch_ms / 1000.0;
  if (o.max_bytes < o.min_bytes) {
    if (print) std::fprintf(stderr, "bench_collectives: --max-bytes %zu is below --min-bytes %zu\n", o.max_bytes, o.min_bytes);
    return 2;
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A median with its 95 % confidence interval.
struct Interval {
  double median, lo, hi;
};
// Distribution-free: the interval between the order statistics whose ranks
// are n/2 -+ 0.98 sqrt(n) (the binomial(n, 1/2) bounds of the median).
Interval median_interval(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const double n = static_cast<double>(v.size());
  const double half = 0.98 * std::sqrt(n);
  const auto at = [&](double rank) {  // rank: 1-based, clamped to the sample
    const auto i = static_cast<std::size_t>(std::clamp(rank, 1.0, n)) - 1;
    return v[i];
  };
  return {median(v), at(std::floor(n / 2 - half)), at(std::ceil(n / 2 + 1 + half))};
}

// Timing runs on its own communicator, never mixed with the measured traffic.
MPI_Comm g_sync = MPI_COMM_NULL;

// Seconds per call of f over `iters` calls, the slowest rank's. One untimed
// call first, so that each batch starts from its own buffers in cache rather
// than from whatever the previous batch left there.
template <class F>
double batch(F&& f, int iters) {
  f();
  MPI_Barrier(g_sync);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) f();
  double t = (MPI_Wtime() - t0) / iters, slowest = 0;
  MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, g_sync);
  return slowest;
}

// Seconds of one call of f, the slowest rank's (after a barrier: every rank starts together).
template <class F>
double one_call(F&& f) {
  MPI_Barrier(g_sync);
  const double t0 = MPI_Wtime();
  f();
  double t = MPI_Wtime() - t0, slowest = 0;
  MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, g_sync);
  return slowest;
}

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    std::fprintf(stderr, "bench_collectives: %s failed (%d)\n", what, rc);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// One collective at one size: the weft call and the raw MPI call it stands for.
struct Case {
  std::function<void()> weft, raw;
  bool valid = true;  // false when the size does not split into the ranks' blocks
};

// The six collectives, each as a factory of a Case for `bytes` (nccl-tests' size).
struct Suite {
  weft::Comm& c;
  Buf a, b;  // every collective reads a and writes b (broadcast: a only)
  int p, me;

  template <class V>
  static auto head(const V& v, std::size_t n) {
    return Kokkos::subview(v, std::make_pair(std::size_t(0), n));
  }

  Case make(const std::string& kind, std::size_t bytes) {
    const std::size_t e = bytes / sizeof(T);
    const auto pp = static_cast<std::size_t>(p);
    const MPI_Comm m = c.native();
    const MPI_Datatype dt = MPI_FLOAT;
    T* ap = a.data();
    T* bp = b.data();
    if (kind == "all_reduce") {
      auto s = head(a, e), r = head(b, e);
      const int n = static_cast<int>(e);
      return {[=, this] { c.all_reduce(s, r); },
              [=] { mpi_check(MPI_Allreduce(ap, bp, n, dt, MPI_SUM, m), "MPI_Allreduce"); }};
    }
    if (kind == "all_gather") {  // size: the gathered output
      if (e % pp) return {{}, {}, false};
      auto s = head(a, e / pp), r = head(b, e);
      const int n = static_cast<int>(e / pp);
      return {[=, this] { c.all_gather(s, r); },
              [=] { mpi_check(MPI_Allgather(ap, n, dt, bp, n, dt, m), "MPI_Allgather"); }};
    }
    if (kind == "reduce_scatter") {  // size: the full input
      if (e % pp) return {{}, {}, false};
      auto s = head(a, e), r = head(b, e / pp);
      const int n = static_cast<int>(e / pp);
      return {[=, this] { c.reduce_scatter(s, r); },
              [=] { mpi_check(MPI_Reduce_scatter_block(ap, bp, n, dt, MPI_SUM, m), "MPI_Reduce_scatter_block"); }};
    }
    if (kind == "all_to_all") {  // size: the send buffer
      if (e % pp) return {{}, {}, false};
      auto s = head(a, e), r = head(b, e);
      const int n = static_cast<int>(e / pp);
      return {[=, this] { c.all_to_all(s, r); },
              [=] { mpi_check(MPI_Alltoall(ap, n, dt, bp, n, dt, m), "MPI_Alltoall"); }};
    }
    if (kind == "broadcast") {
      auto s = head(a, e);
      const int n = static_cast<int>(e);
      return {[=, this] { c.broadcast(s, 0); },
              [=] { mpi_check(MPI_Bcast(ap, n, dt, 0, m), "MPI_Bcast"); }};
    }
    // sendrecv around the ring; size: the message
    auto s = head(a, e), r = head(b, e);
    const int n = static_cast<int>(e);
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    return {[=, this] { c.sendrecv(s, next, r, prev); },
            [=] {
              mpi_check(MPI_Sendrecv(ap, n, dt, next, 0, bp, n, dt, prev, 0, m, MPI_STATUS_IGNORE), "MPI_Sendrecv");
            }};
  }
};

std::string human(std::size_t bytes) {
  char s[32];
  if (bytes >= (std::size_t(1) << 20)) std::snprintf(s, sizeof s, "%zu MiB", bytes >> 20);
  else if (bytes >= 1024) std::snprintf(s, sizeof s, "%zu KiB", bytes >> 10);
  else std::snprintf(s, sizeof s, "%zu B", bytes);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  weft::Comm& world = env.world();
  const int me = world.rank(), p = world.size();
  Options o;
  if (const int rc = parse(argc, argv, me == 0, o)) return rc == 1 ? 0 : rc;
  MPI_Comm_dup(MPI_COMM_WORLD, &g_sync);

  // Buffers for the largest size, touched before any timing.
  const std::size_t max_e = o.max_bytes / sizeof(T);
  Buf a("a", max_e), b("b", max_e);
  Kokkos::deep_copy(a, T(1));
  Kokkos::deep_copy(b, T(0));
  std::vector<char> src(o.max_bytes, 1), dst(o.max_bytes, 0);
  Suite suite{world, a, b, p, me};

  const char* kinds[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv"};
  if (me == 0) {
    std::printf("weft %s bench_collectives: %d ranks, float elements, host memory (Kokkos %s); "
                "median of %d repetitions of weft,raw,raw,weft batches\n",
                weft::version_string, p, Kokkos::DefaultHostExecutionSpace::name(), o.reps);
    double load[3] = {0, 0, 0};
    if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
      if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = load[1] = load[2] = 0;
      std::fclose(f);
    }
    std::printf("machine load average at start: %.2f %.2f %.2f (other processes share the cores)\n", load[0],
                load[1], load[2]);
    std::printf("bytes = nccl-tests 'size' (all_gather: output, reduce_scatter: input, all_to_all: send buffer); "
                "GB/s = bytes / time / 1e9\n\n");
    if (!o.bounded_only)
      std::printf("%-15s %9s %10s %10s %9s %12s %12s %11s\n", "collective", "bytes", "weft GB/s", "raw GB/s",
                  "weft/raw", "memcpy GB/s", "weft/memcpy", "raw/memcpy");
  }

  struct Worst {
    double ratio = 1e300;
    std::size_t at = 0;
  };
  std::vector<Worst> worst(std::size(kinds));
  for (std::size_t k = 0; k < std::size(kinds) && !o.bounded_only; ++k) {
    for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.step) {
      Case cs = suite.make(kinds[k], bytes);
      if (!cs.valid) continue;
      auto copy = [&] {
        std::memcpy(dst.data(), src.data(), bytes);
        asm volatile("" ::: "memory");  // the copy must happen every time
      };
      // Warm up both paths, then size a batch to about batch_s (all ranks agree).
      cs.weft();
      cs.raw();
      const double once = batch(cs.raw, 1);
      const int iters = std::clamp(static_cast<int>(o.batch_s / std::max(once, 1e-9)), 1, 100000);
      const int copy_iters = std::clamp(static_cast<int>(o.batch_s / std::max(batch(copy, 1), 1e-9)), 1, 100000);
      std::vector<double> tw, tr, tc, ratios;
      for (int r = 0; r < o.reps; ++r) {
        // weft, raw, raw, weft, each batch preceded by a memcpy batch: every
        // batch starts from the same cache state (the copy's buffers, not the
        // collective's), and whatever favours a position in the sequence
        // favours both paths alike.
        double c[4];
        c[0] = batch(copy, copy_iters);
        const double w1 = batch(cs.weft, iters);
        c[1] = batch(copy, copy_iters);
        const double r1 = batch(cs.raw, iters);
        c[2] = batch(copy, copy_iters);
        const double r2 = batch(cs.raw, iters);
        c[3] = batch(copy, copy_iters);
        const double w2 = batch(cs.weft, iters);
        tw.push_back(0.5 * (w1 + w2));
        tr.push_back(0.5 * (r1 + r2));
        ratios.push_back((r1 + r2) / (w1 + w2));
        tc.push_back(median({c[0], c[1], c[2], c[3]}));
      }
      const double w = median(tw), raw = median(tr), cp = median(tc);
      const double bw_w = bytes / w / 1e9, bw_r = bytes / raw / 1e9, bw_c = bytes / cp / 1e9;
      const double ratio = median(ratios);
      if (bytes >= (std::size_t(1) << 20) && ratio < worst[k].ratio) worst[k] = {ratio, bytes};
      if (me == 0)
        std::printf("%-15s %9s %10.3f %10.3f %9.3f %12.3f %12.3f %11.3f\n", kinds[k], human(bytes).c_str(), bw_w,
                    bw_r, ratio, bw_c, bw_w / bw_c, bw_r / bw_c);
    }
    if (me == 0) std::printf("\n");
  }

  // Per-call overhead: 8-byte messages (all_reduce/broadcast/sendrecv: the
  // buffer; all_gather, all_to_all: each rank's block; reduce_scatter: the result).
  if (me == 0 && !o.bounded_only)
    std::printf("per-call cost at 8-byte messages, median of %d repetitions of weft,raw,raw,weft batches of %d calls\n"
                "%-15s %10s %10s %14s\n",
                o.overhead_reps, o.overhead_iters, "collective", "weft us", "raw us", "weft-raw us");
  std::vector<double> overhead(std::size(kinds));
  for (std::size_t k = 0; k < std::size(kinds) && !o.bounded_only; ++k) {
    const std::string kind = kinds[k];
    const std::size_t per_block = 8;
    const std::size_t bytes = (kind == "all_gather" || kind == "reduce_scatter" || kind == "all_to_all")
                                  ? per_block * static_cast<std::size_t>(p)
                                  : per_block;
    Case cs = suite.make(kind, std::min(bytes, o.max_bytes));
    for (int i = 0; i < 100; ++i) {
      cs.weft();
      cs.raw();
    }
    std::vector<double> tw, tr, diff;
    for (int r = 0; r < o.overhead_reps; ++r) {
      const double w1 = batch(cs.weft, o.overhead_iters), r1 = batch(cs.raw, o.overhead_iters);
      const double r2 = batch(cs.raw, o.overhead_iters), w2 = batch(cs.weft, o.overhead_iters);
      const double w = 0.5 * (w1 + w2), raw = 0.5 * (r1 + r2);
      tw.push_back(w);
      tr.push_back(raw);
      diff.push_back(w - raw);
    }
    overhead[k] = median(diff) * 1e6;
    if (me == 0)
      std::printf("%-15s %10.3f %10.3f %14.3f\n", kinds[k], median(tw) * 1e6, median(tr) * 1e6, overhead[k]);
  }

  // The bounded wait of the default mode (weft/comm/watchdog.hpp) against the
  // same weft calls on a communicator whose waits are not bounded
  // (Comm::set_deadline(0)), paired: each repetition is one group of eight
  // calls in the roles B U U B U B B U (bounded, unbounded; each role takes
  // every position in a half once, so a position's own bias cancels), and
  // its ratio (or difference) compares calls made within moments of each
  // other, so slow drifts of the machine's load cancel too. At >= 1 MiB each call is timed alone (a barrier before it:
  // such calls take 100 us and more); at 8 bytes each member of a group is a
  // batch of --overhead-iters calls. The same groups with the unbounded call
  // in both roles are the control: their spread is the benchmark's own noise
  // floor. Reported: the median over repetitions and its 95 % confidence
  // interval (order statistics of the median, no assumption on the noise).
  weft::Comm unbounded_comm = weft::Comm::duplicate(MPI_COMM_WORLD, "world");
  unbounded_comm.set_deadline(0);
  Suite unbounded{unbounded_comm, a, b, p, me};
  if (me == 0)
    std::printf("\nbounded wait (deadline %g s) against the unbounded path, paired: %d groups of B,U,U,B,U,B,B,U "
                "(>= 1 MiB: single calls; 8 bytes: batches of %d calls), and the same groups with the "
                "unbounded call in both roles (control); median [95 %% confidence interval]\n%-15s %9s %12s %12s %28s %28s\n",
                world.deadline(), o.paired_reps, o.overhead_iters, "collective", "bytes", "bounded us", "unbounded us",
                "bounded/unbounded", "control (same/same)");
  auto verdict = [](const Interval& i, double target) {
    return i.hi <= target ? "confirmed" : i.lo > target ? "REFUTED" : "not resolved";
  };
  struct Bound {
    Interval ratio{0, 0, 0};  // the highest median at >= 1 MiB, with its interval
    std::size_t at = 0;
    int confirmed = 0, refuted = 0, sizes = 0;  // verdicts at >= 1 MiB
    Interval cost{0, 0, 0};  // us per call at 8 bytes
  };
  std::vector<Bound> bound(std::size(kinds));
  for (std::size_t k = 0; k < std::size(kinds); ++k) {
    const std::string kind = kinds[k];
    const std::size_t small = (kind == "all_gather" || kind == "reduce_scatter" || kind == "all_to_all")
                                  ? 8 * static_cast<std::size_t>(p)
                                  : 8;
    std::vector<std::size_t> sizes{std::min(small, o.max_bytes)};
    for (std::size_t bytes = std::max(std::size_t(1) << 20, o.min_bytes); bytes <= o.max_bytes; bytes *= 4)
      sizes.push_back(bytes);
    for (const std::size_t bytes : sizes) {
      Case on = suite.make(kind, bytes), off = unbounded.make(kind, bytes);
      if (!on.valid) continue;
      const bool is_small = bytes == sizes.front();
      for (int i = 0; i < (is_small ? 100 : 3); ++i) {
        on.weft();
        off.weft();
      }
      auto time = [&](const std::function<void()>& f) { return is_small ? batch(f, o.overhead_iters) : one_call(f); };
      // Roles by position in a group: B U U B U B B U, so that each role
      // holds every position once per pair of halves (the first call of a
      // group may be slower than the others, and that must not count).
      static constexpr bool role_b[8] = {true, false, false, true, false, true, true, false};
      std::vector<double> tb, tu, test, control;
      for (int r = 0; r < o.paired_reps; ++r) {
        double sb = 0, su = 0, cb = 0, cu = 0;
        for (int i = 0; i < 8; ++i) (role_b[i] ? sb : su) += time(role_b[i] ? on.weft : off.weft);
        for (int i = 0; i < 8; ++i) (role_b[i] ? cb : cu) += time(off.weft);
        tb.push_back(sb / 4);
        tu.push_back(su / 4);
        if (is_small) {
          test.push_back((sb - su) / 4 * 1e6);
          control.push_back((cb - cu) / 4 * 1e6);
        } else {
          test.push_back(sb / su);
          control.push_back(cb / cu);
        }
      }
      const Interval t = median_interval(test), c = median_interval(control);
      if (is_small) {
        bound[k].cost = t;
      } else {
        if (bound[k].at == 0 || t.median > bound[k].ratio.median) bound[k].ratio = t, bound[k].at = bytes;
        ++bound[k].sizes;
        bound[k].confirmed += t.hi <= 1.02;
        bound[k].refuted += t.lo > 1.02;
      }
      if (me == 0) {
        const char* f = is_small ? "%+8.3f us [%+.3f, %+.3f]" : "%8.4f [%.4f, %.4f]";
        char tt[64], ct[64];
        std::snprintf(tt, sizeof tt, f, t.median, t.lo, t.hi);
        std::snprintf(ct, sizeof ct, f, c.median, c.lo, c.hi);
        std::printf("%-15s %9s %12.3f %12.3f %28s %28s  %s\n", kinds[k], human(bytes).c_str(), median(tb) * 1e6,
                    median(tu) * 1e6, tt, ct, verdict(t, is_small ? 0.5 : 1.02));
      }
    }
  }

  // Verdict against the targets.
  bool ok = true;
  if (me == 0 && !o.bounded_only) std::printf("\ntargets: weft/raw >= 0.95 at >= 1 MiB, overhead < 2 us at 8 bytes\n");
  for (std::size_t k = 0; k < std::size(kinds) && !o.bounded_only; ++k) {
    const bool bw_ok = worst[k].at == 0 || worst[k].ratio >= 0.95;
    const bool lat_ok = overhead[k] < 2.0;
    ok = ok && bw_ok && lat_ok;
    if (me == 0) {
      if (worst[k].at)
        std::printf("%-15s lowest weft/raw at >= 1 MiB: %.3f (at %s) %s;  overhead %.3f us %s\n", kinds[k],
                    worst[k].ratio, human(worst[k].at).c_str(), bw_ok ? "ok" : "MISSED", overhead[k],
                    lat_ok ? "ok" : "MISSED");
      else
        std::printf("%-15s (no size >= 1 MiB measured);  overhead %.3f us %s\n", kinds[k], overhead[k],
                    lat_ok ? "ok" : "MISSED");
    }
  }
  // What the bound adds to a call, without MPI's noise: the mark of one wait
  // (weft::detail::WaitScope, with the watchdog running) timed on its own.
  {
    const std::string axis = "world";
    const std::vector<int> ranks(static_cast<std::size_t>(p), 0);
    std::vector<double> per;
    for (int r = 0; r < o.reps; ++r) {
      const int n = 1000000;
      const double t0 = MPI_Wtime();
      for (int i = 0; i < n; ++i) {
        weft::detail::WaitScope mark("all_reduce", axis, ranks, 60.0);
        asm volatile("" ::: "memory");
      }
      per.push_back((MPI_Wtime() - t0) / n);
    }
    if (me == 0)
      std::printf("the mark of one bounded wait alone (no MPI call): %.1f ns per call, median of %d batches of 10^6\n",
                  median(per) * 1e9, o.reps);
  }
  if (me == 0)
    std::printf("\ntargets of the bounded wait: bounded/unbounded <= 1.02 at >= 1 MiB, cost <= 0.5 us at 8 bytes "
                "(confirmed: the whole 95 %% interval is within the target; refuted: the whole interval is beyond it)\n");
  for (std::size_t k = 0; k < std::size(kinds); ++k) {
    const Bound& bk = bound[k];
    ok = ok && bk.refuted == 0 && bk.cost.lo <= 0.5;
    if (me == 0) {
      if (bk.at)
        std::printf("%-15s at >= 1 MiB: %d of %d sizes confirmed, %d refuted (highest median %.4f [%.4f, %.4f] at %s);  ",
                    kinds[k], bk.confirmed, bk.sizes, bk.refuted, bk.ratio.median, bk.ratio.lo, bk.ratio.hi,
                    human(bk.at).c_str());
      else
        std::printf("%-15s (no size >= 1 MiB measured);  ", kinds[k]);
      std::printf("cost at 8 bytes %+.3f us [%+.3f, %+.3f] %s\n", bk.cost.median, bk.cost.lo, bk.cost.hi,
                  verdict(bk.cost, 0.5));
    }
  }
  MPI_Comm_free(&g_sync);
  return (o.check && !ok) ? 1 : 0;
}
