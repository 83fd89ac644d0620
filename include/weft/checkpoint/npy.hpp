// The two file-level pieces of weft's checkpoint format: the header of a
// NumPy .npy file (version 1.0, so numpy.load opens every chunk) and CRC-32
// (the polynomial of zlib and PNG, so Python's zlib.crc32 checks a chunk).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <weft/core/error.hpp>

namespace weft::checkpoint {

/// CRC-32 (reflected polynomial 0xEDB88320, as zlib.crc32) of `n` bytes,
/// continuing from `crc` (0 to start).
inline std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0) {
  // Slicing by 8: eight tables, eight bytes per step.
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (n >= 8) {
    const std::uint32_t a = crc ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
                                   std::uint32_t(p[3]) << 24);
    crc = tables[7][a & 0xFF] ^ tables[6][(a >> 8) & 0xFF] ^ tables[5][(a >> 16) & 0xFF] ^ tables[4][a >> 24] ^
          tables[3][p[4]] ^ tables[2][p[5]] ^ tables[1][p[6]] ^ tables[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--) crc = tables[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

/// The header of a version 1.0 .npy file holding a C-order array of
/// little-endian float32 (`descr` '<f4') of `shape`, padded with spaces so
/// that the data starts at a multiple of 64 bytes.
inline std::string npy_header(const std::vector<std::size_t>& shape, const std::string& descr = "<f4") {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + (shape.size() == 1 ? "," : i + 1 < shape.size() ? ", " : "");
  dict += "), }";
  const std::size_t fixed = 10;  // magic (6), version (2), header length (2)
  std::size_t total = fixed + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  dict.append(total - fixed - dict.size() - 1, ' ');
  dict += '\n';
  std::string h = "\x93NUMPY";
  h += char(1);
  h += char(0);
  h += char(dict.size() & 0xFF);
  h += char((dict.size() >> 8) & 0xFF);
  return h + dict;
}

/// What a .npy header says.
struct NpyInfo {
  std::string descr;
  std::vector<std::size_t> shape;
  std::size_t data_offset = 0;  ///< where the data starts
};

/// Parses the .npy header at the start of `bytes` (at least the first 10 +
/// header-length bytes of the file); `what` names the file in the error.
inline NpyInfo parse_npy_header(const std::string& bytes, const std::string& what) {
  WEFT_REQUIRE(bytes.size() >= 10 && bytes.compare(0, 6, "\x93NUMPY") == 0, IoError, what,
               ": not a .npy file (no \\x93NUMPY magic at its start)");
  const unsigned major = static_cast<unsigned char>(bytes[6]);
  WEFT_REQUIRE(major == 1, IoError, what, ": .npy version ", major, ".x; weft reads version 1.0");
  const std::size_t len = std::size_t(static_cast<unsigned char>(bytes[8])) | std::size_t(static_cast<unsigned char>(bytes[9])) << 8;
  WEFT_REQUIRE(bytes.size() >= 10 + len, IoError, what, ": the .npy header is cut short (", bytes.size(), " of ", 10 + len,
               " bytes)");
  const std::string dict = bytes.substr(10, len);
  NpyInfo info;
  info.data_offset = 10 + len;
  const std::size_t d = dict.find("'descr': '");
  WEFT_REQUIRE(d != std::string::npos, IoError, what, ": the .npy header has no 'descr'");
  const std::size_t d1 = dict.find('\'', d + 10);
  WEFT_REQUIRE(d1 != std::string::npos, IoError, what, ": the .npy header's 'descr' is not closed");
  info.descr = dict.substr(d + 10, d1 - d - 10);
  WEFT_REQUIRE(dict.find("'fortran_order': False") != std::string::npos, IoError, what,
               ": the .npy array is not in C order ('fortran_order': False)");
  const std::size_t s = dict.find("'shape': (");
  WEFT_REQUIRE(s != std::string::npos, IoError, what, ": the .npy header has no 'shape'");
  std::size_t i = s + 10;
  while (i < dict.size() && dict[i] != ')') {
    if (dict[i] >= '0' && dict[i] <= '9') {
      std::size_t v = 0;
      while (i < dict.size() && dict[i] >= '0' && dict[i] <= '9') v = v * 10 + std::size_t(dict[i++] - '0');
      info.shape.push_back(v);
    } else {
      ++i;
    }
  }
  WEFT_REQUIRE(i < dict.size(), IoError, what, ": the .npy header's 'shape' is not closed");
  return info;
}

}  // namespace weft::checkpoint
