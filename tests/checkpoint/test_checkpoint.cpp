// Checkpoints: the read plan by its law (every element of every piece, for
// pieces of one split read from chunks of another, comes from the right
// global index), CRC-32 and .npy headers against their published forms, a
// save on one layout loaded onto another across the ranks, retention, and
// damaged checkpoints: each gives its error on every rank, naming the file
// and the tensor, and none hangs.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include <weft/checkpoint/checkpoint.hpp>
#include <weft/plan/read_plan.hpp>

#include "weft_test.hpp"

namespace {

using namespace weft;
using Space = Kokkos::DefaultExecutionSpace;
using plan::LocalLayout;

// Value of global element (r, c) of test tensor `salt`.
float value_at(std::size_t r, std::size_t c, int salt) { return float(salt * 100000 + int(r) * 1000 + int(c)); }

// Layout of part `index` of `parts` of an R x C tensor: none, row split, or
// a column split of `segments` (each segment split separately, as QKV is).
LocalLayout layout(std::size_t R, std::size_t C, char kind, std::size_t parts, std::size_t index,
                   std::vector<std::size_t> segments = {}) {
  if (kind == 'r') return {R, C, R / parts, C, {{index * (R / parts), 0, R / parts, C, 0}}};
  if (kind == 'c') {
    if (segments.empty()) segments = {C};
    LocalLayout l{R, C, R, C / parts, {}};
    std::size_t g = 0, lc = 0;
    for (std::size_t w : segments) {
      l.bands.push_back({0, g + index * (w / parts), R, w / parts, lc});
      g += w;
      lc += w / parts;
    }
    return l;
  }
  return {R, C, R, C, {{0, 0, R, C, 0}}};
}

// The global (row, col) of local flat element e of a layout.
std::pair<std::size_t, std::size_t> global_of(const LocalLayout& l, std::size_t e) {
  const std::size_t r = e / l.local_cols, c = e % l.local_cols;
  for (const auto& b : l.bands)
    if (c >= b.local_col0 && c < b.local_col0 + b.cols) return {b.row0 + r, b.col0 + c - b.local_col0};
  return {~std::size_t(0), 0};
}

TEST_CASE("read plan: pieces of one split read from chunks of another get every element from its global index") {
  const std::size_t R = 6, C = 12;
  const std::vector<std::size_t> seg = {4, 4, 4};  // like Q | K | V
  struct Split {
    char kind;
    std::size_t parts;
  };
  for (Split save : {Split{'n', 1}, Split{'r', 2}, Split{'r', 3}, Split{'c', 2}, Split{'c', 4}})
    for (Split load : {Split{'n', 1}, Split{'r', 2}, Split{'c', 2}, Split{'c', 4}})
      for (std::size_t pieces : {1, 3, 5}) {  // each part cut into flat pieces at odd offsets (sharded optimizers)
        // Save: every part's segments become chunks, stored one after another in one byte array.
        std::vector<plan::SavedChunk> chunks;
        std::vector<float> file;
        for (std::size_t i = 0; i < save.parts; ++i) {
          const LocalLayout l = layout(R, C, save.kind, save.parts, i, seg);
          for (const auto& s : plan::segments_of(l, 0, l.local_rows * l.local_cols)) {
            chunks.push_back({"part" + std::to_string(i), s.global, file.size() * 4, s.global.size() * 4});
            for (std::size_t r = 0; r < s.global.rows; ++r)
              for (std::size_t c = 0; c < s.global.cols; ++c) file.push_back(value_at(s.global.row0 + r, s.global.col0 + c, 1));
          }
        }
        for (std::size_t i = 0; i < load.parts; ++i) {
          const LocalLayout l = layout(R, C, load.kind, load.parts, i, seg);
          const std::size_t n = l.local_rows * l.local_cols;
          for (std::size_t k = 0; k < pieces; ++k) {
            const std::size_t off = n * k / pieces, cnt = n * (k + 1) / pieces - off;
            const auto p = plan::plan_reads(l, off, cnt, chunks);
            CAPTURE(save.kind);
            CAPTURE(save.parts);
            CAPTURE(load.kind);
            CAPTURE(load.parts);
            CAPTURE(k);
            REQUIRE(p.covered == cnt);
            std::vector<float> got(cnt, -1.0f);
            for (const auto& rd : p.reads) {
              REQUIRE(rd.element + rd.bytes / 4 <= cnt);
              std::memcpy(got.data() + rd.element, reinterpret_cast<const char*>(file.data()) + rd.file_offset, rd.bytes);
            }
            for (std::size_t e = 0; e < cnt; ++e) {
              const auto [r, c] = global_of(l, off + e);
              CHECK(got[e] == value_at(r, c, 1));
            }
          }
        }
      }
}

TEST_CASE("read plan: a whole tensor read back from its own chunks is one read per chunk, and prints") {
  const LocalLayout l = layout(4, 8, 'c', 2, 1);
  std::vector<plan::SavedChunk> chunks = {{"w.0.npy", {0, 0, 4, 4}, 128, 64}, {"w.1.npy", {0, 4, 4, 4}, 128, 64}};
  const auto p = plan::plan_reads(l, 0, 16, chunks);
  REQUIRE(p.reads.size() == 1);
  CHECK(p.reads[0].chunk == 1);
  CHECK(p.reads[0].file_offset == 128);
  CHECK(p.reads[0].bytes == 64);
  CHECK(plan::to_string(p, chunks) == "w.1.npy @128 +64 -> element 0\n1 reads, 16 elements covered\n");
}

TEST_CASE("crc32 and .npy headers: the published check value and numpy's layout") {
  CHECK(checkpoint::crc32("123456789", 9) == 0xCBF43926u);
  CHECK(checkpoint::crc32("", 0) == 0u);
  // The carry-less multiplication paths (128-bit from 64 bytes, 512-bit from
  // 256 where the processor has VPCLMULQDQ) against the table, at every
  // length up to 2 KiB and odd alignments, whole and continued in two parts.
  std::vector<unsigned char> bytes(2048 + 16);
  std::uint32_t x = 12345;
  for (auto& b : bytes) b = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 24);
  std::size_t wrong = 0;
  for (std::size_t n = 0; n <= 2048; ++n)
    for (std::size_t at : {0, 1, 7, 13}) {
      const std::uint32_t want = checkpoint::detail::crc32_table(bytes.data() + at, n, 0);
      wrong += checkpoint::crc32(bytes.data() + at, n) != want;
      wrong += checkpoint::crc32(bytes.data() + at + n / 3, n - n / 3, checkpoint::crc32(bytes.data() + at, n / 3)) != want;
    }
  CHECK(wrong == 0);
  const std::string h = checkpoint::npy_header({3, 5});
  CHECK(h.size() % 64 == 0);
  CHECK(h.back() == '\n');
  CHECK(h.find("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 5), }") == 10);
  const auto info = checkpoint::parse_npy_header(h, "x.npy");
  CHECK(info.descr == "<f4");
  CHECK(info.shape == std::vector<std::size_t>{3, 5});
  CHECK(info.data_offset == h.size());
  CHECK_THROWS_WITH_AS(checkpoint::parse_npy_header("PK\x03\x04 not numpy", "x.npy"), doctest::Contains("x.npy: not a .npy file"),
                       IoError);
}

// A state of two tensors on this rank: "w" (R x C) split `kind` over the
// ranks and cut into `pieces` flat pieces, and "b" (1 x C) whole (replicated).
struct TestState {
  checkpoint::State<float, Space> state;
  std::vector<Kokkos::View<float*, Space>> views;
  std::vector<std::pair<LocalLayout, std::size_t>> where;  // layout and offset of each piece
  std::vector<int> salt;
};
TestState make_state(std::size_t R, std::size_t C, char kind, std::size_t pieces, bool fill, std::size_t w_cols_override = 0) {
  const std::size_t p = std::size_t(test::world().size()), r = std::size_t(test::world().rank());
  TestState t;
  auto add = [&](const std::string& name, const LocalLayout& l, std::size_t off, std::size_t n, int salt) {
    Kokkos::View<float*, Space> v("piece", n);
    auto h = Kokkos::create_mirror_view(v);
    for (std::size_t e = 0; e < n; ++e) {
      const auto [gr, gc] = global_of(l, off + e);
      h(e) = fill ? value_at(gr, gc, salt) : -7.0f;
    }
    Kokkos::deep_copy(v, h);
    t.state.add(name, l, off, v);
    t.views.push_back(v);
    t.where.emplace_back(l, off);
    t.salt.push_back(salt);
  };
  const LocalLayout lw = layout(R, w_cols_override ? w_cols_override : C, kind, p, r, {});
  const std::size_t n = lw.local_rows * lw.local_cols;
  for (std::size_t k = 0; k < pieces; ++k) add("w", lw, n * k / pieces, n * (k + 1) / pieces - n * k / pieces, 1);
  const LocalLayout lb = layout(1, C, 'n', 1, 0);
  add("b", lb, 0, C, 2);
  return t;
}

void check_values(const TestState& t) {
  for (std::size_t i = 0; i < t.views.size(); ++i) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.views[i]);
    for (std::size_t e = 0; e < h.extent(0); ++e) {
      const auto [gr, gc] = global_of(t.where[i].first, t.where[i].second + e);
      REQUIRE(h(e) == value_at(gr, gc, t.salt[i]));
    }
  }
}

std::string scratch(const std::string& name) {
  const std::string d = std::string(WEFT_TEST_SCRATCH) + "/" + name + ".np" + std::to_string(test::world().size());
  if (test::world().rank() == 0) checkpoint::detail::remove_tree(d);
  MPI_Barrier(MPI_COMM_WORLD);
  return d;
}

TEST_CASE("save on a row split, load onto a column split of flat pieces: every element from its global index") {
  const std::size_t p = std::size_t(test::world().size()), R = 4 * p, C = 8 * p;
  const std::string root = scratch("reshard");
  TestState a = make_state(R, C, 'r', 1, true);
  const auto st = checkpoint::save(root, 10, a.state, metrics::Json::object().set("note", "test"), MPI_COMM_WORLD);
  CHECK(st.total_bytes == (R * C + C) * 4);  // the replicated "b" written once
  CHECK(st.path == root + "/step-00000010");
  TestState b = make_state(R, C, 'c', 3, false);
  const auto ld = checkpoint::load(root, b.state, MPI_COMM_WORLD);
  CHECK(ld.step == 10);
  CHECK(ld.path == root + "/step-00000010");
  check_values(b);
}

TEST_CASE("retention keeps the newest K; a leftover temporary directory is ignored and the latest complete one loads") {
  const std::string root = scratch("retention");
  TestState a = make_state(2 * std::size_t(test::world().size()), 4, 'r', 1, true);
  for (std::size_t s : {1, 2, 3}) checkpoint::save(root, s, a.state, metrics::Json::object(), MPI_COMM_WORLD, {.keep = 2});
  if (test::world().rank() == 0) ::mkdir((root + "/.tmp-step-00000004").c_str(), 0755);  // a save that crashed
  MPI_Barrier(MPI_COMM_WORLD);
  const auto all = checkpoint::detail::complete_checkpoints(root);
  REQUIRE(all.size() == 2);
  CHECK(all[0].first == 2);
  CHECK(all[1].first == 3);
  CHECK(checkpoint::resolve(root) == root + "/step-00000003");
}

// Damages the checkpoint (rank 0), then every rank loads it and must get the same error.
template <class Damage>
void expect_load_error(const std::string& name, Damage damage, const std::string& message, std::size_t cols_override = 0) {
  const std::size_t p = std::size_t(test::world().size()), R = 2 * p, C = 4;
  const std::string root = scratch(name);
  TestState a = make_state(R, C, 'r', 1, true);
  const auto st = checkpoint::save(root, 1, a.state, metrics::Json::object(), MPI_COMM_WORLD);
  if (test::world().rank() == 0) damage(st.path);
  MPI_Barrier(MPI_COMM_WORLD);
  TestState b = make_state(R, C, 'c', 2, false, cols_override);
  CHECK_THROWS_WITH_AS(checkpoint::load(root, b.state, MPI_COMM_WORLD), doctest::Contains(message.c_str()), IoError);
  // Nothing was touched.
  for (const auto& v : b.views) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    for (std::size_t e = 0; e < h.extent(0); ++e) REQUIRE(h(e) == -7.0f);
  }
}

void edit_file(const std::string& path, const std::function<void(std::string&)>& f) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  f(s);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << s;
}

TEST_CASE("damaged checkpoints: a changed byte, a truncated file, a missing tensor, an edited manifest, another model") {
  expect_load_error(
      "flipped", [](const std::string& d) { edit_file(d + "/w.0.npy", [](std::string& s) { s[s.size() - 3] ^= 0x40; }); },
      "w.0.npy (tensor 'w') is corrupted: its data's crc32 is");
  expect_load_error(
      "truncated", [](const std::string& d) { edit_file(d + "/w.0.npy", [](std::string& s) { s.resize(s.size() - 5); }); },
      "w.0.npy (tensor 'w') is truncated");
  expect_load_error(
      "missing",
      [](const std::string& d) {
        edit_file(d + "/manifest.json", [](std::string& s) {
          const auto at = s.find("\"name\": \"b\"");
          s.replace(at, 11, "\"name\": \"z\"");
          // Without the manifest's own checksum (as written before it
          // existed), so that the load finds the missing tensor itself.
          const auto c = s.find("\"manifest_crc32\"");
          const auto from = s.rfind(',', c), to = s.find_first_of(",}", c);
          s.erase(from, to - from);
        });
      },
      "manifest.json has no tensor 'b', which this model needs");
  // The same kind of edit with the checksum in place: the manifest is named
  // as corrupted (an edited step resumed as that step before).
  expect_load_error(
      "edited_step",
      [](const std::string& d) {
        edit_file(d + "/manifest.json", [](std::string& s) {
          const auto at = s.find("\"step\": 1");
          s.replace(at, 9, "\"step\": 2");
        });
      },
      "manifest.json is corrupted: the crc32 of its content (step, tensors, chunks) is");
  expect_load_error(
      "other_model", [](const std::string&) {}, "manifest.json: tensor 'w' is ", 8);
}

TEST_CASE("Verify::while_reading: a same-mesh load reads each verified chunk once, into its piece") {
  const std::size_t p = std::size_t(test::world().size()), R = 2 * p, C = 8;
  const std::string root = scratch("while_reading");
  TestState a = make_state(R, C, 'r', 1, true);
  checkpoint::save(root, 4, a.state, metrics::Json::object(), MPI_COMM_WORLD);
  const std::size_t w_bytes = (R / p) * C * 4, b_bytes = C * 4;  // this rank's row shard of w, and the whole b
  const bool root_rank = test::world().rank() == 0;  // rank 0 verifies b (the lowest rank that reads it whole)
  TestState b = make_state(R, C, 'r', 1, false);
  const auto first = checkpoint::load(root, b.state, MPI_COMM_WORLD);
  check_values(b);
  // Verified first: w's chunk (and b's on rank 0) read twice.
  CHECK(first.bytes == 2 * w_bytes + (root_rank ? 2 : 1) * b_bytes);
  TestState c = make_state(R, C, 'r', 1, false);
  const auto once = checkpoint::load(root, c.state, MPI_COMM_WORLD, {.verify = checkpoint::Verify::while_reading});
  check_values(c);
  CHECK(once.bytes == w_bytes + b_bytes);
  CHECK(once.total_bytes == R * C * 4 + p * b_bytes);
  // Onto another split no rank reads w's chunks whole: they are verified first as before, and the values still agree.
  TestState d = make_state(R, C, 'c', 2, false);
  checkpoint::load(root, d.state, MPI_COMM_WORLD, {.verify = checkpoint::Verify::while_reading});
  check_values(d);
}

TEST_CASE("Verify::while_reading: a changed byte raises the same IoError on every rank, saying the state holds it") {
  const std::size_t p = std::size_t(test::world().size()), R = 2 * p, C = 4;
  const std::string root = scratch("while_reading_damaged");
  TestState a = make_state(R, C, 'r', 1, true);
  const auto st = checkpoint::save(root, 1, a.state, metrics::Json::object(), MPI_COMM_WORLD);
  if (test::world().rank() == 0) edit_file(st.path + "/w.0.npy", [](std::string& s) { s[s.size() - 3] ^= 0x40; });
  MPI_Barrier(MPI_COMM_WORLD);
  TestState b = make_state(R, C, 'r', 1, false);
  CHECK_THROWS_WITH_AS(checkpoint::load(root, b.state, MPI_COMM_WORLD, {.verify = checkpoint::Verify::while_reading}),
                       doctest::Contains("w.0.npy (tensor 'w') is corrupted: its data's crc32 is"), IoError);
  CHECK_THROWS_WITH_AS(checkpoint::load(root, b.state, MPI_COMM_WORLD, {.verify = checkpoint::Verify::while_reading}),
                       doctest::Contains("(Verify::while_reading), which hold them now"), IoError);
}

}  // namespace
