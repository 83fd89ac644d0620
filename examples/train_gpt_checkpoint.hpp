// train_gpt's checkpoints: the flags --checkpoint DIR --save-every N
// [--keep K] --resume DIR, what a checkpoint's manifest records about the run
// (mesh, strategy, data position, RNG, optimizer), and the checks that a
// resumed run continues the same training (docs/checkpoint.md).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <weft/checkpoint/checkpoint.hpp>
#include <weft/precision/loss_scale.hpp>
#include <weft/metrics/json.hpp>
#include <weft/plan/json_read.hpp>

#include "train_gpt_checks.hpp"

namespace train_gpt_checkpoint {

/// The checkpoint flags.
struct Flags {
  std::string dir;            ///< --checkpoint: the root the checkpoints go under
  std::string resume;         ///< --resume: a root (its latest complete checkpoint) or one checkpoint's directory
  std::size_t save_every = 0;  ///< --save-every: steps between checkpoints
  std::size_t keep = 0;        ///< --keep: complete checkpoints kept (0: all)
  bool overwrite = false;      ///< --overwrite-checkpoint: DIR may hold another run's checkpoints; they are deleted first

  /// The usage lines.
  static constexpr const char* usage =
      "  --checkpoint DIR  write checkpoints under DIR (DIR/step-NNNNNNNN, docs/checkpoint.md); needs --save-every\n"
      "  --save-every N    a checkpoint after every N steps\n"
      "  --keep K          keep the newest K checkpoints under DIR (0: all)\n"
      "  --resume DIR      continue from DIR's latest complete checkpoint, or from the checkpoint DIR, on any mesh\n"
      "  --overwrite-checkpoint  --checkpoint DIR may hold another run's checkpoints (another model, data, seed or\n"
      "                    schedule): they are deleted before step 0 (without it such a DIR is refused)\n";

  /// Checks the combination (after parsing).
  void validate() const {
    WEFT_REQUIRE(dir.empty() == (save_every == 0), weft::ConfigError,
                 dir.empty() ? "--save-every needs --checkpoint DIR (where the checkpoints go)"
                             : "--checkpoint needs --save-every N (how often to write one)");
    WEFT_REQUIRE(keep == 0 || !dir.empty(), weft::ConfigError, "--keep needs --checkpoint DIR");
    WEFT_REQUIRE(!overwrite || !dir.empty(), weft::ConfigError, "--overwrite-checkpoint needs --checkpoint DIR");
  }
};

/// A manifest's parsed JSON (`file`: its path).
inline weft::plan::JsonValue parse_manifest(const std::string& file, const std::string& what) {
  std::ifstream f(file);
  WEFT_REQUIRE(f.good(), weft::IoError, what, ": cannot open ", file, " (", std::strerror(errno), ")");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return weft::plan::parse_json(text, what + " " + file);
}

/// The "run" fields (dotted paths, e.g. "model.d_model") that make a
/// checkpoint another run's: the model and the data stream always, the
/// schedule and the optimizer too for a run that starts afresh (a resumed
/// run may change them). The values as weft::json_text prints them.
using Identity = weft::RunIdentity;

/// Checks --checkpoint DIR before step 0 (rank 0; `prepare`: not under
/// --check, which changes nothing): DIR, when it exists, must be a
/// directory; when it holds complete checkpoints, the newest must be of this
/// run (`identity`), else the run is refused naming the differences, unless
/// --overwrite-checkpoint, which deletes the step-N directories under DIR
/// first. With `prepare`, DIR is created (with its parents) and a probe file
/// written in it and removed, so that a directory that cannot be written is
/// found now, with the system's reason, not at the first save.
inline void check_root(const Flags& f, const Identity& identity, bool prepare) {
  namespace fs = std::filesystem;
  if (f.dir.empty()) return;
  std::error_code ec;
  const auto status = fs::status(f.dir, ec);
  const bool exists = fs::exists(status);
  WEFT_REQUIRE(!exists || fs::is_directory(status), weft::ConfigError, "--checkpoint ", f.dir,
               ": exists and is not a directory; give a directory (it is created when missing)");
  if (exists) {
    const auto all = weft::checkpoint::detail::complete_checkpoints(f.dir);
    if (!all.empty()) {
      const std::string mfile = all.back().second + "/manifest.json";
      const weft::plan::JsonValue m = parse_manifest(mfile, "--checkpoint " + f.dir);
      const weft::plan::JsonValue* run = m.kind == weft::plan::JsonValue::Kind::object ? m.find("run") : nullptr;
      const std::string diff = run ? weft::identity_differences(*run, identity)
                                   : std::string("its manifest has no \"run\" (not written by train_gpt)");
      if (!diff.empty()) {
        WEFT_REQUIRE(f.overwrite, weft::ConfigError, "--checkpoint ", f.dir, " holds the checkpoints of another run (",
                     all.size(), " of them; the newest, ", all.back().second, ": ", diff,
                     "); this run would replace them step by step and leave a directory that mixes two runs. Give "
                     "another --checkpoint directory, --resume ", f.dir, " to continue that run, or "
                     "--overwrite-checkpoint to delete them first");
        if (prepare)
          for (const auto& [step, dir] : all) {
            (void)step;
            fs::remove_all(dir, ec);
            WEFT_REQUIRE(!ec, weft::IoError, "--overwrite-checkpoint: cannot delete ", dir, " (", ec.message(), ")");
          }
      }
    }
  }
  if (!prepare) return;
  fs::create_directories(f.dir, ec);
  WEFT_REQUIRE(!ec, weft::ConfigError, "--checkpoint ", f.dir, ": cannot create the directory (", ec.message(),
               "); give a directory this run may write in");
  const std::string probe = f.dir + "/.weft-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  const int e = errno;
  WEFT_REQUIRE(fd >= 0, weft::ConfigError, "--checkpoint ", f.dir, ": cannot create a file in it (", std::strerror(e),
               "); give a directory this run may write in");
  const bool wrote = ::write(fd, "weft", 4) == 4;
  const int we = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  WEFT_REQUIRE(wrote, weft::ConfigError, "--checkpoint ", f.dir, ": cannot write a file in it (", std::strerror(we),
               "); give a directory with space this run may write in");
}

/// Says what a --resume of the root `path` resumes, before step 0 (rank 0).
/// A root whose complete checkpoints are of different runs (the model, the
/// data stream, the schedule or the optimizer of one differ from the
/// newest's) is refused, naming both; the newest would continue one of them
/// without a word. Returns a note for the user (empty: nothing to say) when
/// newer saves than the one resumed did not complete -- a step-N directory
/// without a manifest, or a .tmp-step-N left by an interrupted save -- so
/// that a resume from an older step than the newest says why.
/// `path` naming one checkpoint's directory is taken as it is.
inline std::string check_resume_root(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty() || weft::checkpoint::detail::exists(path + "/manifest.json")) return {};
  const auto all = weft::checkpoint::detail::complete_checkpoints(path);
  if (all.empty()) return {};  // load() names it
  const weft::plan::JsonValue newest = parse_manifest(all.back().second + "/manifest.json", "--resume " + path);
  const weft::plan::JsonValue* nrun = newest.find("run");
  if (nrun && all.size() > 1) {
    Identity id;
    for (const char* k : {"model.layers", "model.d_model", "model.heads", "model.kv_heads", "model.vocab", "model.seq",
                          "model.norm", "model.mlp", "model.position", "model.experts", "data.source", "data.seed",
                          "data.global_batch", "schedule.lr", "schedule.warmup", "schedule.clip", "optimizer.name"})
      if (const auto* v = weft::json_at(*nrun, k)) id.emplace_back(k, weft::json_text(v));
    for (std::size_t i = 0; i + 1 < all.size(); ++i) {
      const weft::plan::JsonValue m = parse_manifest(all[i].second + "/manifest.json", "--resume " + path);
      const weft::plan::JsonValue* run = m.find("run");
      const std::string diff = run ? weft::identity_differences(*run, id) : std::string();
      std::string d = diff;  // "X there, Y in this run": here "there" is the older one, "this run" the newest
      for (std::size_t at; (at = d.find(" in this run")) != std::string::npos;) d.replace(at, 12, " in the newest");
      WEFT_REQUIRE(diff.empty(), weft::ConfigError, "--resume ", path, " mixes the checkpoints of different runs: ",
                   all[i].second, " and the newest, ", all.back().second, ", differ (", d,
                   "); give the checkpoint to resume from itself (--resume ", all.back().second, ")");
    }
  }
  // Newer saves that did not complete: a step-N without a manifest (a
  // damaged or hand-made directory) and a .tmp-step-N (a save that was
  // interrupted: a rank stopped or died, the disk filled).
  std::string incomplete, unfinished;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    std::string n = e.path().filename().string();
    const bool tmp = n.rfind(".tmp-", 0) == 0;
    if (tmp) n = n.substr(5);
    if (n.size() != 13 || n.rfind("step-", 0) != 0 || n.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    const std::size_t step = std::stoull(n.substr(5));
    if (step <= all.back().first) continue;
    if (tmp) unfinished += (unfinished.empty() ? "" : ", ") + std::to_string(step) + " (" + e.path().string() + ")";
    else if (!fs::exists(e.path() / "manifest.json")) incomplete += (incomplete.empty() ? "" : ", ") + e.path().string();
  }
  if (incomplete.empty() && unfinished.empty()) return {};
  std::string why;
  if (!incomplete.empty()) why = "the newer " + incomplete + " has no manifest.json (an incomplete or damaged save) and is not read";
  if (!unfinished.empty())
    why += (why.empty() ? "" : "; ") + std::string("the save of step ") + unfinished +
           " did not finish (interrupted: a rank stopped or died, or the disk filled) and is not read";
  return "resuming from " + all.back().second + ", the newest complete checkpoint: " + why;
}

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

/// The manifest's (and the record's) "loss_scale" object of an fp16 run: the
/// scaler's settings and the state the next step starts from.
inline weft::metrics::Json loss_scale_json(const weft::DynamicLossScaler& scaler) {
  const auto& o = scaler.options();
  const auto& st = scaler.state();
  using weft::metrics::Json;
  return Json::object()
      .set("initial", o.initial_scale).set("min", o.min_scale).set("growth_interval", Json(long(o.growth_interval)))
      .set("hysteresis", Json(long(o.hysteresis))).set("growth_factor", o.growth_factor)
      .set("backoff_factor", o.backoff_factor).set("scale", st.scale)
      .set("growth_tracker", Json(long(st.growth_tracker))).set("hysteresis_tracker", Json(long(st.hysteresis_tracker)))
      .set("skipped_steps", Json(long(st.skipped_steps)));
}

/// --resume of an fp16 run: the scaler continues from the checkpoint's
/// "run.loss_scale" state, so the resumed run takes the same scales as the
/// uninterrupted one. A checkpoint of an fp32 or bf16 run has none: the
/// scaler starts from --loss-scale, and rank 0 (`say`) prints so.
inline void restore_loss_scale(weft::DynamicLossScaler& scaler, const weft::plan::JsonValue& manifest,
                               const std::string& file, bool say) {
  const weft::plan::JsonValue* ls = run_of(manifest, file).find("loss_scale");
  if (!ls || ls->kind != weft::plan::JsonValue::Kind::object) {
    if (say)
      std::printf("train_gpt: %s holds no loss-scaler state (not an fp16 run): the scale starts at %.0f\n", file.c_str(),
                  scaler.scale());
    return;
  }
  auto num = [&](const char* k) {
    const auto* v = ls->find(k);
    WEFT_REQUIRE(v && v->kind == weft::plan::JsonValue::Kind::number, weft::IoError, "--resume ", file,
                 ": run.loss_scale has no number \"", k, "\"");
    return v->number;
  };
  const auto& o = scaler.options();
  WEFT_REQUIRE(num("min") == o.min_scale && num("growth_interval") == double(o.growth_interval) &&
                   num("hysteresis") == double(o.hysteresis) && num("growth_factor") == o.growth_factor &&
                   num("backoff_factor") == o.backoff_factor,
               weft::ConfigError, "--resume ", file, ": the checkpoint's loss scaler has other settings (min ", num("min"),
               ", growth interval ", num("growth_interval"), ", hysteresis ", num("hysteresis"), ", factors ",
               num("growth_factor"), " and ", num("backoff_factor"), ") than this run's");
  weft::LossScaleState st;
  st.scale = num("scale");
  st.growth_tracker = std::int64_t(num("growth_tracker"));
  st.hysteresis_tracker = std::int64_t(num("hysteresis_tracker"));
  st.skipped_steps = std::int64_t(num("skipped_steps"));
  scaler.set_state(st);  // ConfigError for a state these settings cannot produce
}

}  // namespace train_gpt_checkpoint
