// bench_redistribute: what weft::redistribute costs on top of the Comm
// collective it calls. Each redistribution of a (rows x 1024) float tensor over
// one mesh axis runs against the bare Comm collective on preallocated buffers of
// the same sizes, in the same run, in alternating batches (so a noisy, shared
// machine slows both alike). Reports the median over repetitions.
//
//   mpirun -n 2 ./bench_redistribute [--min-bytes 1048576] [--max-bytes 67108864] [--step 4]
//                                    [--reps 9] [--batch-ms 40] [--check]   (--help lists the flags)
//
// Bytes are the global tensor's. ratio = bare time / weft time (1 = no
// overhead; the target is >= 0.95 for the forms without packing). "into"
// writes into a preallocated destination; "alloc" allocates the result each
// call, as `auto y = redistribute<To>(x, axis)` does. Shard<1> pairs split a
// non-leading dimension: by default each rank reads its peers' blocks straight
// into its result with cross-memory attach (Comm::cross_memory_attach; where
// that is unavailable they stage through the axis' node-shared scratch window
// up to 512 KiB per rank, Comm::node_shared_staging); these rows have the
// target. Their "mpi" rows turn both off and show the MPI path, which packs
// or unpacks blocks around the collective (work the bare call does not do) or
// hands MPI a derived datatype, without a target. The "lay" rows time the
// default path against the bare Comm collective that gives the same strided
// layout (Comm::all_gather / all_to_all with a BlockLayout: MPI derived
// datatypes), without a target. The "shm" rows
// run the same pairs with the input allocated in a weft::NodeShared window,
// so that each rank copies its peers' blocks straight into its result; their
// ratio is against the same bare contiguous collective (same bytes) and has
// the target too. --check makes a missed target the exit status.
#include <weft/weft.hpp>

#include "bench_args.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

using T = float;
// Host memory whatever Kokkos' default memory space is: the node-shared and
// cross-memory transports measured here move host memory, and the "shm" rows'
// input lives in a host window. (With a device default space, DistView would
// put y on the device and the rows would compare different paths.)
using Space = Kokkos::HostSpace;
template <class... Ons>
using HostDist = weft::BasicDistView<T, weft::dextents<2>, Space, Ons...>;
constexpr std::size_t cols = 1024;

struct Options {
  std::size_t min_bytes = std::size_t(1) << 20;
  std::size_t max_bytes = std::size_t(64) << 20;
  std::size_t step = 4;
  int reps = 9;
  double batch_s = 0.040;
  bool check = false;
};

// 0: run; 1: --help was printed; 2: bad flags (said on rank 0).
int parse(int argc, char** argv, bool print, Options& o) {
  double batch_ms = o.batch_s * 1000.0;
  weft::bench::Flags f("bench_redistribute");
  f.add("--min-bytes", o.min_bytes, "smallest global tensor (one row of floats at least)", cols * sizeof(T))
      .add("--max-bytes", o.max_bytes, "largest global tensor", cols * sizeof(T))
      .add("--step", o.step, "factor between sizes", 2)
      .add("--reps", o.reps, "alternating weft,bare batch pairs per row", 1)
      .add("--batch-ms", batch_ms, "length of one timed batch in ms")
      .add_switch("--check", o.check, "a missed target is the exit status");
  if (const int rc = f.parse(argc, argv, print)) return rc;
  o.batch_s = batch_ms / 1000.0;
  if (o.max_bytes < o.min_bytes) {
    if (print)
      std::fprintf(stderr, "bench_redistribute: --max-bytes %zu is below --min-bytes %zu\n", o.max_bytes, o.min_bytes);
    return 2;
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Seconds per call of f over a batch of `iters` calls, the slowest rank's.
double time_batch(weft::Comm& world, int iters, const std::function<void()>& f) {
  MPI_Barrier(world.native());
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) f();
  double t = (MPI_Wtime() - t0) / iters;
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, world.native());
  return t;
}

struct Result {
  double ratio = 0, weft_s = 0, bare_s = 0;
};

// Alternating batches of weft and bare; ratio = median of bare/weft per pair.
Result compare(weft::Comm& world, const Options& o, const std::function<void()>& weft_call,
               const std::function<void()>& bare_call) {
  weft_call();  // warm up: first-touch pages, MPI connections
  bare_call();
  const double once = time_batch(world, 1, bare_call);
  int iters = static_cast<int>(o.batch_s / std::max(once, 1e-6));
  iters = std::max(1, std::min(iters, 1000));
  MPI_Bcast(&iters, 1, MPI_INT, 0, world.native());
  std::vector<double> ratios, tw, tb;
  for (int r = 0; r < o.reps; ++r) {
    const double a = time_batch(world, iters, weft_call);
    const double b = time_batch(world, iters, bare_call);
    ratios.push_back(b / a);
    tw.push_back(a);
    tb.push_back(b);
  }
  return {median(ratios), median(tw), median(tb)};
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& world = env.world();
  Options o;
  if (const int rc = parse(argc, argv, world.rank() == 0, o)) return rc == 1 ? 0 : rc;
  weft::Mesh<weft::TP> mesh(world, world.size());
  auto& tp = mesh.axis<weft::TP>();
  weft::NodeShared shm(mesh);
  const bool root = world.rank() == 0;
  if (root) {
    std::printf("# bench_redistribute: %d ranks, float, (rows x %zu) tensors over axis tp; ratio = bare / weft time\n",
                world.size(), cols);
    std::printf("%-26s %-15s %10s %12s %12s %8s %8s\n", "redistribution", "collective", "bytes", "weft_us", "bare_us",
                "into", "alloc");
  }
  bool missed = false;
  using namespace weft;
  for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.step) {
    const std::size_t rows = bytes / sizeof(T) / cols;
    const std::size_t p = static_cast<std::size_t>(world.size());
    if (rows % p != 0) continue;

    auto row = [&](const char* name, const char* coll, bool target, const std::function<void()>& into,
                   const std::function<void()>& alloc, const std::function<void()>& bare) {
      const Result ri = compare(world, o, into, bare);
      const Result ra = compare(world, o, alloc, bare);
      if (root)
        std::printf("%-26s %-15s %10zu %12.1f %12.1f %8.3f %8.3f%s\n", name, coll, bytes, ri.weft_s * 1e6,
                    ri.bare_s * 1e6, ri.ratio, ra.ratio, target ? "" : "   (no target)");
      if (target && ri.ratio < 0.95) missed = true;
      std::fflush(stdout);
    };

    {  // Shard<0> -> Replicate: all-gather straight into the result.
      HostDist<On<TP, Shard<0>>> x(mesh, rows, cols);
      HostDist<On<TP, Replicate>> y(mesh, rows, cols);
      row("Shard<0> -> Replicate", "all_gather", true, [&] { redistribute<Replicate>(x, TP{}, y); },
          [&] { (void)redistribute<Replicate>(x, TP{}); }, [&] { tp.all_gather(x.local(), y.local()); });
    }
    {  // Partial<Sum> -> Replicate: all-reduce.
      HostDist<On<TP, Partial<Sum>>> x(mesh, rows, cols);
      HostDist<On<TP, Replicate>> y(mesh, rows, cols);
      row("Partial<Sum> -> Replicate", "all_reduce", true, [&] { redistribute<Replicate>(x, TP{}, y); },
          [&] { (void)redistribute<Replicate>(x, TP{}); }, [&] { tp.all_reduce(x.local(), y.local()); });
    }
    {  // Partial<Sum> -> Shard<0>: reduce-scatter.
      HostDist<On<TP, Partial<Sum>>> x(mesh, rows, cols);
      HostDist<On<TP, Shard<0>>> y(mesh, rows, cols);
      row("Partial<Sum> -> Shard<0>", "reduce_scatter", true, [&] { redistribute<Shard<0>>(x, TP{}, y); },
          [&] { (void)redistribute<Shard<0>>(x, TP{}); }, [&] { tp.reduce_scatter(x.local(), y.local()); });
    }
    // The pairs that split a non-leading dimension: by default each rank
    // reads its peers' chunks straight into its result (cross-memory attach,
    // one copy); "mpi" rows turn that and staging off
    // (set_cross_memory_attach, set_node_shared_staging) and show the MPI
    // path (pack kernels below 8 MiB, derived datatypes from 8 MiB on).
    for (const bool staged : {true, false}) {
      tp.set_cross_memory_attach(staged);
      tp.set_node_shared_staging(staged);
      {  // Shard<1> -> Shard<0>: all-to-all, chunks along dim 0 are contiguous, received ones concatenate along dim 1.
        HostDist<On<TP, Shard<1>>> x(mesh, rows, cols);
        HostDist<On<TP, Shard<0>>> y(mesh, rows, cols);
        row(staged ? "Shard<1> -> Shard<0>" : "Shard<1> -> Shard<0> mpi", "all_to_all", staged,
            [&] { redistribute<Shard<0>>(x, TP{}, y); }, [&] { (void)redistribute<Shard<0>>(x, TP{}); },
            [&] { tp.all_to_all(x.local(), y.local()); });
      }
      {  // Shard<1> -> Replicate: all-gather of column blocks.
        HostDist<On<TP, Shard<1>>> x(mesh, rows, cols);
        HostDist<On<TP, Replicate>> y(mesh, rows, cols);
        row(staged ? "Shard<1> -> Replicate" : "Shard<1> -> Replicate mpi", "all_gather", staged,
            [&] { redistribute<Replicate>(x, TP{}, y); }, [&] { (void)redistribute<Replicate>(x, TP{}); },
            [&] { tp.all_gather(x.local(), y.local()); });
      }
    }
    {  // The same pairs against the bare Comm collective that gives the same
       // layout: MPI places the blocks itself (BlockLayout, derived datatypes).
      using Flat = Kokkos::View<T*, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
      auto flat = [](auto v) { return Flat(v.data(), v.size()); };
      {
        HostDist<On<TP, Shard<1>>> x(mesh, rows, cols);
        HostDist<On<TP, Shard<0>>> y(mesh, rows, cols);
        const BlockLayout recv{rows / p, cols / p, cols};
        row("Shard<1> -> Shard<0> lay", "all_to_all", false, [&] { redistribute<Shard<0>>(x, TP{}, y); },
            [&] { (void)redistribute<Shard<0>>(x, TP{}); },
            [&] { tp.all_to_all(flat(x.local()), BlockLayout{}, flat(y.local()), recv); });
      }
      {
        HostDist<On<TP, Shard<1>>> x(mesh, rows, cols);
        HostDist<On<TP, Replicate>> y(mesh, rows, cols);
        const BlockLayout recv{rows, cols / p, cols};
        row("Shard<1> -> Replicate lay", "all_gather", false, [&] { redistribute<Replicate>(x, TP{}, y); },
            [&] { (void)redistribute<Replicate>(x, TP{}); },
            [&] { tp.all_gather(flat(x.local()), flat(y.local()), recv); });
      }
    }
    tp.set_cross_memory_attach(true);
    tp.set_node_shared_staging(true);
    using Host2 = BasicDistView<T, dextents<2>, Space, On<TP, Shard<1>>>;
    {  // The same pairs from node-shared memory: one copy per peer block, no MPI transfer.
      auto x = shm.dist_view<Host2>(mesh, rows, cols);
      HostDist<On<TP, Shard<0>>> y(mesh, rows, cols);
      HostDist<On<TP, Shard<1>>> bare_x(mesh, rows, cols);
      row("Shard<1> -> Shard<0> shm", "all_to_all", true, [&] { redistribute<Shard<0>>(x, TP{}, y); },
          [&] { (void)redistribute<Shard<0>>(x, TP{}); }, [&] { tp.all_to_all(bare_x.local(), y.local()); });
    }
    {
      auto x = shm.dist_view<Host2>(mesh, rows, cols);
      HostDist<On<TP, Replicate>> y(mesh, rows, cols);
      HostDist<On<TP, Shard<1>>> bare_x(mesh, rows, cols);
      row("Shard<1> -> Replicate shm", "all_gather", true, [&] { redistribute<Replicate>(x, TP{}, y); },
          [&] { (void)redistribute<Replicate>(x, TP{}); }, [&] { tp.all_gather(bare_x.local(), y.local()); });
    }
  }
  if (root && o.check) std::printf(missed ? "# target missed\n" : "# every target met\n");
  return (o.check && missed) ? 1 : 0;
}
