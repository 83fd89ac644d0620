// Distributed checkpoints that reshard: every rank writes the chunks of
// global tensors it owns (a replicated chunk once, by the holder with the
// fewest bytes so far) as .npy files, rank 0 adds a JSON manifest and renames
// the directory into place; loading onto any mesh reads, on each rank, the
// byte ranges of the chunks that intersect what it owns (weft/plan/read_plan.hpp),
// verifies checksums and agrees on errors before anything is touched.
// Format and tensor names: docs/checkpoint.md.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <mpi.h>

#include <weft/checkpoint/npy.hpp>
#include <weft/comm/request.hpp>
#include <weft/comm/watchdog.hpp>
#include <weft/core/error.hpp>
#include <weft/metrics/json.hpp>
#include <weft/nn/parameter.hpp>
#include <weft/plan/json_read.hpp>
#include <weft/plan/read_plan.hpp>

namespace weft::checkpoint {

/// One piece of this rank's storage in a checkpoint: elements [offset,
/// offset + data.extent(0)) of this rank's part (`layout`) of the global
/// tensor `tensor`.
template <class T, class Space>
struct Piece {
  std::string tensor;
  plan::LocalLayout layout;
  std::size_t offset = 0;
  Kokkos::View<T*, Space> data;
};

/// Where a parameter's storage on this rank lies in the global tensor.
template <class T, class Space>
plan::LocalLayout layout_of(const nn::Parameter<T, Space>& p) {
  plan::LocalLayout l{p.global_rows(), p.global_cols(), p.rows(), p.cols(), {}};
  for (const auto& b : p.global_bands()) l.bands.push_back({b.row0, b.col0, b.rows, b.cols, b.local_col0});
  return l;
}

/// What a rank saves and loads: a list of pieces of global tensors. The
/// same tensor may have pieces on several ranks (split or replicated); a
/// replicated piece is written once.
template <class T, class Space>
class State {
  static_assert(std::is_same_v<T, float>, "weft::checkpoint::State: checkpoints hold float32 tensors ('<f4' .npy)");

 public:
  /// Adds elements [offset, offset + data.extent(0)) of this rank's part
  /// `layout` of tensor `tensor`.
  void add(std::string tensor, plan::LocalLayout layout, std::size_t offset, Kokkos::View<T*, Space> data) {
    WEFT_REQUIRE(offset + data.extent(0) <= layout.local_rows * layout.local_cols, ConfigError, "checkpoint::State: piece [",
                 offset, ", ", offset + data.extent(0), ") of '", tensor, "' lies outside its local ", layout.local_rows,
                 " x ", layout.local_cols, " part");
    pieces_.push_back({std::move(tensor), std::move(layout), offset, data});
  }
  /// The pieces, in the order they were added.
  const std::vector<Piece<T, Space>>& pieces() const { return pieces_; }

 private:
  std::vector<Piece<T, Space>> pieces_;
};

/// How save() works.
struct SaveOptions {
  /// Keep the newest `keep` complete checkpoints under the root and delete
  /// older ones (0: keep all).
  std::size_t keep = 0;
  /// Flush the chunk files, the manifest and the directory before the rename
  /// (an fdatasync of each once all are written, issued from several threads
  /// at once), and the root after it (off: faster, but a power loss may
  /// leave a renamed checkpoint incomplete).
  bool durable = true;
};

/// What save() did.
struct SaveStats {
  std::string path;           ///< the checkpoint's directory
  double seconds = 0;         ///< wall time of the save (every rank's, then the rename)
  std::size_t bytes = 0;      ///< tensor bytes this rank wrote
  std::size_t total_bytes = 0;  ///< tensor bytes of the checkpoint (all ranks)
};

/// When load() checks a chunk's CRC-32 against the bytes it writes into the pieces.
enum class Verify {
  /// Every chunk is verified in a pass of its own before any piece is
  /// written: a damaged checkpoint leaves the state as it was. Verified
  /// chunks are read twice (once for the check, once into the pieces).
  before_writing,
  /// A chunk that its verifier reads whole into one piece is checked as it
  /// is read into that piece, in one pass (the other chunks as with
  /// before_writing). A damaged chunk still raises the same IoError on every
  /// rank, but its bytes may already be in the pieces (a host piece, or the
  /// host mirror of a device piece, which is then not copied to the device):
  /// for callers that discard the state, or load another checkpoint into
  /// it, when a load fails -- a resume at the start of a run.
  while_reading
};

/// How load() works.
struct LoadOptions {
  /// When the CRC-32 of each chunk is checked (see Verify).
  Verify verify = Verify::before_writing;
  /// Tensors of the checkpoint whose name ends with one of these are left
  /// out entirely: not required, not read, not verified (serve_gpt loads the
  /// weights of a train_gpt checkpoint and has no use for the optimizer's
  /// ".adam_m", ".adam_v" or ".momentum"). Every other tensor of the
  /// checkpoint must still be one the state asks for.
  std::vector<std::string> ignore_suffixes = {};
};

/// What load() did.
struct LoadStats {
  std::string path;             ///< the checkpoint's directory
  plan::JsonValue manifest;     ///< the parsed manifest (its "run" object holds the caller's metadata)
  std::size_t step = 0;         ///< the manifest's step
  double seconds = 0;           ///< wall time of the load (verification included)
  std::size_t bytes = 0;        ///< bytes this rank read (chunk data, whole chunks it verified included)
  std::size_t total_bytes = 0;  ///< the same summed over the ranks
};

/// The directory name of the checkpoint of `step` under a root.
inline std::string step_dir_name(std::size_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08zu", step);
  return b;
}

namespace detail {

inline bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// Complete checkpoints under root: (step, directory), oldest first.
inline std::vector<std::pair<std::size_t, std::string>> complete_checkpoints(const std::string& root) {
  std::vector<std::pair<std::size_t, std::string>> out;
  DIR* d = ::opendir(root.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() != 13 || n.rfind("step-", 0) != 0) continue;
    if (n.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    if (!exists(root + "/" + n + "/manifest.json")) continue;
    out.emplace_back(std::stoull(n.substr(5)), root + "/" + n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

inline void remove_tree(const std::string& p) {
  DIR* d = ::opendir(p.c_str());
  if (!d) {
    ::unlink(p.c_str());
    return;
  }
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    const std::string c = p + "/" + n;
    struct stat st;
    if (::lstat(c.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(c);
    else ::unlink(c.c_str());
  }
  ::closedir(d);
  ::rmdir(p.c_str());
}

// fsync of a directory (or file), so that a rename into it survives a power
// loss. Throws IoError when it cannot be opened or synchronised (EINVAL, a
// file system that cannot synchronise a directory at all, is accepted).
inline void fsync_path(const std::string& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  WEFT_REQUIRE(fd >= 0, IoError, "checkpoint: cannot open ", p, " to flush it: ", std::strerror(errno));
  const bool ok = ::fsync(fd) == 0 || errno == EINVAL;
  const int e = errno;
  ::close(fd);
  WEFT_REQUIRE(ok, IoError, "checkpoint: flushing ", p, " failed: ", std::strerror(e),
               "; the checkpoint is renamed into place but may not survive a power loss");
}

// Runs `work` (which takes its items from a shared counter and must not
// throw) on this thread and up to threads - 1 more, at most one per item.
template <class F>
void run_threads(std::size_t threads, std::size_t items, F&& work) {
  std::vector<std::thread> pool;
  const std::size_t n = std::min(threads, items);
  try {
    for (std::size_t t = 1; t < n; ++t) pool.emplace_back(work);
  } catch (const std::system_error&) {  // no more threads: the ones started and this one do the rest
  }
  work();
  for (auto& t : pool) t.join();
}

// fdatasync of every file in `files` ((path, what) pairs), from up to
// `threads` threads at once. After the first has committed the journal,
// each further one mostly waits for a flush of the device's cache (on this
// machine's virtual disk about 10 ms apiece: 48 files per rank, one after
// the other, took 1.2 s); issued together, the block layer merges the
// flushes that wait at the same time (docs/checkpoint.md). Throws IoError
// naming the first file that failed.
inline void flush_files(const std::vector<std::pair<std::string, std::string>>& files, std::size_t threads) {
  std::atomic<std::size_t> next{0};
  std::vector<std::string> errors(files.size());
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < files.size();) {
      const int fd = ::open(files[i].first.c_str(), O_RDONLY);
      // EINVAL: a file (a directory, on some file systems) that cannot be synchronised at all.
      const bool ok = fd >= 0 && (::fdatasync(fd) == 0 || errno == EINVAL);
      const int e = errno;
      if (fd >= 0) ::close(fd);
      if (!ok) errors[i] = "checkpoint: flushing " + files[i].second + " failed: " + std::strerror(e);
    }
  };
  run_threads(threads, files.size(), work);
  for (const auto& e : errors) WEFT_REQUIRE(e.empty(), IoError, e);
}

// The checksum of a manifest's own content (`manifest_crc32`): zlib's CRC-32
// of a canonical text of what a load trusts -- "step=N;world_size=W;" and,
// per tensor in the manifest's order, "name|dtype|rows|cols|" and per chunk
// "file|row|col|rows|cols|byte_offset|bytes|crc32|" (integers in decimal) --
// so that an edited step, shape or chunk is found like a corrupted chunk.
// Fields that do not have the expected form contribute "?" (the load's own
// checks name them).
inline std::uint32_t manifest_digest(const plan::JsonValue& m) {
  using K = plan::JsonValue::Kind;
  std::string text;
  auto put = [&](const plan::JsonValue* v) {
    if (v && v->kind == K::number) {
      char b[40];
      std::snprintf(b, sizeof b, "%.17g", v->number);
      text += b;
    } else if (v && v->kind == K::string) {
      text += v->string;
    } else {
      text += '?';
    }
    text += '|';
  };
  auto pair = [&](const plan::JsonValue* v) {
    for (std::size_t i = 0; i < 2; ++i) put(v && v->kind == K::array && v->array.size() == 2 ? &v->array[i] : nullptr);
  };
  text += "step=";
  put(m.find("step"));
  text += "world_size=";
  put(m.find("world_size"));
  if (const plan::JsonValue* ts = m.find("tensors"); ts && ts->kind == K::array)
    for (const auto& t : ts->array) {
      put(t.find("name"));
      put(t.find("dtype"));
      pair(t.find("shape"));
      if (const plan::JsonValue* cs = t.find("chunks"); cs && cs->kind == K::array)
        for (const auto& c : cs->array) {
          put(c.find("file"));
          pair(c.find("offset"));
          pair(c.find("shape"));
          put(c.find("byte_offset"));
          put(c.find("bytes"));
          put(c.find("crc32"));
        }
    }
  return crc32(text.data(), text.size());
}

// What the waits of the save or load running on this thread are part of:
// the text the deadline message prints ("during the checkpoint save at step
// 4"), the communicator's ranks in MPI_COMM_WORLD (for the watchdog's report
// of who did not arrive) and the deadline (WEFT_DEADLINE, 60 s by default).
struct WaitContext {
  std::string during;
  std::string axis = "checkpoint";
  std::vector<int> world_ranks;
  double deadline_s = 0;
};
inline WaitContext*& wait_context() {
  static thread_local WaitContext* current = nullptr;
  return current;
}

// Rank r of `comm` is world rank out[r].
inline std::vector<int> world_ranks_of(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  std::vector<int> mine(static_cast<std::size_t>(size)), out(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) mine[std::size_t(r)] = r;
  MPI_Group g = MPI_GROUP_NULL, w = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &w);
  MPI_Group_translate_ranks(g, size, mine.data(), w, out.data());
  MPI_Group_free(&g);
  MPI_Group_free(&w);
  return out;
}

// Sets the WaitContext of one save() or load() for its duration (nested
// phases restore the outer one).
class Phase {
 public:
  Phase(MPI_Comm comm, std::string during) : outer_(wait_context()) {
    ctx_.during = std::move(during);
    ctx_.world_ranks = world_ranks_of(comm);
    ctx_.deadline_s = weft::detail::checked_defaults().deadline_s;
    wait_context() = &ctx_;
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;
  ~Phase() { wait_context() = outer_; }

 private:
  WaitContext ctx_;
  WaitContext* outer_;
};

// Marks one blocking MPI call or file-system flush of a save or load for
// the watchdog of weft's default mode (weft/comm/watchdog.hpp), exactly as
// Comm marks its collectives: past the deadline the job ends on every rank,
// and the one rank elected on each node prints which rank did not arrive
// (stopped, dead, or busy elsewhere) and "during the checkpoint save at step
// N". Outside a Phase the wait is shown but not bounded.
inline weft::detail::WaitScope bounded(const char* op) {
  static const std::string none = "checkpoint";
  static const std::vector<int> no_ranks;
  const WaitContext* c = wait_context();
  if (c == nullptr) return weft::detail::WaitScope(op, none, no_ranks, 0);
  return weft::detail::WaitScope(op, c->axis, c->world_ranks, c->deadline_s, c->during.empty() ? nullptr : c->during.c_str());
}

// Removes the complete checkpoint `dir` with every rank of `comm` unlinking
// a share of its files (freeing their pages and blocks is what costs), then
// rank 0 the directory. Collective; errors are ignored (retention is best
// effort: a checkpoint left behind is complete and harmless).
inline void remove_checkpoint(const std::string& dir, MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..") && std::strcmp(e->d_name, "manifest.json"))
        names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  if (rank == 0) ::unlink((dir + "/manifest.json").c_str());  // first: it is no longer a complete checkpoint
  {
    auto wait = bounded("barrier");
    MPI_Barrier(comm);
  }
  for (std::size_t i = std::size_t(rank); i < names.size(); i += std::size_t(size)) ::unlink((dir + "/" + names[i]).c_str());
  {
    auto wait = bounded("barrier");
    MPI_Barrier(comm);
  }
  if (rank == 0) remove_tree(dir);
}

// Every rank passes its error (empty: none); when any rank has one, every
// rank throws the lowest such rank's message. Collective, so no rank is left
// waiting for a peer that failed.
inline void agree(MPI_Comm comm, const std::string& error) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  int mine = error.empty() ? size : rank, first = size;
  {
    auto wait = bounded("all_reduce");
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  }
  if (first == size) return;
  int len = rank == first ? int(error.size()) : 0;
  std::string msg;
  {
    auto wait = bounded("broadcast");
    MPI_Bcast(&len, 1, MPI_INT, first, comm);
    msg.assign(std::size_t(len), '\0');
    if (rank == first) msg = error;
    MPI_Bcast(msg.data(), len, MPI_CHAR, first, comm);
  }
  throw IoError(msg);
}

// Runs f, turning a weft::Error into its message (empty: success).
template <class F>
std::string capture(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

// Every rank's string, in rank order.
inline std::vector<std::string> all_gather_strings(MPI_Comm comm, const std::string& mine) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  int len = int(mine.size());
  std::vector<int> lens(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  {
    auto wait = bounded("all_gather");
    MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm);
  }
  int total = 0;
  for (int r = 0; r < size; ++r) {
    displs[std::size_t(r)] = total;
    total += lens[std::size_t(r)];
  }
  std::string all(std::size_t(total), '\0');
  {
    auto wait = bounded("all_gather");
    MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, comm);
  }
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.push_back(all.substr(std::size_t(displs[std::size_t(r)]), std::size_t(lens[std::size_t(r)])));
  return out;
}

// A chunk key: tensor and box, with the tensor's global shape.
struct ChunkKey {
  std::string tensor;
  plan::Box box;
  std::size_t rows = 0, cols = 0;  // the tensor's global shape
  bool operator<(const ChunkKey& o) const {
    return std::tie(tensor, box.row0, box.col0, box.rows, box.cols) <
           std::tie(o.tensor, o.box.row0, o.box.col0, o.box.rows, o.box.cols);
  }
};

inline void write_all(int fd, const char* p, std::size_t n, const std::string& what) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    WEFT_REQUIRE(w > 0, IoError, "checkpoint: writing ", what, " failed: ", std::strerror(errno));
    p += w;
    n -= std::size_t(w);
  }
}

inline void pread_all(int fd, char* p, std::size_t n, std::size_t off, const std::string& what) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, off_t(off));
    if (r < 0 && errno == EINTR) continue;
    WEFT_REQUIRE(r > 0, IoError, "checkpoint: reading ", what, " failed: ", r == 0 ? "the file ends early" : std::strerror(errno));
    p += r;
    n -= std::size_t(r);
    off += std::size_t(r);
  }
}

inline std::size_t as_size(const plan::JsonValue* v, const std::string& what) {
  WEFT_REQUIRE(v && v->kind == plan::JsonValue::Kind::number && v->number >= 0 && v->number == double(std::size_t(v->number)),
               IoError, what, ": expected a non-negative integer");
  return std::size_t(v->number);
}

// A tensor as the manifest lists it.
struct ManifestTensor {
  std::size_t rows = 0, cols = 0;
  std::vector<plan::SavedChunk> chunks;
  std::vector<std::uint32_t> crcs;
  std::vector<std::size_t> ids;  // global chunk ids (manifest order)
};

}  // namespace detail

/// The checkpoint directory `path` names: `path` itself when it holds a
/// manifest.json, else the complete checkpoint of the highest step under it.
/// Throws IoError when there is none.
inline std::string resolve(const std::string& path) {
  if (detail::exists(path + "/manifest.json")) return path;
  const auto all = detail::complete_checkpoints(path);
  WEFT_REQUIRE(!all.empty(), IoError, "checkpoint: ", path, " holds no complete checkpoint (neither a manifest.json nor a ",
               "step-NNNNNNNN directory with one); give the directory of --checkpoint or of one checkpoint");
  return all.back().second;
}

/// Saves `state` as the checkpoint of `step` under `root` (created if
/// needed) with `run` (any JSON object: mesh, strategy, data position, ...)
/// in its manifest. Collective over `comm`. The files go to
/// root/.tmp-step-N first; only when every rank has written its chunks and
/// the manifest is complete is it renamed to root/step-N, so a crash leaves
/// the previous checkpoints intact. Then the oldest beyond options.keep are
/// deleted.
template <class T, class Space>
SaveStats save(const std::string& root, std::size_t step, const State<T, Space>& state, const metrics::Json& run,
               MPI_Comm comm, SaveOptions options = {}) {
  using detail::ChunkKey;
  const auto t0 = std::chrono::steady_clock::now();
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const std::string name = step_dir_name(step), tmp = root + "/.tmp-" + name, final_dir = root + "/" + name;
  // Every wait below is bounded by the deadline and named as part of this save.
  const detail::Phase phase(comm, "during the checkpoint save at step " + std::to_string(step));

  // 1. This rank's chunks: the rectangles of each piece.
  struct Local {
    ChunkKey key;
    std::size_t piece;
    plan::Segment seg;
  };
  std::vector<Local> local;
  std::string desc;
  for (std::size_t i = 0; i < state.pieces().size(); ++i) {
    const auto& p = state.pieces()[i];
    for (const auto& s : plan::segments_of(p.layout, p.offset, p.data.extent(0))) {
      local.push_back({ChunkKey{p.tensor, s.global, p.layout.global_rows, p.layout.global_cols}, i, s});
      desc += p.tensor + '\n' + std::to_string(s.global.row0) + ' ' + std::to_string(s.global.col0) + ' ' +
              std::to_string(s.global.rows) + ' ' + std::to_string(s.global.cols) + ' ' + std::to_string(p.layout.global_rows) +
              ' ' + std::to_string(p.layout.global_cols) + '\n';
    }
  }
  // 2. Everyone's chunks; each distinct one gets the holder with the fewest bytes so far.
  std::map<ChunkKey, std::vector<int>> holders;
  {
    const auto all = detail::all_gather_strings(comm, desc);
    for (int r = 0; r < size; ++r) {
      std::istringstream in(all[std::size_t(r)]);
      std::string tensor;
      while (std::getline(in, tensor)) {
        ChunkKey k;
        k.tensor = tensor;
        in >> k.box.row0 >> k.box.col0 >> k.box.rows >> k.box.cols >> k.rows >> k.cols;
        in.ignore(1);
        auto& h = holders[k];
        if (h.empty() || h.back() != r) h.push_back(r);
      }
    }
  }
  std::vector<std::size_t> load(std::size_t(size), 0);
  std::map<ChunkKey, std::pair<int, std::string>> writer;  // chunk -> (rank, file)
  std::map<std::string, std::size_t> per_tensor_count, per_tensor_area;
  std::string problem;
  for (const auto& [k, h] : holders) {
    int best = h.front();
    for (int r : h)
      if (load[std::size_t(r)] < load[std::size_t(best)]) best = r;
    load[std::size_t(best)] += k.box.size() * sizeof(T);
    const std::size_t idx = per_tensor_count[k.tensor]++;
    writer[k] = {best, k.tensor + "." + std::to_string(idx) + ".npy"};
    per_tensor_area[k.tensor] += k.box.size();
  }
  // Every element of every tensor exactly once: distinct chunks must not overlap.
  {
    std::map<std::string, std::vector<plan::Box>> boxes;
    std::map<std::string, std::size_t> global;
    for (const auto& [k, h] : holders) {
      boxes[k.tensor].push_back(k.box);
      global[k.tensor] = k.rows * k.cols;
    }
    for (const auto& [t, area] : per_tensor_area)
      if (area != global[t] && problem.empty())
        problem = "checkpoint: the ranks' pieces of tensor '" + t + "' cover " + std::to_string(area) + " elements, not its " +
                  std::to_string(global[t]) + " (pieces overlap or are missing); nothing was saved";
  }
  WEFT_REQUIRE(problem.empty(), IoError, problem);

  // 3. A fresh temporary directory (rank 0), then every rank writes its chunks.
  // A save that fails from here to the rename (a full disk, a write error
  // on any rank: every rank throws the same IoError) removes what it left
  // half-written, the temporary directory, and says so; the earlier
  // checkpoints are untouched. (A rank that dies leaves it to the next save.)
  auto agree_or_clean_up = [&](const std::string& error) {
    try {
      detail::agree(comm, error);
    } catch (const IoError& e) {
      if (rank == 0) detail::remove_tree(tmp);
      throw IoError(std::string(e.what()) + "; the unfinished " + tmp + " is removed, the earlier checkpoints under " +
                    root + " are as they were");
    }
  };
  std::string err;
  if (rank == 0)
    err = detail::capture([&] {
      ::mkdir(root.c_str(), 0755);
      WEFT_REQUIRE(detail::exists(root), IoError, "checkpoint: cannot create the directory ", root, ": ", std::strerror(errno));
      detail::remove_tree(tmp);  // left by a save that crashed
      WEFT_REQUIRE(::mkdir(tmp.c_str(), 0755) == 0, IoError, "checkpoint: cannot create ", tmp, ": ", std::strerror(errno));
    });
  agree_or_clean_up(err);

  std::string results;  // "file crc bytes data_offset\n" per chunk written
  std::size_t written = 0;
  std::vector<std::pair<std::string, std::string>> to_flush;  // (path, what) of the files written
  err = detail::capture([&] {
    std::vector<Kokkos::View<T*, Kokkos::HostSpace>> host(state.pieces().size());
    std::vector<char> buf;
    for (const Local& c : local) {
      const auto& [who, file] = writer.at(c.key);
      if (who != rank) continue;
      auto& h = host[c.piece];
      if (!h.extent(0) && state.pieces()[c.piece].data.extent(0))
        h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), state.pieces()[c.piece].data);  // no copy on the host
      const std::string header = npy_header({c.key.box.rows, c.key.box.cols});
      const std::size_t nbytes = c.key.box.size() * sizeof(T);
      // Whole rows (or one row) are contiguous in the piece: written from it directly; others packed.
      const T* src = h.data() + c.seg.offset;
      if (c.key.box.rows > 1 && c.seg.stride != c.key.box.cols) {
        buf.resize(nbytes);
        T* out = reinterpret_cast<T*>(buf.data());
        for (std::size_t i = 0; i < c.key.box.rows; ++i)
          std::memcpy(out + i * c.key.box.cols, h.data() + c.seg.offset + i * c.seg.stride, c.key.box.cols * sizeof(T));
        src = out;
      }
      const std::string path = tmp + "/" + file;
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      WEFT_REQUIRE(fd >= 0, IoError, "checkpoint: cannot create ", path, " (tensor '", c.key.tensor, "'): ", std::strerror(errno));
      const std::string what = path + " (tensor '" + c.key.tensor + "')";
      std::uint32_t crc = 0;
      const std::string write_error = detail::capture([&] {
        detail::write_all(fd, header.data(), header.size(), what);
        // 256 KiB at a time: the crc32 brings a block into the L2 cache and
        // write() copies it from there, so the data is read from memory once.
        const char* q = reinterpret_cast<const char*>(src);
        for (std::size_t done = 0; done < nbytes;) {
          const std::size_t n = std::min(std::size_t(256) << 10, nbytes - done);
          crc = crc32(q + done, n, crc);
          detail::write_all(fd, q + done, n, what);
          done += n;
        }
      });
      // With `durable`, the file's writeback starts now, while the next
      // chunks are written.
      if (write_error.empty() && options.durable) ::sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
      ::close(fd);
      WEFT_REQUIRE(write_error.empty(), IoError, write_error);
      to_flush.emplace_back(path, what);
      written += nbytes;
      results += file + ' ' + std::to_string(crc) + ' ' + std::to_string(nbytes) + ' ' + std::to_string(header.size()) + '\n';
    }
  });
  agree_or_clean_up(err);

  // 4. Rank 0 writes the manifest into the temporary directory (the chunks'
  // checksums are known once they are written, flushed or not), so that one
  // flush makes it durable with the chunks.
  const auto all_results = detail::all_gather_strings(comm, results);
  err.clear();
  if (rank == 0)
    err = detail::capture([&] {
      std::map<std::string, std::tuple<std::uint32_t, std::size_t, std::size_t>> info;  // file -> crc, bytes, data offset
      for (const auto& s : all_results) {
        std::istringstream in(s);
        std::string f;
        std::uint32_t crc;
        std::size_t n, off;
        while (in >> f >> crc >> n >> off) info[f] = {crc, n, off};
      }
      using metrics::Json;
      Json::Array tensors;
      std::map<std::string, Json::Array> chunks;
      std::map<std::string, std::pair<std::size_t, std::size_t>> shapes;
      std::vector<std::string> order;
      for (const auto& [k, w] : writer) {
        const auto& [crc, n, off] = info.at(w.second);
        if (!chunks.count(k.tensor)) order.push_back(k.tensor);
        shapes[k.tensor] = {k.rows, k.cols};
        chunks[k.tensor].push_back(Json::object()
                                       .set("file", w.second)
                                       .set("offset", Json(Json::Array{Json(k.box.row0), Json(k.box.col0)}))
                                       .set("shape", Json(Json::Array{Json(k.box.rows), Json(k.box.cols)}))
                                       .set("byte_offset", Json(off))
                                       .set("bytes", Json(n))
                                       .set("crc32", Json(std::size_t(crc))));
      }
      for (const auto& t : order)
        tensors.push_back(Json::object()
                              .set("name", t)
                              .set("dtype", "float32")
                              .set("shape", Json(Json::Array{Json(shapes[t].first), Json(shapes[t].second)}))
                              .set("chunks", Json(chunks[t])));
      Json m = Json::object();
      m.set("format", "weft-checkpoint").set("format_version", 1).set("step", Json(step));
      m.set("files", "one .npy file per chunk: <tensor>.<k>.npy, float32 little-endian, C order; crc32 is zlib's over the data bytes");
      m.set("world_size", size).set("run", run).set("tensors", Json(tensors));
      // The manifest's own checksum, over what a load trusts (detail::manifest_digest of the manifest as written).
      m.set("manifest_crc32", Json(std::size_t(detail::manifest_digest(plan::parse_json(m.dump(), "manifest")))));
      const std::string mpath = tmp + "/manifest.json";
      {
        const std::string text = m.dump() + "\n";
        const int fd = ::open(mpath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        WEFT_REQUIRE(fd >= 0, IoError, "checkpoint: cannot create ", mpath, ": ", std::strerror(errno));
        const std::string write_error = detail::capture([&] { detail::write_all(fd, text.data(), text.size(), mpath); });
        const int closed = ::close(fd), close_errno = errno;
        WEFT_REQUIRE(write_error.empty(), IoError, write_error);
        WEFT_REQUIRE(closed == 0, IoError, "checkpoint: writing ", mpath, " failed: ", std::strerror(close_errno));
      }
      to_flush.emplace_back(mpath, mpath);
      to_flush.emplace_back(tmp, "the directory " + tmp);
    });
  agree_or_clean_up(err);

  // 5. With `durable`, every rank flushes its files (rank 0 the manifest and
  // the directory too), all of them only after all are written: the first
  // fdatasync waits for one journal commit that holds the metadata of all of
  // them, the others find theirs committed and wait for their data and a
  // flush of the device's cache, issued together (detail::flush_files; an
  // fsync right after each write costs a commit apiece: 2.3 s for 400 files
  // against 0.12 s without; syncfs would also flush whatever else the file
  // system holds; docs/checkpoint.md).
  err = detail::capture([&] {
    if (options.durable) {
      auto wait = detail::bounded("fdatasync");
      detail::flush_files(to_flush, 16);
    }
    // A crash in the middle of a save, on purpose (tests): this rank dies by
    // SIGKILL after writing its chunks, before the checkpoint is renamed into place.
    if (const char* kill = std::getenv("WEFT_CHECKPOINT_KILL_AT")) {
      std::size_t kr = 0, ks = 0;
      if (std::sscanf(kill, "%zu:%zu", &kr, &ks) == 2 && kr == std::size_t(rank) && ks == step) ::raise(SIGKILL);
    }
    // A rank stopped in the middle of a save (tests; SIGSTOP, as a debugger
    // or a hung file system would): the others wait for it in the next
    // agreement, under the deadline.
    if (const char* stop = std::getenv("WEFT_CHECKPOINT_STOP_AT")) {
      std::size_t kr = 0, ks = 0;
      if (std::sscanf(stop, "%zu:%zu", &kr, &ks) == 2 && kr == std::size_t(rank) && ks == step) ::raise(SIGSTOP);
    }
  });
  agree_or_clean_up(err);

  // 6. Only when every rank's files are complete: rank 0 renames the directory into place.
  if (rank == 0)
    err = detail::capture([&] {
      if (detail::exists(final_dir)) detail::remove_tree(final_dir);  // a checkpoint of the same step, replaced
      WEFT_REQUIRE(::rename(tmp.c_str(), final_dir.c_str()) == 0, IoError, "checkpoint: renaming ", tmp, " to ", final_dir,
                   " failed: ", std::strerror(errno));
      if (options.durable) detail::fsync_path(root);
    });
  agree_or_clean_up(err);
  // 7. Retention: the oldest complete checkpoints beyond `keep`, every rank
  // unlinking a share of their files.
  if (options.keep > 0) {
    std::string old;  // rank 0's list, so that every rank removes the same ones
    if (rank == 0) {
      auto all = detail::complete_checkpoints(root);
      for (std::size_t i = 0; i + options.keep < all.size(); ++i) old += all[i].second + '\n';
    }
    int len = int(old.size());
    {
      auto wait = detail::bounded("broadcast");
      MPI_Bcast(&len, 1, MPI_INT, 0, comm);
      old.resize(std::size_t(len));
      MPI_Bcast(old.data(), len, MPI_CHAR, 0, comm);
    }
    std::istringstream in(old);
    for (std::string d; std::getline(in, d);) detail::remove_checkpoint(d, comm);
  }
  SaveStats st;
  st.path = final_dir;
  st.bytes = written;
  {
    auto wait = detail::bounded("all_reduce");
    MPI_Allreduce(&written, &st.total_bytes, 1, MPI_UNSIGNED_LONG, MPI_SUM, comm);
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// Loads `state` from the checkpoint `path` names (see resolve()): every
/// piece is filled from the byte ranges of the saved chunks that intersect
/// it, whatever mesh saved them. Collective over `comm`. Every chunk a rank
/// reads is checked (file size, .npy header) and every chunk's CRC-32 is
/// verified by one rank (one that reads it whole when there is one); any
/// problem -- a missing or truncated file, a bad checksum, a missing tensor,
/// another shape -- raises the same IoError on every rank, naming the file
/// and the tensor, before any piece is written (with the default
/// options.verify; with Verify::while_reading a bad checksum is found as the
/// chunk is read into its piece).
template <class T, class Space>
LoadStats load(const std::string& path, State<T, Space>& state, MPI_Comm comm, const LoadOptions& options = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  LoadStats st;
  const detail::Phase phase(comm, "during the checkpoint load of " + path);
  std::map<std::string, detail::ManifestTensor> tensors;
  std::vector<std::pair<std::string, std::size_t>> chunk_of;  // global chunk id -> tensor, index in tensor
  std::string mpath;
  detail::agree(comm, detail::capture([&] {
    st.path = resolve(path);
    mpath = st.path + "/manifest.json";
    std::ifstream f(mpath);
    WEFT_REQUIRE(f.good(), IoError, "checkpoint: cannot open ", mpath, ": ", std::strerror(errno));
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    st.manifest = plan::parse_json(text, "checkpoint manifest " + mpath);
    const auto& m = st.manifest;
    WEFT_REQUIRE(m.kind == plan::JsonValue::Kind::object && m.find("format") && m.find("format")->string == "weft-checkpoint",
                 IoError, mpath, ": not a weft checkpoint manifest (no \"format\": \"weft-checkpoint\")");
    // A manifest with a checksum (every one weft writes) must match it: an
    // edited step or chunk is named like a corrupted chunk. Manifests
    // written before the checksum existed have none and are read as they are.
    if (const plan::JsonValue* sum = m.find("manifest_crc32")) {
      const std::uint32_t want = std::uint32_t(detail::as_size(sum, mpath + ": \"manifest_crc32\""));
      const std::uint32_t got = detail::manifest_digest(m);
      WEFT_REQUIRE(got == want, IoError, "checkpoint: ", mpath, " is corrupted: the crc32 of its content (step, tensors, ",
                   "chunks) is ", got, ", its \"manifest_crc32\" says ", want,
                   " (edited or damaged); use another checkpoint (an older step-N directory) or restore this one");
    }
    st.step = detail::as_size(m.find("step"), mpath + ": \"step\"");
    const plan::JsonValue* ts = m.find("tensors");
    WEFT_REQUIRE(ts && ts->kind == plan::JsonValue::Kind::array, IoError, mpath, ": no \"tensors\" array");
    for (const auto& t : ts->array) {
      const plan::JsonValue* nm = t.find("name");
      WEFT_REQUIRE(nm && nm->kind == plan::JsonValue::Kind::string, IoError, mpath, ": a tensor without a \"name\"");
      const bool ignored = std::any_of(options.ignore_suffixes.begin(), options.ignore_suffixes.end(), [&](const std::string& x) {
        return nm->string.size() >= x.size() && nm->string.compare(nm->string.size() - x.size(), x.size(), x) == 0;
      });
      if (ignored) continue;
      const std::string what = mpath + ", tensor '" + nm->string + "'";
      const plan::JsonValue* dt = t.find("dtype");
      WEFT_REQUIRE(dt && dt->string == "float32", IoError, what, ": dtype is not float32");
      const plan::JsonValue* shape = t.find("shape");
      WEFT_REQUIRE(shape && shape->array.size() == 2, IoError, what, ": \"shape\" is not [rows, cols]");
      detail::ManifestTensor mt;
      mt.rows = detail::as_size(&shape->array[0], what + " shape");
      mt.cols = detail::as_size(&shape->array[1], what + " shape");
      const plan::JsonValue* cs = t.find("chunks");
      WEFT_REQUIRE(cs && cs->kind == plan::JsonValue::Kind::array, IoError, what, ": no \"chunks\" array");
      for (const auto& c : cs->array) {
        plan::SavedChunk sc;
        const plan::JsonValue* file = c.find("file");
        WEFT_REQUIRE(file && file->kind == plan::JsonValue::Kind::string && file->string.find('/') == std::string::npos, IoError,
                     what, ": a chunk without a plain \"file\" name");
        sc.file = file->string;
        const plan::JsonValue* off = c.find("offset");
        const plan::JsonValue* sh = c.find("shape");
        WEFT_REQUIRE(off && sh && off->array.size() == 2 && sh->array.size() == 2, IoError, what, ", chunk ", sc.file,
                     ": \"offset\" and \"shape\" must be [row, col] pairs");
        sc.box = {detail::as_size(&off->array[0], what), detail::as_size(&off->array[1], what),
                  detail::as_size(&sh->array[0], what), detail::as_size(&sh->array[1], what)};
        WEFT_REQUIRE(sc.box.row0 + sc.box.rows <= mt.rows && sc.box.col0 + sc.box.cols <= mt.cols, IoError, what, ", chunk ",
                     sc.file, ": lies outside the tensor's ", mt.rows, " x ", mt.cols);
        sc.byte_offset = detail::as_size(c.find("byte_offset"), what + ", chunk " + sc.file + " byte_offset");
        sc.bytes = detail::as_size(c.find("bytes"), what + ", chunk " + sc.file + " bytes");
        WEFT_REQUIRE(sc.bytes == sc.box.size() * sizeof(T), IoError, what, ", chunk ", sc.file, ": ", sc.bytes,
                     " bytes for ", sc.box.rows, " x ", sc.box.cols, " float32 elements");
        mt.crcs.push_back(std::uint32_t(detail::as_size(c.find("crc32"), what + ", chunk " + sc.file + " crc32")));
        mt.chunks.push_back(sc);
        mt.ids.push_back(chunk_of.size());
        chunk_of.emplace_back(nm->string, mt.chunks.size() - 1);
      }
      tensors[nm->string] = std::move(mt);
    }
  }));

  // Plans: for every piece, the reads from the chunks of its tensor.
  std::vector<plan::PieceReadPlan> plans(state.pieces().size());
  std::vector<std::size_t> needed(chunk_of.size(), 0);  // bytes this rank reads from each chunk
  detail::agree(comm, detail::capture([&] {
    for (std::size_t i = 0; i < state.pieces().size(); ++i) {
      const auto& p = state.pieces()[i];
      auto it = tensors.find(p.tensor);
      WEFT_REQUIRE(it != tensors.end(), IoError, "checkpoint ", mpath, " has no tensor '", p.tensor,
                   "', which this model needs (a checkpoint of another model, or a damaged manifest)");
      WEFT_REQUIRE(it->second.rows == p.layout.global_rows && it->second.cols == p.layout.global_cols, IoError, "checkpoint ",
                   mpath, ": tensor '", p.tensor, "' is ", it->second.rows, " x ", it->second.cols, " there, but ",
                   p.layout.global_rows, " x ", p.layout.global_cols, " in this model (a checkpoint of another model)");
      plans[i] = plan::plan_reads(p.layout, p.offset, p.data.extent(0), it->second.chunks, sizeof(T));
      WEFT_REQUIRE(plans[i].covered == p.data.extent(0), IoError, "checkpoint ", mpath, ": the chunks of tensor '", p.tensor,
                   "' cover ", plans[i].covered, " of the ", p.data.extent(0), " elements this rank needs at offset ",
                   p.offset, " (chunks missing from the manifest)");
      for (const auto& r : plans[i].reads) needed[it->second.ids[r.chunk]] += r.bytes;
    }
  }));

  // Tensors no rank asks for: a checkpoint of another (larger) model.
  {
    std::string mine;
    for (const auto& p : state.pieces()) mine += p.tensor + '\n';
    std::map<std::string, int> asked;
    for (const auto& s : detail::all_gather_strings(comm, mine)) {
      std::istringstream in(s);
      std::string t;
      while (std::getline(in, t)) asked[t] = 1;
    }
    std::string extra;
    for (const auto& [t, mt] : tensors)
      if (!asked.count(t)) {
        extra = "checkpoint " + mpath + " has tensor '" + t + "' (" + std::to_string(mt.rows) + " x " + std::to_string(mt.cols) +
                "), which this model does not have (a checkpoint of another model)";
        break;
      }
    detail::agree(comm, extra);
  }

  // Who verifies each chunk: the lowest rank that reads it whole, else id % size.
  const std::size_t nchunks = chunk_of.size();
  std::vector<int> whole(nchunks), first_whole(nchunks);
  for (std::size_t c = 0; c < nchunks; ++c) {
    const auto& [t, k] = chunk_of[c];
    whole[c] = needed[c] == tensors[t].chunks[k].bytes ? rank : size;
  }
  if (nchunks) {
    auto wait = detail::bounded("all_reduce");
    MPI_Allreduce(whole.data(), first_whole.data(), int(nchunks), MPI_INT, MPI_MIN, comm);
  }

  // Two passes, so that no piece is written unless everything checks out:
  // 1. every chunk a rank reads from is opened and its size and .npy header
  //    checked, and every chunk's crc32 is verified by its verifier (read
  //    whole through one reused 256 KiB buffer); every rank agrees on the
  //    outcome;
  // 2. each rank reads exactly its byte ranges straight into its pieces (or
  //    a host mirror of device pieces). A verified chunk is thus read twice,
  //    the second time mostly from the page cache, but no staging copy of the
  //    model is allocated: on this machine's virtual machine first-touching
  //    fresh memory costs more than reading the bytes (docs/checkpoint.md).
  std::size_t bytes_read = 0;
  struct Files {  // one descriptor per chunk file, closed however the load ends
    std::map<std::string, int> fd;
    ~Files() {
      for (auto& [f, d] : fd) ::close(d);
    }
  } files;
  auto& fds = files.fd;
  auto open_chunk = [&](std::size_t c) {
    const auto& [t, k] = chunk_of[c];
    const auto& sc = tensors[t].chunks[k];
    const std::string file = st.path + "/" + sc.file;
    auto it = fds.find(file);
    if (it != fds.end()) return it->second;
    const int fd = ::open(file.c_str(), O_RDONLY);
    WEFT_REQUIRE(fd >= 0, IoError, "checkpoint: cannot open ", file, " (tensor '", t, "'): ", std::strerror(errno));
    fds[file] = fd;
    struct stat s;
    ::fstat(fd, &s);
    WEFT_REQUIRE(std::size_t(s.st_size) >= sc.byte_offset + sc.bytes, IoError, "checkpoint: ", file, " (tensor '", t,
                 "') is truncated: ", s.st_size, " bytes, but its chunk ends at byte ", sc.byte_offset + sc.bytes);
    std::string head(sc.byte_offset, '\0');
    detail::pread_all(fd, head.data(), head.size(), 0, file);
    const NpyInfo info = parse_npy_header(head, "checkpoint: " + file + " (tensor '" + t + "')");
    WEFT_REQUIRE(info.descr == "<f4" && info.shape == std::vector<std::size_t>({sc.box.rows, sc.box.cols}) &&
                     info.data_offset == sc.byte_offset,
                 IoError, "checkpoint: ", file, " (tensor '", t, "'): its .npy header (", info.descr, ", ",
                 info.shape.size(), " dims, data at byte ", info.data_offset, ") does not match the manifest's <f4 ",
                 sc.box.rows, " x ", sc.box.cols, " at byte ", sc.byte_offset);
    return fd;
  };
  // This rank's reads, by chunk.
  std::map<std::size_t, std::vector<std::pair<std::size_t, std::size_t>>> reads_of;  // chunk id -> (piece, read)
  for (std::size_t i = 0; i < state.pieces().size(); ++i) {
    const auto& mt = tensors[state.pieces()[i].tensor];
    for (std::size_t j = 0; j < plans[i].reads.size(); ++j) reads_of[mt.ids[plans[i].reads[j].chunk]].emplace_back(i, j);
  }
  // Verify::while_reading reads a chunk into its piece kFusedRead bytes at a
  // time and runs the crc32 over each part as it lands. A part that fits in
  // the L2 cache is still there for the crc32, which then costs about a tenth
  // of the read (docs/checkpoint.md); 4 MiB parts fell out of it and cost
  // the crc32 a second trip to memory, and 1 MiB parts (this machine's L2)
  // did so in some runs.
  constexpr std::size_t kFusedRead = std::size_t(256) << 10;
  // With Verify::while_reading, the chunks this rank verifies and reads whole
  // into one piece: (chunk -> index into reads_of[chunk]) checked in pass 2.
  std::map<std::size_t, std::size_t> fused;
  if (options.verify == Verify::while_reading)
    for (const auto& [c, list] : reads_of) {
      const int verifier = first_whole[c] < size ? first_whole[c] : int(c % std::size_t(size));
      if (verifier != rank) continue;
      const auto& [t, k] = chunk_of[c];
      const auto& sc = tensors[t].chunks[k];
      for (std::size_t x = 0; x < list.size(); ++x) {
        const auto& r = plans[list[x].first].reads[list[x].second];
        if (r.bytes == sc.bytes && r.file_offset == sc.byte_offset) {
          fused[c] = x;
          break;
        }
      }
    }
  detail::agree(comm, detail::capture([&] {
    // A chunk is checked 256 KiB at a time through one buffer, so that the
    // crc32 reads what pread just wrote from the L2 cache.
    std::vector<char> buf(std::size_t(256) << 10);
    for (std::size_t c = 0; c < nchunks; ++c) {
      const int verifier = first_whole[c] < size ? first_whole[c] : int(c % std::size_t(size));
      if (verifier != rank || fused.count(c)) {
        if (reads_of.count(c)) open_chunk(c);
        continue;
      }
      const auto& [t, k] = chunk_of[c];
      const auto& sc = tensors[t].chunks[k];
      const int fd = open_chunk(c);
      std::uint32_t crc = 0;
      for (std::size_t done = 0; done < sc.bytes;) {
        const std::size_t n = std::min(buf.size(), sc.bytes - done);
        detail::pread_all(fd, buf.data(), n, sc.byte_offset + done, st.path + "/" + sc.file);
        crc = crc32(buf.data(), n, crc);
        done += n;
      }
      bytes_read += sc.bytes;
      WEFT_REQUIRE(crc == tensors[t].crcs[k], IoError, "checkpoint: ", st.path, "/", sc.file, " (tensor '", t,
                   "') is corrupted: its data's crc32 is ", crc, ", the manifest says ", tensors[t].crcs[k]);
    }
  }));
  using Host = Kokkos::View<T*, Kokkos::HostSpace>;
  std::vector<Host> host(state.pieces().size());
  detail::agree(comm, detail::capture([&] {
    for (std::size_t i = 0; i < state.pieces().size(); ++i) host[i] = Kokkos::create_mirror_view(state.pieces()[i].data);
    for (const auto& [c, list] : reads_of) {
      const int fd = open_chunk(c);
      const auto& [t, k] = chunk_of[c];
      const auto f = fused.find(c);
      for (std::size_t x = 0; x < list.size(); ++x) {
        const auto& [i, j] = list[x];
        const auto& r = plans[i].reads[j];
        char* dst = reinterpret_cast<char*>(host[i].data() + r.element);
        const std::string file = st.path + "/" + tensors[t].chunks[k].file;
        if (f != fused.end() && f->second == x) {
          // The whole chunk into its piece, part by part, each part's crc32 right after its read.
          std::uint32_t crc = 0;
          for (std::size_t done = 0; done < r.bytes;) {
            const std::size_t n = std::min(kFusedRead, r.bytes - done);
            detail::pread_all(fd, dst + done, n, r.file_offset + done, file);
            crc = crc32(dst + done, n, crc);
            done += n;
          }
          WEFT_REQUIRE(crc == tensors[t].crcs[k], IoError, "checkpoint: ", file, " (tensor '", t,
                       "') is corrupted: its data's crc32 is ", crc, ", the manifest says ", tensors[t].crcs[k],
                       "; found as its bytes were read into this state's pieces (Verify::while_reading), which hold "
                       "them now: load a good checkpoint into the state or discard it");
        } else {
          detail::pread_all(fd, dst, r.bytes, r.file_offset, file);
        }
        bytes_read += r.bytes;
      }
    }
  }));
  for (std::size_t i = 0; i < state.pieces().size(); ++i) Kokkos::deep_copy(state.pieces()[i].data, host[i]);
  Kokkos::fence();
  st.bytes = bytes_read;
  {
    auto wait = detail::bounded("all_reduce");
    MPI_Allreduce(&bytes_read, &st.total_bytes, 1, MPI_UNSIGNED_LONG, MPI_SUM, comm);
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace weft::checkpoint
