// Command-line flags and the model shape shared by weft's benchmarks.
//
// Every benchmark takes "--name value" pairs (and a few bare switches). Flags
// binds each name to a variable, parses argv and, on anything it cannot use
// (an unknown flag, a missing value, a value that is not a number or is out
// of range), says which flag and why and lists the flags with their defaults,
// instead of the bare "stoul" that std::stoul throws. `--help` lists them too.
// ModelFlags is the GPT shape every training benchmark exposes.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <weft/core/parse.hpp>
#include <weft/nn/config.hpp>

namespace weft::bench {

namespace detail {
// Parses s into v (an integer from min to T's largest value); on failure
// err says why, with the value and the range ("out of range; expected an
// integer from 0 to 18446744073709551615, got 99999999999999999999").
template <class T>
bool parse_into(const std::string& s, T& v, T min, std::string& err) {
  try {
    v = weft::parse_integer<T>("", s, min);
    return true;
  } catch (const weft::ConfigError& e) {
    const std::string what = e.what();  // " <s>: <why>; expected an integer from <lo> to <hi>"
    const std::size_t colon = what.find(": ");
    err = (colon == std::string::npos ? what : what.substr(colon + 2)) + ", got '" + s + "'";
    return false;
  }
}
}  // namespace detail

/// Named command-line flags bound to variables (see the file comment).
class Flags {
 public:
  /// `program`: the name errors start with.
  explicit Flags(std::string program) : program_(std::move(program)) {}

  /// A non-negative integer flag; `min` is the smallest value accepted. The
  /// value is parsed strictly (weft::parse_integer): a value beyond the
  /// type's range is refused naming the range, never wrapped.
  Flags& add(const std::string& name, std::size_t& v, const std::string& help, std::size_t min = 0) {
    entries_.push_back({name, help, std::to_string(v), true, [&v, min](const std::string& s, std::string& err) {
                          return detail::parse_into(s, v, min, err);
                        }});
    return *this;
  }
  /// An integer flag of type int; `min` is the smallest value accepted (parsed as strictly).
  Flags& add(const std::string& name, int& v, const std::string& help, int min = 0) {
    entries_.push_back({name, help, std::to_string(v), true, [&v, min](const std::string& s, std::string& err) {
                          return detail::parse_into(s, v, min, err);
                        }});
    return *this;
  }
  /// A real-valued flag; `min` is the smallest value accepted.
  Flags& add(const std::string& name, double& v, const std::string& help, double min = 0.0) {
    char def[32];
    std::snprintf(def, sizeof def, "%g", v);
    entries_.push_back({name, help, def, true, [&v, min](const std::string& s, std::string& err) {
                          char* end = nullptr;
                          const double x = std::strtod(s.c_str(), &end);
                          if (s.empty() || *end != '\0') {
                            err = "expects a number, got '" + s + "'";
                            return false;
                          }
                          if (!(x >= min)) {
                            char m[32];
                            std::snprintf(m, sizeof m, "%g", min);
                            err = std::string("must be at least ") + m + ", got " + s;
                            return false;
                          }
                          v = x;
                          return true;
                        }});
    return *this;
  }
  /// A text flag.
  Flags& add(const std::string& name, std::string& v, const std::string& help) {
    entries_.push_back({name, help, v.empty() ? "''" : v, true, [&v](const std::string& s, std::string&) {
                          v = s;
                          return true;
                        }});
    return *this;
  }
  /// A switch without a value: present means true.
  Flags& add_switch(const std::string& name, bool& v, const std::string& help) {
    entries_.push_back({name, help, "off", false, [&v](const std::string&, std::string&) {
                          v = true;
                          return true;
                        }});
    return *this;
  }

  /// Parses argv[1..argc). Returns 0 when every argument was used, 1 after
  /// --help, 2 on an error; `print` (rank 0) writes the message and the list.
  int parse(int argc, char** argv, bool print) const {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        if (print) usage(stdout);
        return 1;
      }
      const Entry* e = find(a);
      std::string err;
      if (!e) {
        err = "unknown flag '" + a + "'";
      } else if (e->takes_value && i + 1 >= argc) {
        err = a + " needs a value";
      } else if (!e->set(e->takes_value ? std::string(argv[++i]) : std::string(), err)) {
        err = a + " " + err;
      }
      if (!err.empty()) {
        if (print) {
          std::fprintf(stderr, "%s: %s\n", program_.c_str(), err.c_str());
          usage(stderr);
        }
        return 2;
      }
    }
    return 0;
  }

  /// The list of flags with their help and defaults.
  void usage(std::FILE* f) const {
    std::fprintf(f, "%s flags:\n", program_.c_str());
    for (const auto& e : entries_)
      std::fprintf(f, "  %-18s %s (default %s)\n", (e.name + (e.takes_value ? " X" : "")).c_str(), e.help.c_str(),
                   e.def.c_str());
  }

 private:
  struct Entry {
    std::string name, help, def;
    bool takes_value;
    std::function<bool(const std::string&, std::string&)> set;
  };
  const Entry* find(const std::string& name) const {
    for (const auto& e : entries_)
      if (e.name == name) return &e;
    return nullptr;
  }
  std::string program_;
  std::vector<Entry> entries_;
};

/// The GPT shape of a training benchmark, as flags (--layers, --d-model,
/// --heads, --seq, --vocab and the per-rank batch under a name the benchmark
/// chooses). Defaults: config M of the model docs.
struct ModelFlags {
  std::size_t layers = 8, d_model = 512, heads = 8, seq = 256, vocab = 8192, batch = 4;

  /// Registers the flags; `batch_flag` names the batch (e.g. "--micro").
  void add_to(Flags& f, const std::string& batch_flag, const std::string& batch_help) {
    f.add("--layers", layers, "transformer blocks", 1)
        .add("--d-model", d_model, "model width", 1)
        .add("--heads", heads, "attention heads", 1)
        .add("--seq", seq, "tokens per sequence", 1)
        .add("--vocab", vocab, "vocabulary size", 2)
        .add(batch_flag, batch, batch_help, 1);
  }
  /// The model configuration (the rest of GPTConfig at its defaults).
  nn::GPTConfig config() const {
    nn::GPTConfig c;
    c.layers = layers;
    c.d_model = d_model;
    c.heads = heads;
    c.seq = seq;
    c.vocab = vocab;
    c.batch = batch;
    return c;
  }
};

}  // namespace weft::bench
