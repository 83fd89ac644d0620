// What the planner assumes about a machine, measured on it: the core's FMA
// peak, the gemm rate weft reaches, the memory each rank may use, the read
// bandwidth of one core, and MPI's bandwidth and latency inside a host and
// across hosts. `weft-plan --calibrate FILE` runs calibrate() on every rank
// of its launch and writes the result as a topology file that `weft-plan
// --topology FILE` reads (docs/plan.md, "Calibration").
//
//   mpirun -n 4 weft-plan --calibrate machine.json     // 2 hosts x 2 ranks: both links measured
//   weft-plan --model m.json --gpus 4 --topology machine.json
//
// Not in weft/weft.hpp: a program that calibrates includes it itself.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include <weft/comm/node.hpp>
#include <weft/core/error.hpp>
#include <weft/core/measure.hpp>
#include <weft/metrics/json.hpp>
#include <weft/metrics/peak.hpp>
#include <weft/ops/gemm.hpp>
#include <weft/plan/meshes.hpp>

namespace weft::plan {

/// How long calibrate() measures. The defaults take about 1 s at 2 to 4
/// ranks on one host, and 2 s across a 1 Gbit/s link.
struct CalibrateOptions {
  std::size_t gemm_size = 1024;              ///< the float gemm's m = n = k
  int gemm_reps = 7;                         ///< timed gemms (after one warm-up); the median counts
  std::size_t stream_bytes = 128u << 20;     ///< the array each rank reads
  int stream_reps = 5;                       ///< timed reads (after one warm-up); the median counts
  std::size_t message_bytes = 4u << 20;      ///< the bandwidth's message
  int bandwidth_round_trips = 10;            ///< timed round trips of it (after one warm-up); the best counts
  int latency_round_trips = 1000;            ///< round trips of 8 bytes; the mean counts
};

/// The figures calibrate() measured. Every rank of the launch returns the
/// same values (rank 0's links; the slowest rank's compute and memory).
struct Calibration {
  int ranks = 0;                 ///< ranks of the communicator
  int hosts = 0;                 ///< distinct nodes among them (weft's node split)
  int ranks_per_host = 0;        ///< ranks on rank 0's node
  std::string host;              ///< this rank's node name (rank 0's in the file weft-plan writes)
  double fma_gflops = 0;         ///< one core's fp32 FMA peak (metrics::measure_core_peak, by CPU time), lowest over the ranks
  const char* fma_isa = "";      ///< the instructions the probe used
  double gemm_gflops = 0;        ///< float gemm [n x n] x [n x n] through ops::gemm, all ranks at once, median wall time, lowest over the ranks
  double stream_read_gbs = 0;    ///< one thread summing a float array, all ranks at once, median wall time, lowest over the ranks (GB = 1e9 bytes)
  double memory_gb = 0;          ///< MemAvailable of rank 0's node / its ranks (1e9 bytes)
  double intra_bw_gbs = 0, intra_latency_us = 0;  ///< rank 0 and the next rank on its node
  double inter_bw_gbs = 0, inter_latency_us = 0;  ///< rank 0 and the first rank on another node
  bool intra_measured = false;   ///< false: rank 0 shares its node with no rank (intra_* are inter_*'s, or 0)
  bool inter_measured = false;   ///< false: one node (inter_* are intra_*'s)

  /// The planner's view: one device per rank, ranks_per_host devices per
  /// node, peak_tflops the FMA peak, compute_efficiency gemm / FMA (at most
  /// 1), the links as measured (an unmeasured one takes the other's
  /// figures), memory_gb as measured and the default headroom.
  Topology topology(const std::string& name) const {
    Topology t;
    t.name = name;
    t.gpus_per_node = std::size_t(std::max(1, ranks_per_host));
    t.memory_gb = memory_gb;
    t.peak_tflops = fma_gflops / 1e3;
    t.compute_efficiency = std::min(1.0, gemm_gflops / fma_gflops);
    t.intra_bw_gbs = intra_bw_gbs;
    t.intra_latency_us = intra_latency_us;
    t.inter_bw_gbs = inter_bw_gbs;
    t.inter_latency_us = inter_latency_us;
    return t;
  }

  /// The topology file: topology()'s fields (topology_from_json reads them)
  /// and a "calibration" object with the measured figures and what was
  /// measured (the planner does not read it).
  metrics::Json json(const std::string& name) const {
    const Topology t = topology(name);
    using metrics::Json;
    return Json::object()
        .set("name", t.name)
        .set("gpus_per_node", t.gpus_per_node)
        .set("memory_gb", t.memory_gb)
        .set("peak_tflops", t.peak_tflops)
        .set("compute_efficiency", t.compute_efficiency)
        .set("intra_bw_gbs", t.intra_bw_gbs)
        .set("intra_latency_us", t.intra_latency_us)
        .set("inter_bw_gbs", t.inter_bw_gbs)
        .set("inter_latency_us", t.inter_latency_us)
        .set("headroom_fraction", t.headroom_fraction)
        .set("calibration", Json::object()
                                .set("ranks", ranks)
                                .set("hosts", hosts)
                                .set("ranks_per_host", ranks_per_host)
                                .set("host", host)
                                .set("fma_gflops", fma_gflops)
                                .set("fma_isa", std::string(fma_isa))
                                .set("gemm_gflops", gemm_gflops)
                                .set("stream_read_gbs", stream_read_gbs)
                                .set("intra_measured", intra_measured)
                                .set("inter_measured", inter_measured)
                                .set("note", "one device per rank; peak_tflops: fma_gflops (one core's fp32 FMA "
                                             "peak by CPU time, times the rank's BLAS threads); compute_efficiency: "
                                             "gemm_gflops / fma_gflops, the gemm timed with every rank computing at "
                                             "once (median wall time); links: ping-pong of "
                                             "rank 0 with the next rank on its node (intra) and the first rank "
                                             "on another node (inter), bandwidth = message bytes / half the best "
                                             "round trip, latency = half the mean round trip of 8 bytes; an "
                                             "unmeasured link takes the other's figures"));
  }
};

namespace detail {

/// Times `reps` runs of `work()` after one warm-up, every rank of `comm` at
/// once: a barrier before each run, so that ranks sharing a core (more ranks
/// than cores, or two hosts on one machine) run side by side as they do in
/// a step. Returns the median wall time of a run.
template <class Work>
double concurrent_median_seconds(MPI_Comm comm, int reps, Work&& work) {
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    MPI_Barrier(comm);
    const auto t0 = std::chrono::steady_clock::now();
    work();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) t.push_back(dt);  // r == 0: the warm-up (first touch, the provider's set-up)
  }
  return ::weft::median_of(t);
}

/// A sum of every element of `a`, 16 at a time (the loop a compiler vectorises).
inline float sum_stream(const std::vector<float>& a) {
  float s[16] = {};
  for (std::size_t i = 0; i + 16 <= a.size(); i += 16)
    for (int j = 0; j < 16; ++j) s[j] += a[i + j];
  float t = 0;
  for (float x : s) t += x;
  return t;
}

/// Ping-pong of `comm`'s ranks a and b (every rank calls it; the others
/// only wait at the barriers): {bandwidth in bytes/s, latency in s}.
inline std::pair<double, double> ping_pong(MPI_Comm comm, int a, int b, const CalibrateOptions& o) {
  int me = 0;
  MPI_Comm_rank(comm, &me);
  std::vector<char> buf(std::max<std::size_t>(o.message_bytes, 8));
  double bw = 0, lat = 0;
  auto round_trip = [&](int bytes) {
    if (me == a) {
      MPI_Send(buf.data(), bytes, MPI_BYTE, b, 0, comm);
      MPI_Recv(buf.data(), bytes, MPI_BYTE, b, 0, comm, MPI_STATUS_IGNORE);
    } else if (me == b) {
      MPI_Recv(buf.data(), bytes, MPI_BYTE, a, 0, comm, MPI_STATUS_IGNORE);
      MPI_Send(buf.data(), bytes, MPI_BYTE, a, 0, comm);
    }
  };
  MPI_Barrier(comm);
  if (me == a || me == b) {
    const int big = int(std::min<std::size_t>(buf.size(), std::size_t(1) << 30));
    double best = 1e30;
    for (int r = 0; r <= o.bandwidth_round_trips; ++r) {
      const double t0 = MPI_Wtime();
      round_trip(big);
      if (r > 0) best = std::min(best, MPI_Wtime() - t0);
    }
    bw = double(big) / (best / 2);
    for (int r = 0; r < 10; ++r) round_trip(8);
    const double t0 = MPI_Wtime();
    for (int r = 0; r < o.latency_round_trips; ++r) round_trip(8);
    lat = (MPI_Wtime() - t0) / (2.0 * std::max(1, o.latency_round_trips));
  }
  MPI_Barrier(comm);
  return {bw, lat};
}

}  // namespace detail

/// Measures this machine as the planner sees it. Collective over `comm`
/// (every rank must call it, at the same time): each rank probes its core's
/// FMA peak (by CPU time: what a core can do), then times its float gemm
/// (ops::gemm, so Kokkos must be initialised) and a one-thread read of an
/// array, every rank at once with a barrier before each run, by the median
/// wall time (what a rank gets while the others compute: ranks that share
/// a core show it here); the lowest of each over the ranks is kept. Rank 0
/// reads MemAvailable of its node and divides it by its node's ranks, and
/// ping-pongs with the next rank of its node
/// (intra) and with the lowest rank of another node (inter). Nodes are
/// weft's node split (detail::split_by_node, so WEFT_TEST_RANKS_PER_NODE
/// simulates them). Every rank returns rank 0's figures (its own `host`).
/// Throws ConfigError when a size or count in `o` is zero or `comm` has one
/// rank (no link to measure), CommError when the node split fails.
inline Calibration calibrate(MPI_Comm comm, const CalibrateOptions& o = {}) {
  WEFT_REQUIRE(o.gemm_size > 0 && o.gemm_reps > 0 && o.stream_bytes > 0 && o.stream_reps > 0 && o.message_bytes > 0 &&
                   o.bandwidth_round_trips > 0 && o.latency_round_trips > 0,
               ConfigError, "weft::plan::calibrate: every size and count of CalibrateOptions must be positive");
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  WEFT_REQUIRE(size >= 2, ConfigError, "weft::plan::calibrate: one rank has no link to measure; launch at least 2 "
               "ranks (2 on each of 2 hosts measure both links: mpirun -n 4 with 2 slots per host)");
  MPI_Comm node = MPI_COMM_NULL;
  if (::weft::detail::split_by_node(comm, rank, &node) != MPI_SUCCESS)
    throw CommError("calibrate", "world", "weft::plan::calibrate: MPI_Comm_split_type failed");
  int node_rank = 0, node_size = 1;
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_size(node, &node_size);
  // Each node's leader (its lowest rank) names the node; the others give -1.
  std::vector<int> leader_of(std::size_t(size), -1);
  {
    int my_leader = rank;
    MPI_Allreduce(MPI_IN_PLACE, &my_leader, 1, MPI_INT, MPI_MIN, node);
    MPI_Allgather(&my_leader, 1, MPI_INT, leader_of.data(), 1, MPI_INT, comm);
  }
  MPI_Comm_free(&node);
  Calibration c;
  c.ranks = size;
  for (int r = 0; r < size; ++r) c.hosts += leader_of[std::size_t(r)] == r ? 1 : 0;
  int intra_peer = -1, inter_peer = -1;
  for (int r = 1; r < size; ++r) {
    if (leader_of[std::size_t(r)] == leader_of[0] && intra_peer < 0) intra_peer = r;
    if (leader_of[std::size_t(r)] != leader_of[0] && inter_peer < 0) inter_peer = r;
  }
  for (int r = 0; r < size; ++r) c.ranks_per_host += leader_of[std::size_t(r)] == leader_of[0] ? 1 : 0;
  c.host = ::weft::detail::node_name();

  // Compute and memory, every rank at once; the slowest rank's figures.
  const metrics::CorePeak peak = metrics::measure_core_peak();
  double gemm = 0, read = 0;
  {
    const std::size_t n = o.gemm_size;
    ops::Matrix<float> A("calibrate.A", n, n), B("calibrate.B", n, n), C("calibrate.C", n, n);
    Kokkos::deep_copy(A, 0.5f);
    Kokkos::deep_copy(B, 0.25f);
    const double s = detail::concurrent_median_seconds(comm, o.gemm_reps, [&] {
      ops::gemm(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 0.0f, C);
      Kokkos::fence();
    });
    gemm = 2.0 * double(n) * double(n) * double(n) / s;
  }
  {
    const std::vector<float> a(std::max<std::size_t>(o.stream_bytes / sizeof(float), 16), 1.0f);
    volatile float sink = 0;
    const double s = detail::concurrent_median_seconds(comm, o.stream_reps, [&] { sink = sink + detail::sum_stream(a); });
    read = double(a.size() * sizeof(float)) / s;
  }
  double mine[3] = {peak.fp32, gemm, read}, low[3] = {0, 0, 0};
  MPI_Allreduce(mine, low, 3, MPI_DOUBLE, MPI_MIN, comm);
  c.fma_gflops = low[0] / 1e9;
  c.fma_isa = peak.fp32_isa;
  c.gemm_gflops = low[1] / 1e9;
  c.stream_read_gbs = low[2] / 1e9;

  // The links, one pair at a time, the other ranks waiting.
  double links[5] = {0, 0, 0, 0, 0};  // intra bw, intra latency, inter bw, inter latency, memory
  if (intra_peer >= 0) {
    const auto [bw, lat] = detail::ping_pong(comm, 0, intra_peer, o);
    links[0] = bw;
    links[1] = lat;
  }
  if (inter_peer >= 0) {
    const auto [bw, lat] = detail::ping_pong(comm, 0, inter_peer, o);
    links[2] = bw;
    links[3] = lat;
  }
  links[4] = mem_available_bytes().value_or(0) / double(std::max(1, c.ranks_per_host));
  MPI_Bcast(links, 5, MPI_DOUBLE, 0, comm);
  c.intra_measured = intra_peer >= 0;
  c.inter_measured = inter_peer >= 0;
  c.intra_bw_gbs = links[0] / 1e9;
  c.intra_latency_us = links[1] * 1e6;
  c.inter_bw_gbs = links[2] / 1e9;
  c.inter_latency_us = links[3] * 1e6;
  if (!c.inter_measured) {
    c.inter_bw_gbs = c.intra_bw_gbs;
    c.inter_latency_us = c.intra_latency_us;
  }
  if (!c.intra_measured) {
    c.intra_bw_gbs = c.inter_bw_gbs;
    c.intra_latency_us = c.inter_latency_us;
  }
  c.memory_gb = links[4] / 1e9;
  return c;
}

}  // namespace weft::plan
