// Command-line flags and the model shape shared by weft's benchmarks.
//
// Every benchmark takes "--name value" pairs (and a few bare switches). Flags
// binds each name to a variable and parses argv with weft's public
// weft::FlagParser (weft/core/flags.hpp), so a benchmark refuses what
// train_gpt refuses, with the same sentences: an unknown flag (with the
// nearest name), a missing value, a value that is not a number or is out of
// range (naming the range, never wrapping), a flag given twice. `--help`
// lists the flags with their defaults. ModelFlags is the GPT shape every
// training benchmark exposes.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

#include <weft/core/flags.hpp>
#include <weft/core/parse.hpp>
#include <weft/nn/config.hpp>

namespace weft::bench {

/// Named command-line flags bound to variables (see the file comment): a
/// benchmark's thin layer over weft::FlagParser that adds each flag's
/// default to its help line and turns the parser's verdict into an exit
/// status.
class Flags {
 public:
  /// `program`: the name errors start with and the usage text names.
  explicit Flags(std::string program) : program_(program), parser_(std::move(program)) {}

  /// An integer flag (std::size_t or int) from `min` to 2^40 (FlagParser::count).
  template <class T>
  Flags& add(const std::string& name, T& v, const std::string& help, std::type_identity_t<T> min = 0)
    requires std::is_integral_v<T>
  {
    parser_.count(name, "N", with_default(help, std::to_string(v)), v, min);
    return *this;
  }
  /// A real-valued flag: a finite number (weft::parse_real) of at least `min`.
  Flags& add(const std::string& name, double& v, const std::string& help, double min = 0.0) {
    char def[32];
    std::snprintf(def, sizeof def, "%g", v);
    parser_.value(name, "X", with_default(help, def), [&v, name, min](const std::string& s) {
      const double x = weft::parse_real(name, s, weft::RealSign::non_negative);
      char m[32];
      std::snprintf(m, sizeof m, "%g", min);
      WEFT_REQUIRE(x >= min, ConfigError, name, " ", s, ": expected a number of at least ", m);
      v = x;
    });
    return *this;
  }
  /// A text flag.
  Flags& add(const std::string& name, std::string& v, const std::string& help) {
    parser_.text(name, "TEXT", with_default(help, v.empty() ? "''" : v), v);
    return *this;
  }
  /// A switch without a value: present means true (FlagParser::toggle).
  Flags& add_switch(const std::string& name, bool& v, const std::string& help) {
    parser_.toggle(name, with_default(help, "off"), v);
    return *this;
  }

  /// Parses argv[1..argc). Returns 0 when every argument was used, 1 after
  /// --help, 2 on an error; `print` (rank 0) writes the usage text (stdout)
  /// or "<program>: <the parser's sentence>" (stderr).
  int parse(int argc, char** argv, bool print) {
    try {
      if (parser_.parse(argc, argv)) return 0;
      if (print) std::fputs(parser_.usage().c_str(), stdout);
      return 1;
    } catch (const weft::ConfigError& e) {
      if (print) std::fprintf(stderr, "%s: error: %s\n", program_.c_str(), e.what());
      return 2;
    }
  }

 private:
  static std::string with_default(const std::string& help, const std::string& def) {
    return help + " (default " + def + ")";
  }
  std::string program_;
  weft::FlagParser parser_;
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
