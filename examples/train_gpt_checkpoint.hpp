// train_gpt's checkpoints: the flags --checkpoint DIR --save-every N
// [--keep K] --resume DIR, what a checkpoint's manifest records about the run
// (mesh, strategy, data position, RNG, optimizer), and the checks that a
// resumed run continues the same training (docs/checkpoint.md).
#pragma once

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include <weft/checkpoint/checkpoint.hpp>
#include <weft/metrics/json.hpp>
#include <weft/plan/json_read.hpp>

namespace train_gpt_checkpoint {

/// The checkpoint flags.
struct Flags {
  std::string dir;            ///< --checkpoint: the root the checkpoints go under
  std::string resume;         ///< --resume: a root (its latest complete checkpoint) or one checkpoint's directory
  std::size_t save_every = 0;  ///< --save-every: steps between checkpoints
  std::size_t keep = 0;        ///< --keep: complete checkpoints kept (0: all)

  /// The usage lines.
  static constexpr const char* usage =
      "  --checkpoint DIR  write checkpoints under DIR (DIR/step-NNNNNNNN, docs/checkpoint.md); needs --save-every\n"
      "  --save-every N    a checkpoint after every N steps\n"
      "  --keep K          keep the newest K checkpoints under DIR (0: all)\n"
      "  --resume DIR      continue from DIR's latest complete checkpoint, or from the checkpoint DIR, on any mesh\n";

  /// Checks the combination (after parsing).
  void validate() const {
    WEFT_REQUIRE(dir.empty() == (save_every == 0), weft::ConfigError,
                 dir.empty() ? "--save-every needs --checkpoint DIR (where the checkpoints go)"
                             : "--checkpoint needs --save-every N (how often to write one)");
    WEFT_REQUIRE(keep == 0 || !dir.empty(), weft::ConfigError, "--keep needs --checkpoint DIR");
  }
};

/// The manifest of the checkpoint `path` names (weft::checkpoint::resolve),
/// and its directory.
inline std::pair<std::string, weft::plan::JsonValue> read_manifest(const std::string& path) {
  const std::string dir = weft::checkpoint::resolve(path), file = dir + "/manifest.json";
  std::ifstream f(file);
  WEFT_REQUIRE(f.good(), weft::IoError, "--resume ", path, ": cannot open ", file);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return {dir, weft::plan::parse_json(text, "--resume " + file)};
}

/// The "run" member of a manifest, as saved by train_gpt.
inline const weft::plan::JsonValue& run_of(const weft::plan::JsonValue& m, const std::string& file) {
  const weft::plan::JsonValue* run = m.kind == weft::plan::JsonValue::Kind::object ? m.find("run") : nullptr;
  WEFT_REQUIRE(run && run->kind == weft::plan::JsonValue::Kind::object && run->find("data") && run->find("optimizer"),
               weft::IoError, file, ": no \"run\" object with \"data\" and \"optimizer\" (not written by train_gpt)");
  return *run;
}

/// Fails unless `run` (a manifest's "run") was trained on the same data
/// stream and with the same optimizer as this command line: the data
/// position is a step of one stream, which must stay the same stream.
inline void check_same_run(const weft::plan::JsonValue& run, const std::string& file, const std::string& data,
                           std::uint64_t seed, std::size_t seq, std::size_t batch, const std::string& optimizer) {
  const auto& d = *run.find("data");
  auto str = [&](const char* k) {
    const auto* v = d.find(k);
    return v ? v->string : std::string("?");
  };
  auto num = [&](const weft::plan::JsonValue& o, const char* k) {
    const auto* v = o.find(k);
    return v && v->kind == weft::plan::JsonValue::Kind::number ? v->number : -1.0;
  };
  WEFT_REQUIRE(str("source") == data, weft::ConfigError, "--resume ", file, ": the checkpoint trained on data '", str("source"),
               "', this run on '", data, "'; resume with the same --data");
  WEFT_REQUIRE(num(d, "seed") == double(seed) && num(d, "seq") == double(seq) && num(d, "global_batch") == double(batch),
               weft::ConfigError, "--resume ", file, ": the checkpoint's data stream is --seed ", num(d, "seed"), " --seq ",
               num(d, "seq"), " --batch ", num(d, "global_batch"), ", this run's --seed ", seed, " --seq ", seq, " --batch ",
               batch, "; the data position is a step of that stream, so resume with the same three");
  const auto* opt = run.find("optimizer")->find("name");
  WEFT_REQUIRE(opt && opt->string == optimizer, weft::ConfigError, "--resume ", file, ": the checkpoint's optimizer is ",
               opt ? opt->string : std::string("?"), ", this run's --optimizer ", optimizer);
}

}  // namespace train_gpt_checkpoint
