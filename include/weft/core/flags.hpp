// A command-line flag parser for programs built on weft, and the parser of
// mesh specs such as "dp=2,pp=2,tp=2": a user's training or serving program
// declares its flags in a few lines and gets weft's strict checks (no value
// wraps, no flag is silently ignored or given twice) and its messages.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/core/parse.hpp>

namespace weft {

namespace detail {
/// FlagParser::count's default upper bound: 2^40, or T's largest value if
/// smaller. (A free function declared before the class: nvcc refuses a
/// default argument naming a member template declared after it.)
template <class T>
constexpr T default_count_max() {
  constexpr unsigned long long cap = 1ull << 40;
  return static_cast<unsigned long long>(std::numeric_limits<T>::max()) < cap ? std::numeric_limits<T>::max()
                                                                             : static_cast<T>(cap);
}
}  // namespace detail

/// Which real numbers parse_real accepts: 0 and above, or above 0 only.
enum class RealSign { non_negative, positive };

/// Parses `text` as a finite real number (the whole text, as std::strtod
/// reads it: "3e-4", "0.5", "+2") that is >= 0 (RealSign::non_negative) or
/// > 0 (RealSign::positive). Throws weft::ConfigError "<what> <text>:
/// expected a non-negative number" (or "a positive number") for anything
/// else: an empty text, trailing characters, inf, nan, a value out of range.
inline double parse_real(const std::string& what, const std::string& text, RealSign sign = RealSign::non_negative) {
  const char* b = text.c_str();
  char* end = nullptr;
  const double x = text.empty() || std::isspace(static_cast<unsigned char>(text.front())) ? -1.0 : std::strtod(b, &end);
  const bool whole = end != nullptr && end != b && *end == '\0';
  const bool ok = whole && std::isfinite(x) && (sign == RealSign::positive ? x > 0 : x >= 0);
  WEFT_REQUIRE(ok, ConfigError, what, " ", text, ": expected a ",
               sign == RealSign::positive ? "positive" : "non-negative", " number");
  return x;
}

/// The sizes a mesh spec gives, by axis name: {"dp": 2, "tp": 4}. Axes the
/// spec leaves out are absent (the caller chooses their defaults).
using AxisSizes = std::map<std::string, int>;

/// Parses a mesh spec "axis=size[,axis=size...]" (`flag` names where it came
/// from in messages, e.g. "--mesh"). Every axis must be one of `axes` and
/// given once; every size is an integer from 1 to `max_size` (2^24 by
/// default: the sizes fit an int and no product of a few of them overflows).
/// Throws weft::ConfigError, naming the flag and the whole spec:
///   "--mesh dp2: expected axis=size items such as dp=2, got 'dp2'"
///   "--mesh xp=2: unknown axis 'xp'; the axes are dp, tp, pp"
///   "--mesh dp=2,dp=1: axis dp is given twice; name each axis once"
///   "--mesh dp 0: out of range; expected an integer from 1 to 16777216"
///   (the last from weft::parse_integer, with "<flag> <axis>" as its what).
inline AxisSizes parse_mesh_spec(const std::string& flag, const std::string& text, const std::vector<std::string>& axes,
                                int max_size = 1 << 24) {
  AxisSizes sizes;
  std::string names;
  for (const auto& a : axes) names += (names.empty() ? "" : ", ") + a;
  const std::string example = (axes.empty() ? std::string("dp") : axes.front()) + "=2";
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    const std::size_t eq = item.find('=');
    WEFT_REQUIRE(eq != std::string::npos, ConfigError, flag, " ", text, ": expected axis=size items such as ", example,
                 ", got '", item, "'");
    const std::string axis = item.substr(0, eq);
    bool known = false;
    for (const auto& a : axes) known = known || a == axis;
    WEFT_REQUIRE(known, ConfigError, flag, " ", text, ": unknown axis '", axis, "'; the axes are ", names);
    WEFT_REQUIRE(sizes.count(axis) == 0, ConfigError, flag, " ", text, ": axis ", axis,
                 " is given twice; name each axis once");
    sizes[axis] = parse_integer<int>(flag + " " + axis, item.substr(eq + 1), 1, max_size);
    start = end + 1;
  }
  return sizes;
}

/// The flags of one program, declared with their handlers, then parsed from
/// argv in one call:
///
///   std::size_t steps = 8;  double lr = 3e-3;  bool recompute = false;  std::string record;
///   weft::FlagParser flags("my_train");
///   flags.count("--steps", "N", "optimizer steps (default 8)", steps)
///        .real("--lr", "X", "learning rate (default 3e-3)", lr, weft::RealSign::positive)
///        .toggle("--recompute", "recompute activations in backward", recompute)
///        .text("--record", "FILE", "write the run record", record)
///        .value("--mesh", "dp=A,tp=B", "the mesh", [&](const std::string& v) {
///           mesh = weft::parse_mesh_spec("--mesh", v, {"dp", "tp"}); });
///   if (!flags.parse(argc, argv)) { std::fputs(flags.usage().c_str(), stdout); return 0; }  // --help
///
/// Accepted forms: "--name value" and "--name=value" (the value may be empty
/// or start with '-': "--seq -4" reaches --seq's check, which refuses it);
/// a toggle alone ("--name": true) or as "--name=V" with V one of true,
/// false, yes, no, on, off, 1, 0. "--help" or "-h" anywhere ends parsing.
/// Every refusal is a weft::ConfigError whose message names the flag and the
/// fix:
///   "unknown flag --lrr (did you mean --lr?); run my_train --help for the flags"
///   "--lr needs a value; give it as --lr VALUE or --lr=VALUE"
///   "--lr is given twice; give each flag once (the second value would silently replace the first)"
///   "--recompute=maybe: --recompute is a switch; give it alone or as --recompute=true or
///    --recompute=false (yes/no, on/off, 1/0)"
///   "unexpected argument 'steps': every argument is a flag (--name value or --name=value)
///    (did you mean --steps?); run my_train --help for the flags"
/// and whatever the flag's handler throws (the typed registrations'
/// messages are those of weft::parse_integer, parse_real and parse_choice).
/// Handlers run in the order the flags are given, each as its flag is read.
class FlagParser {
 public:
  /// A flag's handler: receives the value text as given (after '=' or the
  /// next argument).
  using Handler = std::function<void(const std::string&)>;

  /// `program` names the program in the usage text and in the messages'
  /// "run <program> --help for the flags".
  explicit FlagParser(std::string program) : program_(std::move(program)) {}

  /// A flag that takes a value, handled by `handler`. `meta` names the value
  /// in the usage text ("N", "FILE"); `help` is its line there. Throws
  /// weft::ConfigError when `name` does not start with "--" or is taken.
  FlagParser& value(const std::string& name, const std::string& meta, const std::string& help, Handler handler) {
    add(name, meta, help, Kind::value, std::move(handler));
    return *this;
  }

  /// A switch: "--name" or "--name=V" (V: true/false, yes/no, on/off, 1/0);
  /// `handler` receives the value as a bool.
  FlagParser& toggle(const std::string& name, const std::string& help, std::function<void(bool)> handler) {
    add(name, "", help, Kind::toggle, [h = std::move(handler)](const std::string& v) { h(v == "1"); });
    return *this;
  }
  /// A switch that sets `dest`.
  FlagParser& toggle(const std::string& name, const std::string& help, bool& dest) {
    return toggle(name, help, [&dest](bool on) { dest = on; });
  }

  /// A count: an integer of dest's type from `lo` to `hi`, parsed strictly by
  /// weft::parse_integer (no sign tricks, no trailing text, no wrapping).
  /// The defaults, 1 to 2^40 (or the type's largest value if smaller), keep
  /// any product of a few counts from overflowing.
  template <class T>
  FlagParser& count(const std::string& name, const std::string& meta, const std::string& help, T& dest,
                    std::type_identity_t<T> lo = 1, std::type_identity_t<T> hi = detail::default_count_max<T>()) {
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>, "count parses into an integer type");
    return value(name, meta, help, [&dest, name, lo, hi](const std::string& v) { dest = parse_integer<T>(name, v, lo, hi); });
  }

  /// A finite real number >= 0 (or > 0 with RealSign::positive), parsed by
  /// weft::parse_real.
  FlagParser& real(const std::string& name, const std::string& meta, const std::string& help, double& dest,
                   RealSign sign = RealSign::non_negative) {
    return value(name, meta, help, [&dest, name, sign](const std::string& v) { dest = parse_real(name, v, sign); });
  }

  /// Any text, stored as given (an empty "--name=" included).
  FlagParser& text(const std::string& name, const std::string& meta, const std::string& help, std::string& dest) {
    return value(name, meta, help, [&dest](const std::string& v) { dest = v; });
  }

  /// One of the names of `choices`, stored as the value it maps to
  /// (weft::parse_choice: "--norm x: expected one of layernorm, rmsnorm").
  /// The usage text shows the names as "a|b|c".
  template <class E>
  FlagParser& choice(const std::string& name, const std::string& help, E& dest, std::map<std::string, E> choices) {
    std::string meta;
    for (const auto& c : choices) meta += (meta.empty() ? "" : "|") + c.first;
    return value(name, meta, help,
                 [&dest, name, cs = std::move(choices)](const std::string& v) { dest = parse_choice<E>(name, v, cs); });
  }

  /// `other` is a second name of the registered flag `name`: it runs the same
  /// handler and counts as `name` for "given twice" and given().
  FlagParser& alias(const std::string& other, const std::string& name) {
    WEFT_REQUIRE(flags_.count(name) == 1, ConfigError, "FlagParser::alias: ", name, " is not a registered flag");
    check_new(other);
    aliases_[other] = name;
    return *this;
  }

  /// Lets the registered flag `name` be given more than once (its handler
  /// runs each time, e.g. to collect a list).
  FlagParser& repeatable(const std::string& name) {
    WEFT_REQUIRE(flags_.count(name) == 1, ConfigError, "FlagParser::repeatable: ", name, " is not a registered flag");
    flags_[name].repeatable = true;
    return *this;
  }

  /// Replaces the generated usage text by `text` (a program with a
  /// hand-laid-out help page).
  FlagParser& usage_text(std::string text) {
    usage_ = std::move(text);
    return *this;
  }

  /// Parses argv[1..argc) and runs the handlers. Returns false when --help
  /// or -h is given (parsing stops there; print usage()), true otherwise.
  /// Throws weft::ConfigError on the refusals listed above the class.
  bool parse(int argc, const char* const* argv) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") return false;
      if (arg.size() < 2 || arg[0] != '-' || arg == "--") {
        const std::string near = nearest("--" + arg);
        throw ConfigError("unexpected argument '" + arg + "': every argument is a flag (--name value or --name=value)" +
                          (near.empty() ? std::string() : " (did you mean " + near + "?)") + "; run " + program_ +
                          " --help for the flags");
      }
      const std::size_t eq = arg.find('=');
      const std::string given_name = arg.substr(0, eq);
      const auto a = aliases_.find(given_name);
      const std::string name = a == aliases_.end() ? given_name : a->second;
      const auto it = flags_.find(name);
      if (it == flags_.end()) {
        const std::string near = nearest(given_name);
        throw ConfigError("unknown flag " + given_name + (near.empty() ? "" : " (did you mean " + near + "?)") + "; run " +
                          program_ + " --help for the flags");
      }
      Flag& f = it->second;
      WEFT_REQUIRE(f.repeatable || given_.insert(name).second, ConfigError, name,
                   " is given twice; give each flag once (the second value would silently replace the first)");
      given_.insert(name);
      if (f.kind == Kind::toggle) {
        bool on = true;
        if (eq != std::string::npos) {
          const std::string v = arg.substr(eq + 1);
          if (v == "true" || v == "yes" || v == "on" || v == "1") on = true;
          else if (v == "false" || v == "no" || v == "off" || v == "0") on = false;
          else
            detail::throw_error<ConfigError>(arg, ": ", given_name, " is a switch; give it alone or as ", given_name,
                                             "=true or ", given_name, "=false (yes/no, on/off, 1/0)");
        }
        f.handler(on ? "1" : "0");
        continue;
      }
      std::string v;
      if (eq != std::string::npos) {
        v = arg.substr(eq + 1);
      } else {
        WEFT_REQUIRE(i + 1 < argc, ConfigError, given_name, " needs a value; give it as ", given_name, " ",
                     f.meta.empty() ? "VALUE" : f.meta, " or ", given_name, "=", f.meta.empty() ? "VALUE" : f.meta);
        v = argv[++i];
      }
      f.handler(v);
    }
    return true;
  }
  /// parse() for a main's argv (char**).
  bool parse(int argc, char** argv) { return parse(argc, const_cast<const char* const*>(argv)); }

  /// Whether the flag `name` (or an alias of it) was given to parse().
  bool given(const std::string& name) const {
    const auto a = aliases_.find(name);
    return given_.count(a == aliases_.end() ? name : a->second) > 0;
  }

  /// The usage text: usage_text()'s if set; otherwise "usage: <program>
  /// [flags]", then one line per flag in the order registered, "  --name
  /// META" and its help aligned in a second column, then "  --help".
  std::string usage() const {
    if (!usage_.empty()) return usage_;
    std::vector<std::pair<std::string, std::string>> lines;
    std::size_t width = 6;  // "--help"
    for (const auto& name : order_) {
      const Flag& f = flags_.at(name);
      std::string left = name;
      if (f.kind == Kind::toggle) left += "[=yes|no]";
      else left += " " + (f.meta.empty() ? std::string("VALUE") : f.meta);
      for (const auto& [other, target] : aliases_)
        if (target == name) left += ", " + other;
      width = std::max(width, left.size());
      lines.emplace_back(left, f.help);
    }
    lines.emplace_back("--help", "this text");
    std::string out = "usage: " + program_ + " [flags]\n";
    for (const auto& [left, help] : lines)
      out += "  " + left + std::string(width - left.size() + 2, ' ') + help + "\n";
    return out;
  }

  /// Whether argv holds "--help" or "-h" anywhere: a program may check this
  /// before anything that could fail (parse() stops at the first one, so an
  /// invalid flag before it is refused first).
  static bool help_requested(int argc, const char* const* argv) {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") return true;
    }
    return false;
  }
  static bool help_requested(int argc, char** argv) { return help_requested(argc, const_cast<const char* const*>(argv)); }

 private:
  enum class Kind { value, toggle };
  struct Flag {
    std::string meta, help;
    Kind kind = Kind::value;
    Handler handler;
    bool repeatable = false;
  };

  void check_new(const std::string& name) const {
    WEFT_REQUIRE(name.size() > 2 && name.rfind("--", 0) == 0 && name.find('=') == std::string::npos, ConfigError,
                 "FlagParser: flag name '", name, "' must start with -- and hold no '='");
    WEFT_REQUIRE(flags_.count(name) == 0 && aliases_.count(name) == 0 && name != "--help", ConfigError,
                 "FlagParser: ", name, " is registered twice");
  }

  void add(const std::string& name, const std::string& meta, const std::string& help, Kind kind, Handler handler) {
    check_new(name);
    flags_[name] = Flag{meta, help, kind, std::move(handler), false};
    order_.push_back(name);
  }

  // Edit distance (insertions, deletions, substitutions) of a and b.
  static std::size_t distance(const std::string& a, const std::string& b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        const std::size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  }

  // The registered name that `given` likely meant: the one name that starts
  // with it (an abbreviation of 3 letters or more), else the name or alias
  // closest to it within 2 edits and at most a third of the letters (a
  // typo, not another word); empty when none is.
  std::string nearest(const std::string& given) const {
    const std::size_t dashes = std::min(given.find_first_not_of('-'), given.size());
    const std::string stem = given.substr(dashes);
    if (stem.size() >= 3) {
      std::string only;
      std::size_t starting = 0;
      for (const auto& [name, f] : flags_)
        if (name.compare(2, stem.size(), stem) == 0 && ++starting == 1) only = name;
      if (starting == 1) return only;
    }
    std::string best;
    std::size_t best_d = std::numeric_limits<std::size_t>::max();
    auto consider = [&](const std::string& name) {
      const std::size_t d = distance(given, name);
      const std::size_t letters = std::max(name.size(), given.size()) - 2;
      if (d <= 2 && 3 * d <= letters && d < best_d) {
        best = name;
        best_d = d;
      }
    };
    for (const auto& [name, f] : flags_) consider(name);
    for (const auto& [other, target] : aliases_) consider(other);
    return best;
  }

  std::string program_, usage_;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> aliases_;  // other name -> registered name
  std::set<std::string> given_;
};

}  // namespace weft
