// A small JSON writer for run records: ordered objects, arrays, strings with
// escapes, and numbers printed with enough digits to read back exactly
// (17 significant digits), so losses compare bit for bit across runs.
#pragma once

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace weft::metrics {

/// A JSON value.
class Json {
 public:
  using Object = std::vector<std::pair<std::string, Json>>;
  using Array = std::vector<Json>;

  Json() : v_(nullptr) {}
  Json(std::nullptr_t) : v_(nullptr) {}
  Json(bool b) : v_(b) {}
  Json(double d) : v_(d) {}
  Json(int i) : v_(double(i)) {}
  Json(long i) : v_(double(i)) {}
  Json(unsigned long i) : v_(double(i)) {}
  Json(unsigned long long i) : v_(double(i)) {}
  Json(const char* s) : v_(std::string(s)) {}
  Json(std::string s) : v_(std::move(s)) {}
  Json(Array a) : v_(std::make_shared<Array>(std::move(a))) {}
  Json(Object o) : v_(std::make_shared<Object>(std::move(o))) {}
  /// An array of numbers.
  Json(const std::vector<double>& xs) : v_(std::make_shared<Array>(xs.begin(), xs.end())) {}

  /// An empty object.
  static Json object() { return Json(Object{}); }
  /// Adds (or replaces) a key of an object; returns *this for chaining.
  Json& set(const std::string& key, Json value) {
    auto& o = *std::get<std::shared_ptr<Object>>(v_);
    for (auto& [k, v] : o)
      if (k == key) {
        v = std::move(value);
        return *this;
      }
    o.emplace_back(key, std::move(value));
    return *this;
  }

  /// The text, indented by two spaces per level (arrays of numbers on one line).
  std::string dump(int indent = 0) const {
    std::string out;
    write(out, indent);
    return out;
  }

 private:
  static void number(std::string& out, double d) {
    if (!std::isfinite(d)) {
      out += "null";  // JSON has no NaN or infinity
      return;
    }
    char buf[40];
    if (d == std::floor(d) && std::fabs(d) < 9e15)
      std::snprintf(buf, sizeof buf, "%.0f", d);
    else
      std::snprintf(buf, sizeof buf, "%.17g", d);
    out += buf;
  }
  static void string(std::string& out, const std::string& s) {
    out += '"';
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') (out += '\\') += char(c);
      else if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else out += char(c);
    }
    out += '"';
  }
  void write(std::string& out, int ind) const {
    const std::string pad(std::size_t(ind + 2), ' '), end(std::size_t(ind), ' ');
    if (std::holds_alternative<std::nullptr_t>(v_)) out += "null";
    else if (auto b = std::get_if<bool>(&v_)) out += *b ? "true" : "false";
    else if (auto d = std::get_if<double>(&v_)) number(out, *d);
    else if (auto s = std::get_if<std::string>(&v_)) string(out, *s);
    else if (auto a = std::get_if<std::shared_ptr<Array>>(&v_)) {
      bool flat = true;
      for (const auto& x : **a) flat = flat && (std::holds_alternative<double>(x.v_) || std::holds_alternative<std::nullptr_t>(x.v_));
      out += '[';
      for (std::size_t i = 0; i < (*a)->size(); ++i) {
        if (i) out += flat ? ", " : ",";
        if (!flat) (out += '\n') += pad;
        (**a)[i].write(out, ind + 2);
      }
      if (!flat && !(*a)->empty()) (out += '\n') += end;
      out += ']';
    } else {
      const auto& o = *std::get<std::shared_ptr<Object>>(v_);
      out += '{';
      for (std::size_t i = 0; i < o.size(); ++i) {
        if (i) out += ',';
        (out += '\n') += pad;
        string(out, o[i].first);
        out += ": ";
        o[i].second.write(out, ind + 2);
      }
      if (!o.empty()) (out += '\n') += end;
      out += '}';
    }
  }

  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<Array>, std::shared_ptr<Object>> v_;
};

}  // namespace weft::metrics
