// A small JSON reader for the planner's input files (model and topology
// descriptions). metrics::Json only writes; this parses, and every error
// names the file position or the field that was wrong.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>

namespace weft::plan {

/// A parsed JSON value (null, bool, number, string, array or object).
struct JsonValue {
  /// Which alternative is held.
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<JsonValue> array;
  // Object members as two parallel vectors (in file order): a vector of
  // std::pair<std::string, JsonValue> inside JsonValue itself does not
  // compile with clang 14 and libstdc++ 12 (the pair is still incomplete).
  std::vector<std::string> keys;     ///< object member names
  std::vector<JsonValue> members;    ///< object member values, members[i] named keys[i]

  /// The member named key, or null when absent (objects only).
  const JsonValue* find(const std::string& key) const;
};

inline const JsonValue* JsonValue::find(const std::string& key) const {
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == key) return &members[i];
  return nullptr;
}

namespace detail {
class JsonParser {
 public:
  JsonParser(const std::string& text, std::string what) : s_(text), what_(std::move(what)) {}
  JsonValue document() {
    JsonValue v = value(0);
    ws();
    if (i_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    std::size_t line = 1, col = 1;
    for (std::size_t k = 0; k < i_ && k < s_.size(); ++k) {
      if (s_[k] == '\n') ++line, col = 1;
      else ++col;
    }
    ::weft::detail::throw_error<ConfigError>(what_, ":", line, ":", col, ": ", msg);
  }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  JsonValue value(int depth) {
    // Depth limit: the inputs are flat records; deep nesting is a broken file, not data.
    if (depth > 64) fail("nesting deeper than 64 levels");
    ws();
    if (i_ >= s_.size()) fail("unexpected end of input");
    JsonValue v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.kind = JsonValue::Kind::object;
      if (eat('}')) return v;
      do {
        ws();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a quoted member name");
        std::string k = str();
        expect(':');
        v.keys.push_back(std::move(k));
        v.members.push_back(value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = JsonValue::Kind::array;
      if (eat(']')) return v;
      do v.array.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = JsonValue::Kind::string;
      v.string = str();
    } else if (s_.compare(i_, 4, "true") == 0) {
      i_ += 4, v.kind = JsonValue::Kind::boolean, v.boolean = true;
    } else if (s_.compare(i_, 5, "false") == 0) {
      i_ += 5, v.kind = JsonValue::Kind::boolean;
    } else if (s_.compare(i_, 4, "null") == 0) {
      i_ += 4;
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      const char* b = s_.c_str() + i_;
      char* e = nullptr;
      v.number = std::strtod(b, &e);
      if (e == b) fail("malformed number");
      i_ += std::size_t(e - b);
      v.kind = JsonValue::Kind::number;
    } else {
      fail(std::string("unexpected character '") + c + "'");
    }
    return v;
  }
  std::string str() {
    ++i_;  // opening quote
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) break;
        const char e = s_[i_++];
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u':  // planner files are ASCII; keep the escape's low byte
            if (i_ + 4 > s_.size()) fail("truncated \\u escape");
            out += char(std::strtol(s_.substr(i_, 4).c_str(), nullptr, 16) & 0x7f);
            i_ += 4;
            break;
          default: out += e;
        }
      } else {
        out += c;
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  const std::string& s_;
  std::string what_;
  std::size_t i_ = 0;
};
}  // namespace detail

/// Parses text; `what` (a file name) prefixes error messages with line:column.
inline JsonValue parse_json(const std::string& text, const std::string& what = "json") {
  return detail::JsonParser(text, what).document();
}

/// Reads typed members of one JSON object, naming the field in every error
/// and rejecting members it was never asked about (a misspelt field is an
/// error, not a silently used default).
class JsonFields {
 public:
  /// Fields of `v`, which must be an object; `what` names the file.
  JsonFields(const JsonValue& v, std::string what) : v_(v), what_(std::move(what)) {
    WEFT_REQUIRE(v.kind == JsonValue::Kind::object, ConfigError, what_, ": expected a JSON object");
  }
  /// A non-negative integer field no larger than `max` (absent: def). A
  /// value above max (1e300, say) is an error naming the largest accepted
  /// value, never a wrapped-around conversion.
  std::size_t size(const std::string& key, std::size_t def, std::size_t max = std::size_t(1) << 53) {
    const JsonValue* x = get(key);
    if (!x) return def;
    WEFT_REQUIRE(x->kind == JsonValue::Kind::number && x->number >= 0 && std::floor(x->number) == x->number,
                 ConfigError, what_, ": field \"", key, "\" must be a non-negative integer");
    WEFT_REQUIRE(x->number <= double(max), ConfigError, what_, ": field \"", key, "\" is ", x->number,
                 ", larger than the largest accepted value ", max);
    return std::size_t(x->number);
  }
  /// Whether the object has a member named key (counts as asked about).
  bool has(const std::string& key) { return get(key) != nullptr; }
  /// A positive number field (absent: def).
  double positive(const std::string& key, double def) {
    const JsonValue* x = get(key);
    if (!x) return def;
    WEFT_REQUIRE(x->kind == JsonValue::Kind::number && x->number > 0, ConfigError, what_, ": field \"", key,
                 "\" must be a positive number");
    return x->number;
  }
  /// A boolean field (absent: def).
  bool flag(const std::string& key, bool def) {
    const JsonValue* x = get(key);
    if (!x) return def;
    WEFT_REQUIRE(x->kind == JsonValue::Kind::boolean, ConfigError, what_, ": field \"", key, "\" must be true or false");
    return x->boolean;
  }
  /// A string field restricted to `choices` (absent: def).
  std::string choice(const std::string& key, const std::string& def, const std::vector<std::string>& choices) {
    const JsonValue* x = get(key);
    if (!x) return def;
    std::string list;
    for (const auto& c : choices) list += (list.empty() ? "" : "|") + c;
    WEFT_REQUIRE(x->kind == JsonValue::Kind::string, ConfigError, what_, ": field \"", key, "\" must be a string (", list, ")");
    for (const auto& c : choices)
      if (c == x->string) return c;
    ::weft::detail::throw_error<ConfigError>(what_, ": field \"", key, "\" is \"", x->string, "\"; expected one of ", list);
  }
  /// A free string field (absent: def).
  std::string text(const std::string& key, const std::string& def) {
    const JsonValue* x = get(key);
    if (!x) return def;
    WEFT_REQUIRE(x->kind == JsonValue::Kind::string, ConfigError, what_, ": field \"", key, "\" must be a string");
    return x->string;
  }
  /// An array field (absent: nullptr); its elements are the caller's to read.
  const JsonValue* array(const std::string& key) {
    const JsonValue* x = get(key);
    if (!x) return nullptr;
    WEFT_REQUIRE(x->kind == JsonValue::Kind::array, ConfigError, what_, ": field \"", key, "\" must be an array");
    return x;
  }
  /// Throws for members no accessor asked about.
  void no_unknown() const {
    for (const auto& k : v_.keys)
      WEFT_REQUIRE(seen_.count(k), ConfigError, what_, ": unknown field \"", k, "\"");
  }

 private:
  const JsonValue* get(const std::string& key) {
    seen_.insert(key);
    return v_.find(key);
  }
  const JsonValue& v_;
  std::string what_;
  std::set<std::string> seen_;
};

}  // namespace weft::plan
