// Checkpoint save and load bandwidth against plain write()/read() of the same
// bytes in the same run. Every rank holds its row shard of --tensors float32
// tensors of --params parameters in all (the split a tensor-parallel model
// has); the checkpoint writes them as .npy chunks with crc32 and a manifest,
// the baseline writes each rank's bytes to one file with a single write()
// (fsync'd alike with --durable 1) and reads them back with one pread() into
// a buffer touched beforehand, as the loaded pieces are. Both sides read from
// the page cache, or with --cold 1 both from the disk (their files flushed
// and dropped from the cache before each read); the two go first in turn.
// Each repetition times load() twice: with the default
// Verify::before_writing, then with Verify::while_reading (one pass: a chunk
// its verifier reads whole is checked as it is read into its piece). The
// first verifies every chunk's crc32 before it writes into any piece, so it
// reads every byte twice: a verifying pass from where the bytes are, then a
// copy into the pieces from the page cache. What that costs is measured on
// the baseline's file in the same run: the verifying pass alone (256 KiB
// preads through one buffer + crc32, as load() does), a read of the cached
// file (the copy), and the crc32 of the bytes in memory. Two bounds follow
// for any load that verifies first: plain / (verifying pass + copy), with
// the pass as load() does it, and the least such a load could cost,
// plain / (plain + copy) from the disk (the crc32 hidden behind the disk)
// or plain / (plain + crc32 in memory) from the cache.
// Ranges and medians leave out the first repetition, which is shown apart.
//
//   mpirun -n 2 bench_checkpoint --params 100000000 --reps 3 [--durable 0] [--cold 1]
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <weft/checkpoint/checkpoint.hpp>
#include <weft/comm/environment.hpp>

#include "bench_args.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The slowest rank's time of f (a barrier before, the maximum after).
template <class F>
double timed(F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now();
  f();
  double t = now() - t0, worst = 0;
  MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

// Flushes a file and drops its pages from the page cache (--cold).
void drop_from_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void drop_dir_from_cache(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') drop_from_cache(dir + "/" + e->d_name);
    ::closedir(d);
  }
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  std::size_t params = 100000000, tensors = 48, reps = 3, durable = 1, cold = 0;
  std::string dir = "/tmp/weft_bench_checkpoint";
  weft::bench::Flags flags("bench_checkpoint");
  flags.add("--params", params, "parameters in all (float32)", 1)
      .add("--tensors", tensors, "tensors they are split into", 1)
      .add("--reps", reps, "repetitions (each, the best, and ranges and medians without the first are reported)", 1)
      .add("--durable", durable, "1: fsync files (checkpoint and baseline alike); 0: page cache only")
      .add("--cold", cold, "1: read both sides from the disk (flushed and dropped from the page cache first); 0: from the cache")
      .add("--dir", dir, "scratch directory (removed at the end)");
  const int rc = flags.parse(argc, argv, env.world().rank() == 0);
  if (rc) return rc == 1 ? 0 : rc;
  const int rank = env.world().rank(), size = env.world().size();
  // Each tensor: rows divisible by the ranks, 1024 columns.
  const std::size_t cols = 1024, rows = std::max<std::size_t>(std::size_t(size), (params / tensors / cols) / std::size_t(size) * std::size_t(size));
  const std::size_t local_rows = rows / std::size_t(size), local = local_rows * cols;
  weft::checkpoint::State<float, Space> state, target;
  std::vector<Kokkos::View<float*, Space>> data, back;
  for (std::size_t t = 0; t < tensors; ++t) {
    weft::plan::LocalLayout l{rows, cols, local_rows, cols, {{std::size_t(rank) * local_rows, 0, local_rows, cols, 0}}};
    data.emplace_back("w", local);
    back.emplace_back("w.back", local);
    auto d = data.back();  // the kernel captures the view, not the host vector
    Kokkos::parallel_for(
        "fill", Kokkos::RangePolicy<Space>(0, local),
        KOKKOS_LAMBDA(std::size_t i) { d(i) = float((i * 2654435761u + t) % 1000003) * 1e-3f; });
    // The targets hold other values, different in every page (as a freshly
    // initialised model's do), written before anything is timed.
    auto b = back.back();
    Kokkos::parallel_for(
        "fill.back", Kokkos::RangePolicy<Space>(0, local), KOKKOS_LAMBDA(std::size_t i) { b(i) = -float(i + t * local + std::size_t(rank) * tensors * local); });
    state.add("t" + std::to_string(t), l, 0, data.back());
    target.add("t" + std::to_string(t), l, 0, back.back());
  }
  Kokkos::fence();
  const std::size_t my_bytes = tensors * local * sizeof(float), total = my_bytes * std::size_t(size);
  if (rank == 0) {
    ::mkdir(dir.c_str(), 0755);
    std::printf("bench_checkpoint: %d ranks, %zu tensors of %zu x %zu float32 = %zu parameters, %.1f MB per rank; durable %zu, cold %zu\n",
                size, tensors, rows, cols, tensors * rows * cols, double(my_bytes) / 1e6, durable, cold);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // The baseline's bytes: this rank's shards back to back in one host buffer.
  std::vector<float> plain(tensors * local);
  for (std::size_t t = 0; t < tensors; ++t) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), data[t]);
    std::copy(h.data(), h.data() + local, plain.data() + t * local);
  }
  std::vector<float> plain_back(plain.size());
  for (std::size_t i = 0; i < plain_back.size(); ++i) plain_back[i] = -float(i + std::size_t(rank) * plain_back.size());
  const std::string plain_file = dir + "/plain." + std::to_string(rank);
  double best[5] = {1e30, 1e30, 1e30, 1e30, 1e30};
  // Per repetition: save ratio, load ratio, and the two bounds of a verifying load.
  std::vector<double> save_ratio, load_ratio, fused_ratio, bound_pass, bound_crc;
  auto plain_write = [&] {
    const int fd = ::open(plain_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    weft::checkpoint::detail::write_all(fd, reinterpret_cast<const char*>(plain.data()), my_bytes, plain_file);
    if (durable) ::fsync(fd);
    ::close(fd);
  };
  auto plain_read = [&] {
    const int fd = ::open(plain_file.c_str(), O_RDONLY);
    weft::checkpoint::detail::pread_all(fd, reinterpret_cast<char*>(plain_back.data()), my_bytes, 0, plain_file);
    ::close(fd);
  };
  // The verifying pass alone over the baseline's file, as load() reads a chunk.
  std::vector<char> block(std::size_t(256) << 10);
  std::uint32_t sink = 0;
  auto plain_verify = [&] {
    const int fd = ::open(plain_file.c_str(), O_RDONLY);
    std::uint32_t crc = 0;
    for (std::size_t done = 0; done < my_bytes;) {
      const std::size_t n = std::min(block.size(), my_bytes - done);
      weft::checkpoint::detail::pread_all(fd, block.data(), n, done, plain_file);
      crc = weft::checkpoint::crc32(block.data(), n, crc);
      done += n;
    }
    ::close(fd);
    sink ^= crc;
  };
  auto crc_in_memory = [&] { sink ^= weft::checkpoint::crc32(plain_back.data(), my_bytes); };
  std::string ckpt_dir;  // the latest save's directory
  for (std::size_t r = 0; r < reps; ++r) {
    double t[8];
    // Even repetitions run the baseline first, odd ones the checkpoint.
    auto save = [&] {
      t[1] = timed([&] {
        ckpt_dir = weft::checkpoint::save(dir + "/ckpt", r, state, weft::metrics::Json::object(), MPI_COMM_WORLD,
                                          {.keep = 1, .durable = durable != 0})
                       .path;
      });
    };
    auto load = [&] {
      if (cold && rank == 0) drop_dir_from_cache(ckpt_dir);
      t[3] = timed([&] { weft::checkpoint::load(dir + "/ckpt", target, MPI_COMM_WORLD); });
      // The same load verifying each chunk as it is read into its piece (one pass).
      if (cold && rank == 0) drop_dir_from_cache(ckpt_dir);
      t[7] = timed([&] {
        weft::checkpoint::load(dir + "/ckpt", target, MPI_COMM_WORLD, {.verify = weft::checkpoint::Verify::while_reading});
      });
    };
    auto read = [&] {
      if (cold) drop_from_cache(plain_file);
      t[2] = timed(plain_read);
    };
    if (r % 2 == 0) {
      t[0] = timed(plain_write);
      save();
      read();
      load();
    } else {
      save();
      t[0] = timed(plain_write);
      load();
      read();
    }
    // The verifying pass over the same bytes, from the same place (the disk with --cold 1).
    if (cold) drop_from_cache(plain_file);
    t[4] = timed(plain_verify);
    t[5] = timed(crc_in_memory);
    t[6] = timed(plain_read);  // cached now
    const double least = cold ? t[6] : t[5];
    for (int i = 0; i < 4; ++i) best[i] = std::min(best[i], t[i]);
    best[4] = std::min(best[4], t[7]);
    save_ratio.push_back(t[0] / t[1]);
    load_ratio.push_back(t[2] / t[3]);
    fused_ratio.push_back(t[2] / t[7]);
    bound_pass.push_back(t[2] / (t[4] + t[6]));
    bound_crc.push_back(t[2] / (t[2] + least));
    if (rank == 0)
      std::printf("rep %zu (%s first): write plain %.3f s, save %.3f s (ratio %.2f); read plain %.3f s, load %.3f s (ratio %.2f), "
                  "load verifying while reading %.3f s (ratio %.2f); "
                  "verifying pass %.3f s, cached read %.3f s, crc32 in memory %.3f s (bounds %.2f, %.2f)\n",
                  r, r % 2 ? "checkpoint" : "plain", t[0], t[1], t[0] / t[1], t[2], t[3], t[2] / t[3], t[7], t[2] / t[7], t[4],
                  t[6], t[5], bound_pass.back(), bound_crc.back());
  }
  // The loaded values must be the saved ones.
  std::size_t wrong = 0;
  for (std::size_t t = 0; t < tensors; ++t) {
    auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), data[t]);
    auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back[t]);
    for (std::size_t i = 0; i < local; ++i) wrong += a(i) != b(i);
  }
  std::size_t wrong_all = 0;
  MPI_Allreduce(&wrong, &wrong_all, 1, MPI_UNSIGNED_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    const double gb = double(total) / 1e9;
    std::printf("write: plain %.3f s (%.2f GB/s), checkpoint save %.3f s (%.2f GB/s): ratio %.2f\n", best[0], gb / best[0],
                best[1], gb / best[1], best[0] / best[1]);
    std::printf("read:  plain %.3f s (%.2f GB/s), checkpoint load %.3f s (%.2f GB/s): ratio %.2f\n", best[2], gb / best[2],
                best[3], gb / best[3], best[2] / best[3]);
    std::printf("read:  plain %.3f s (%.2f GB/s), load verifying while reading %.3f s (%.2f GB/s): ratio %.2f\n", best[2],
                gb / best[2], best[4], gb / best[4], best[2] / best[4]);
    auto summary = [&](const char* what, std::vector<double> v) {
      const double first = v.front();
      v.erase(v.begin());
      if (v.empty()) {
        std::printf("%s: repetition 0 %.2f\n", what, first);
        return;
      }
      std::sort(v.begin(), v.end());
      const std::size_t m = v.size();
      const double median = m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
      std::printf("%s: repetitions 1-%zu %.2f-%.2f, median %.2f (repetition 0: %.2f)\n", what, m, v.front(), v.back(), median, first);
    };
    summary("ratio save", save_ratio);
    summary("ratio load (verify first)", load_ratio);
    summary("ratio load (verify while reading)", fused_ratio);
    summary("bound of a load that verifies first, its pass as load() reads", bound_pass);
    summary(cold ? "bound of a load that verifies first, the crc32 hidden behind the disk"
                 : "bound of a load that verifies first, the crc32 from memory",
            bound_crc);
    std::printf("best of %zu; bandwidth = all ranks' tensor bytes / the slowest rank's time; %zu values differ after load\n",
                reps, wrong_all);
    weft::checkpoint::detail::remove_tree(dir);
  }
  if (sink == 0x12345678u) std::printf("(crc %u)\n", sink);  // keeps the timed crc32 from being optimised away
  return wrong_all ? 1 : 0;
}
