// The arithmetic of resharding checkpoints: which rectangles of a global
// tensor a rank's local piece covers, and which byte ranges of which saved
// chunk files fill it. Plain integers, no MPI and no Kokkos, so a plan can be
// computed and printed anywhere (docs/checkpoint.md).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace weft::plan {

/// A rectangle of a rank-2 global tensor: rows [row0, row0 + rows), columns
/// [col0, col0 + cols).
struct Box {
  std::size_t row0 = 0, col0 = 0, rows = 0, cols = 0;
  /// Elements in the box.
  std::size_t size() const { return rows * cols; }
  friend bool operator==(const Box&, const Box&) = default;
};

/// The intersection of two boxes (empty: rows or cols 0).
inline Box intersect(const Box& a, const Box& b) {
  const std::size_t r0 = std::max(a.row0, b.row0), r1 = std::min(a.row0 + a.rows, b.row0 + b.rows);
  const std::size_t c0 = std::max(a.col0, b.col0), c1 = std::min(a.col0 + a.cols, b.col0 + b.cols);
  if (r0 >= r1 || c0 >= c1) return Box{r0, c0, 0, 0};
  return Box{r0, c0, r1 - r0, c1 - c0};
}

/// A band of a rank's local [local_rows, local_cols] part of a global
/// tensor: global rows [row0, row0 + rows) x columns [col0, col0 + cols),
/// held at local columns [local_col0, local_col0 + cols) (all local rows).
struct LocalBand {
  std::size_t row0 = 0, col0 = 0, rows = 0, cols = 0, local_col0 = 0;
};

/// Where a rank's local part of a tensor lies in the global tensor.
struct LocalLayout {
  std::size_t global_rows = 0, global_cols = 0;  ///< the whole tensor
  std::size_t local_rows = 0, local_cols = 0;    ///< this rank's part, row-major
  std::vector<LocalBand> bands;                  ///< side by side in the local columns
};

/// A rectangle of the global tensor held by a piece of local storage: element
/// (i, j) of `global` sits at piece element `offset + i * stride + j`.
struct Segment {
  Box global;
  std::size_t offset = 0, stride = 0;
};

/// The rectangles that elements [offset, offset + count) of a local part
/// (row-major [local_rows, local_cols]) cover: at most three row runs (a
/// partial first row, whole rows, a partial last row), each cut by the bands.
/// Segment offsets are relative to `offset` (the piece's first element).
inline std::vector<Segment> segments_of(const LocalLayout& l, std::size_t offset, std::size_t count) {
  std::vector<Segment> out;
  const std::size_t C = l.local_cols;
  if (count == 0 || C == 0) return out;
  // Row runs: [row, row + rows) x local columns [c0, c1).
  struct Run {
    std::size_t row, rows, c0, c1;
  };
  std::vector<Run> runs;
  std::size_t pos = offset;
  const std::size_t end = offset + count;
  if (pos % C != 0) {
    const std::size_t r = pos / C, c0 = pos % C, c1 = std::min(C, c0 + (end - pos));
    runs.push_back({r, 1, c0, c1});
    pos += c1 - c0;
  }
  if (pos < end && (end - pos) / C > 0) {
    const std::size_t n = (end - pos) / C;
    runs.push_back({pos / C, n, 0, C});
    pos += n * C;
  }
  if (pos < end) {
    runs.push_back({pos / C, 1, 0, end - pos});
    pos = end;
  }
  for (const Run& run : runs)
    for (const LocalBand& b : l.bands) {
      const std::size_t c0 = std::max(run.c0, b.local_col0), c1 = std::min(run.c1, b.local_col0 + b.cols);
      if (c0 >= c1) continue;
      Segment s;
      s.global = Box{b.row0 + run.row, b.col0 + (c0 - b.local_col0), run.rows, c1 - c0};
      s.offset = run.row * C + c0 - offset;
      s.stride = C;
      out.push_back(s);
    }
  return out;
}

/// One saved chunk of a tensor as a manifest describes it: a box of the
/// global tensor stored row-major (float32, little-endian) at `byte_offset`
/// of `file`, `bytes` long.
struct SavedChunk {
  std::string file;
  Box box;
  std::size_t byte_offset = 0, bytes = 0;
};

/// One read of a plan: `bytes` bytes at `file_offset` of chunk `chunk`'s file
/// go to piece elements [element, element + bytes / element_size).
struct Read {
  std::size_t chunk = 0, file_offset = 0, bytes = 0, element = 0;
};

/// What one local piece reads: the reads, and the elements they cover (all
/// of the piece when the checkpoint is complete).
struct PieceReadPlan {
  std::vector<Read> reads;
  std::size_t covered = 0;
};

/// Plans the reads of piece elements [offset, offset + count) of a local
/// part with layout `l` from `chunks` (the saved chunks of the same tensor,
/// which do not overlap): for every chunk that intersects one of the piece's
/// segments, one read per intersecting row, merged when consecutive rows are
/// contiguous both in the file and in the piece.
inline PieceReadPlan plan_reads(const LocalLayout& l, std::size_t offset, std::size_t count,
                                const std::vector<SavedChunk>& chunks, std::size_t element_size = 4) {
  PieceReadPlan p;
  for (const Segment& s : segments_of(l, offset, count))
    for (std::size_t k = 0; k < chunks.size(); ++k) {
      const SavedChunk& c = chunks[k];
      const Box x = intersect(s.global, c.box);
      if (x.size() == 0) continue;
      p.covered += x.size();
      for (std::size_t i = 0; i < x.rows; ++i) {
        Read r;
        r.chunk = k;
        r.file_offset = c.byte_offset + ((x.row0 - c.box.row0 + i) * c.box.cols + (x.col0 - c.box.col0)) * element_size;
        r.bytes = x.cols * element_size;
        r.element = s.offset + (x.row0 - s.global.row0 + i) * s.stride + (x.col0 - s.global.col0);
        Read* last = p.reads.empty() ? nullptr : &p.reads.back();
        if (last && last->chunk == k && last->file_offset + last->bytes == r.file_offset &&
            last->element + last->bytes / element_size == r.element)
          last->bytes += r.bytes;
        else
          p.reads.push_back(r);
      }
    }
  return p;
}

/// The plan as text, one read per line: "file @offset +bytes -> element".
inline std::string to_string(const PieceReadPlan& p, const std::vector<SavedChunk>& chunks) {
  std::string out;
  char line[512];
  for (const Read& r : p.reads) {
    std::snprintf(line, sizeof line, "%s @%zu +%zu -> element %zu\n", chunks.at(r.chunk).file.c_str(), r.file_offset,
                  r.bytes, r.element);
    out += line;
  }
  std::snprintf(line, sizeof line, "%zu reads, %zu elements covered\n", p.reads.size(), p.covered);
  return out + line;
}

}  // namespace weft::plan
