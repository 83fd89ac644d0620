// Loss-curve parity, run records and the file checks around them, for
// programs built on weft: the pieces that train_gpt's, serve_gpt's and
// custom_model's --baseline and --record use, public so that a user's
// program gets the same checks without copying them.
//
//   weft::LossCurve base = weft::LossCurve::read(path, steps);   // before step 0: a bad file fails at once
//   weft::RecordFile rec(record_path);                           // before step 0: an unwritable place fails at once
//   weft::check_outputs_not_inputs({{"--record", record_path}}, {{"--baseline", path}, {"--data", data}});
//   ... train, collecting one loss per step ...
//   const weft::Parity p = base.compare(losses, tolerance);      // worst relative difference
//   std::puts(p.line("my_train", base.file).c_str());            // "the loss curve follows ..." or "error: ..."
//   rec.write(json);                                             // whole or not at all
//   return p.follows() ? 0 : 1;
//
// A generation program's --baseline is another run's output tokens:
// TokenRecord::read (check_prompts before any work) and TokenParity::compare.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/metrics/json.hpp>
#include <weft/plan/json_read.hpp>

namespace weft {

// ---------------------------------------------------------------------------
// Run identity: which model and data a record or checkpoint belongs to.

/// What identifies a run: pairs of (dotted path in a JSON document, the
/// value expected there as json_text prints it), e.g. {"config.d_model",
/// "32"}. A program lists the fields a --baseline (or a checkpoint to resume)
/// must share with the run before it can be followed.
using RunIdentity = std::vector<std::pair<std::string, std::string>>;

/// A JSON value as text for comparing run identities: a number with 17
/// significant digits ("%.17g": 32 is "32", 0.1 is "0.10000000000000001"),
/// a string as it is, "true"/"false"; "(absent)" for a null pointer and
/// "(not a value)" for null, arrays and objects.
inline std::string json_text(const plan::JsonValue* v) {
  using K = plan::JsonValue::Kind;
  if (!v) return "(absent)";
  if (v->kind == K::number) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v->number);
    return buf;
  }
  if (v->kind == K::string) return v->string;
  if (v->kind == K::boolean) return v->boolean ? "true" : "false";
  return "(not a value)";
}

/// A number as json_text prints it ("%.17g"): what a RunIdentity holds for
/// a numeric field.
inline std::string value_text(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

/// The value at a dotted path ("config.d_model": member d_model of member
/// config) of `doc`, or null when a step of the path is missing or not an
/// object.
inline const plan::JsonValue* json_at(const plan::JsonValue& doc, const std::string& path) {
  const plan::JsonValue* v = &doc;
  std::size_t start = 0;
  while (v && start <= path.size()) {
    const std::size_t dot = std::min(path.find('.', start), path.size());
    v = v->kind == plan::JsonValue::Kind::object ? v->find(path.substr(start, dot - start)) : nullptr;
    start = dot + 1;
  }
  return v;
}

/// The fields of `want` whose value in `doc` differs, joined as
/// "config.d_model 64 there, 32 in this run, ..." in want's order (empty:
/// none differs). A field absent from `doc` is not compared: records
/// written before a field existed still match.
inline std::string identity_differences(const plan::JsonValue& doc, const RunIdentity& want) {
  std::string out;
  for (const auto& [path, value] : want) {
    const plan::JsonValue* v = json_at(doc, path);
    if (!v) continue;
    const std::string there = json_text(v);
    if (there != value) out += (out.empty() ? "" : ", ") + path + " " + there + " there, " + value + " in this run";
  }
  return out;
}

// ---------------------------------------------------------------------------
// Output files: checked before step 0, written whole or not at all.

/// A path given by a flag: (the flag, e.g. "--record"; its value, empty
/// when not given).
using FlagPath = std::pair<std::string, std::string>;

/// True when `a` and `b` name the same existing file (the same device and
/// inode, whatever the spelling: links, "./", ".."); false when either is
/// empty or does not exist.
inline bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  std::error_code ec;
  const bool same = std::filesystem::equivalent(a, b, ec);
  return !ec && same;
}

/// Refuses an output that is the same file as an input (same_file), since
/// the run would overwrite what the user gave it: throws ConfigError
/// "<oflag> <opath> is the same file as <iflag> <ipath> (the same device and
/// inode); writing it would destroy that input. Give <oflag> another path".
/// Pairs with an empty path are skipped.
inline void check_outputs_not_inputs(const std::vector<FlagPath>& outputs, const std::vector<FlagPath>& inputs) {
  for (const auto& [oflag, opath] : outputs)
    for (const auto& [iflag, ipath] : inputs)
      WEFT_REQUIRE(!same_file(opath, ipath), ConfigError, oflag, " ", opath, " is the same file as ", iflag, " ", ipath,
                   " (the same device and inode); writing it would destroy that input. Give ", oflag,
                   " another path");
}

/// The directory a file path lives in: the text before its last '/', "/"
/// for "/name", "." for a bare name.
inline std::string directory_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

/// Creates a probe file in `dir` (the directory of the output `flag`
/// `path`), writes 4 bytes and removes it, so that a directory that cannot
/// take a new file (read-only file system, permissions, no inodes, no
/// space) is found now, with the system's reason, and not when the output
/// is written. Throws ConfigError "<flag> <path>: cannot create a file in
/// <dir> (<reason>); ..." or "... cannot write a file in <dir> ...".
inline void probe_directory(const std::string& flag, const std::string& path, const std::string& dir) {
  const std::string probe = dir + "/.weft-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  const int e = errno;
  WEFT_REQUIRE(fd >= 0, ConfigError, flag, " ", path, ": cannot create a file in ", dir, " (", std::strerror(e),
               "); give a directory this run may write in");
  const bool wrote = ::write(fd, "weft", 4) == 4;
  const int we = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  WEFT_REQUIRE(wrote, ConfigError, flag, " ", path, ": cannot write a file in ", dir, " (", std::strerror(we),
               "); give a directory with space this run may write in");
}

/// Checks that the output file `path` (given by `flag`) can be written the
/// way write_file_whole writes it: an existing regular file this process
/// may write, or a new name in an existing directory; in both cases the
/// directory must take a new file (probe_directory). Throws ConfigError
/// naming the flag, the path and the fix: "is a directory", "is not a
/// regular file", "cannot write the file (<reason>)", "the directory <dir>
/// does not exist; create it first or write the record elsewhere", or
/// probe_directory's sentences. Leaves nothing behind.
inline void check_output_file(const std::string& flag, const std::string& path) {
  struct stat st {};
  const std::string dir = directory_of(path);
  if (::stat(path.c_str(), &st) == 0) {
    WEFT_REQUIRE(S_ISREG(st.st_mode), ConfigError, flag, " ", path, ": is ",
                 S_ISDIR(st.st_mode) ? "a directory" : "not a regular file", "; give a file name");
    WEFT_REQUIRE(::access(path.c_str(), W_OK) == 0, ConfigError, flag, " ", path, ": cannot write the file (",
                 std::strerror(errno), ")");
  } else {
    WEFT_REQUIRE(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), ConfigError, flag, " ", path,
                 ": the directory ", dir, " does not exist; create it first or write the record elsewhere");
  }
  probe_directory(flag, path, dir);
}

/// Writes `text` to `path` (given by `flag`) whole or not at all: into
/// "<path>.tmp-<pid>" beside it, flushed to the disk (fsync), then renamed
/// over `path`. A write that fails (a full disk, a quota) throws IoError
/// "<flag> <path>: writing failed (<reason>); nothing was left behind" and
/// removes the temporary file: neither a half-written nor an empty file is
/// left, and an existing file at `path` stays as it was.
inline void write_file_whole(const std::string& flag, const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  WEFT_REQUIRE(fd >= 0, IoError, flag, " ", path, ": cannot create ", tmp, " (", std::strerror(errno), ")");
  std::string why;
  for (std::size_t done = 0; done < text.size() && why.empty();) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w > 0) done += std::size_t(w);
    else if (w < 0 && errno == EINTR) continue;
    else why = w < 0 ? std::strerror(errno) : "no byte written";
  }
  if (why.empty() && ::fsync(fd) != 0) why = std::strerror(errno);
  if (::close(fd) != 0 && why.empty()) why = std::strerror(errno);
  if (why.empty() && ::rename(tmp.c_str(), path.c_str()) != 0) why = std::strerror(errno);
  if (!why.empty()) {
    ::unlink(tmp.c_str());
    detail::throw_error<IoError>(flag, " ", path, ": writing failed (", why, "); nothing was left behind");
  }
}

/// A run record's file. Constructing it runs check_output_file, so that a
/// wrong path fails before step 0; write() writes the record with
/// write_file_whole, so a reader never sees half a record and an earlier
/// record stays whole until the new one is complete. Default-constructed
/// (or constructed with an empty path): no record, and write() does nothing.
class RecordFile {
 public:
  RecordFile() = default;
  /// Throws ConfigError (check_output_file) when `path` cannot be written;
  /// `flag` names the option in the messages.
  explicit RecordFile(std::string path, std::string_view flag = "--record") : path_(std::move(path)), flag_(flag) {
    if (!path_.empty()) check_output_file(flag_, path_);
  }
  /// Whether a path was given.
  bool active() const { return !path_.empty(); }
  /// The path.
  const std::string& path() const { return path_; }
  /// Writes `rec` as the record, dumped with `indent` (metrics::Json::dump)
  /// and a final newline. Throws IoError when the file cannot be written or
  /// renamed; the previous record is then intact and no temporary is left.
  void write(const metrics::Json& rec, int indent = 2) const {
    if (!path_.empty()) write_file_whole(flag_, path_, rec.dump(indent) + "\n");
  }

 private:
  std::string path_;
  std::string flag_ = "--record";
};

namespace detail {
/// The whole text of the file at `path`; ConfigError "WHAT: cannot open the
/// file (reason)" when it cannot be opened (`what`: the flag and the path).
inline std::string file_text(const std::string& what, const std::string& path) {
  std::ifstream f(path);
  WEFT_REQUIRE(f.good(), ConfigError, what, ": cannot open the file (", std::strerror(errno), ")");
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
}  // namespace detail

// ---------------------------------------------------------------------------
// Loss-curve parity.

/// The verdict of a loss curve against a baseline.
struct Parity {
  double worst = 0;            ///< max over the steps of |loss - baseline| / max(|baseline|, 1e-30); +inf for a NaN loss
  double tolerance = 0;        ///< the largest worst that passes
  std::size_t steps = 0;       ///< steps compared
  std::size_t worst_step = 0;  ///< the step (as the baseline counts them) where worst was reached (the first such)
  double run_at_worst = 0;     ///< this run's loss at worst_step
  double baseline_at_worst = 0;///< the baseline's loss at worst_step
  /// Whether worst <= tolerance.
  bool follows() const { return worst <= tolerance; }
  /// "<program>: the loss curve follows <file> (worst relative difference W
  /// <= T over N steps)" or "<program>: error: the loss curve departs from
  /// <file>: worst relative difference W > T over N steps (step S: loss A,
  /// baseline B)" (A and B with 9 significant digits).
  std::string line(std::string_view program, std::string_view file) const {
    char buf[240];
    if (follows())
      std::snprintf(buf, sizeof buf, " (worst relative difference %.3g <= %.3g over %zu steps)", worst, tolerance, steps);
    else
      std::snprintf(buf, sizeof buf, ": worst relative difference %.3g > %.3g over %zu steps (step %zu: loss %.9g, baseline %.9g)",
                    worst, tolerance, steps, worst_step, run_at_worst, baseline_at_worst);
    return std::string(program) + (follows() ? ": the loss curve follows " : ": error: the loss curve departs from ") +
           std::string(file) + buf;
  }
  /// The verdict as a run record's "loss_parity" object (docs/records.md):
  /// baseline (`file`), steps_compared, max_relative_difference (null for a
  /// NaN loss), worst_step, tolerance, pass, definition.
  metrics::Json json(const std::string& file) const {
    return metrics::Json::object()
        .set("baseline", file)
        .set("steps_compared", metrics::Json(double(steps)))
        .set("max_relative_difference", worst)
        .set("worst_step", metrics::Json(double(worst_step)))
        .set("tolerance", tolerance)
        .set("pass", follows())
        .set("definition", "per step |loss - baseline| / |baseline|, steps 0..steps_compared-1");
  }
};

/// A loss curve to follow: the "loss" array of a run record (one number per
/// optimizer step, as train_gpt's and custom_model's --record write it).
struct LossCurve {
  std::string file;          ///< where it was read from (empty: no baseline)
  std::vector<double> loss;  ///< the loss of each step

  /// Whether a curve was read.
  bool active() const { return !loss.empty(); }

  /// Reads the "loss" array of the JSON record at `path`, which must hold at
  /// least `steps` numbers (the steps the run will compare). `flag` names
  /// the option in the messages. When `identity` is given, the record must
  /// also be one of the same run (identity_differences is empty): a curve of
  /// another model cannot be followed, and finding that after the whole run
  /// as a loss difference would hide why. Throws ConfigError, naming the
  /// flag, the file and what is wrong, when it cannot be opened, is not JSON,
  /// is a record of another run, has no non-empty "loss" array of numbers,
  /// or is shorter than `steps`: call it before step 0, so that a bad file
  /// costs no training.
  static LossCurve read(const std::string& path, std::size_t steps, std::string_view flag = "--baseline",
                        const RunIdentity& identity = {}) {
    const std::string what = std::string(flag) + " " + path;
    const plan::JsonValue doc = plan::parse_json(detail::file_text(what, path), what);
    const std::string diff = identity_differences(doc, identity);
    WEFT_REQUIRE(diff.empty(), ConfigError, what, " is a record of another model or data (", diff,
                 "); its loss curve cannot be followed. Give the record of a run of this model on this data");
    const plan::JsonValue* l = doc.kind == plan::JsonValue::Kind::object ? doc.find("loss") : nullptr;
    WEFT_REQUIRE(l && l->kind == plan::JsonValue::Kind::array && !l->array.empty(), ConfigError, what,
                 ": no \"loss\" array found; expected a run record (--record) with one loss per step");
    LossCurve c;
    c.file = path;
    for (std::size_t i = 0; i < l->array.size(); ++i) {
      WEFT_REQUIRE(l->array[i].kind == plan::JsonValue::Kind::number, ConfigError, what, ": loss[", i,
                   "] is not a number");
      c.loss.push_back(l->array[i].number);
    }
    WEFT_REQUIRE(c.loss.size() >= steps, ConfigError, what, " has ", c.loss.size(), " steps, fewer than the ", steps,
                 " this run compares; record a longer baseline or run --steps ", c.loss.size());
    return c;
  }

  /// The worst relative difference of `run` against this curve, with
  /// `tolerance`: run[i] is compared with loss[first + i] (`first` > 0 for a
  /// run resumed at step `first`, whose losses start there). Throws
  /// ConfigError when the curve has fewer than first + run.size() steps.
  Parity compare(const std::vector<double>& run, double tolerance, std::size_t first = 0) const {
    WEFT_REQUIRE(first + run.size() <= loss.size(), ConfigError, "weft::LossCurve::compare: the run has ",
                 first + run.size(), " steps but the baseline ", file, " only ", loss.size());
    Parity p;
    p.tolerance = tolerance;
    p.steps = run.size();
    for (std::size_t i = 0; i < run.size(); ++i) {
      const double base = loss[first + i];
      double d = std::abs(run[i] - base) / std::max(std::abs(base), 1e-30);
      if (std::isnan(d)) d = HUGE_VAL;  // a NaN loss never follows
      if (i == 0 || d > p.worst) {
        p.worst = d;
        p.worst_step = first + i;
        p.run_at_worst = run[i];
        p.baseline_at_worst = base;
      }
    }
    return p;
  }
};

// ---------------------------------------------------------------------------
// Token parity: a generation run's output tokens against another run's.

/// The requests of a token record: each request's prompt and its output
/// tokens, in request order, as serve_gpt's --record writes them (the
/// top-level "prompts" and "outputs" arrays of arrays of token ids, and
/// "traffic.prompts_file" when the prompts came from a file). A rejected
/// request has an empty output.
struct TokenRecord {
  std::string file;                               ///< where it was read from (empty: no baseline)
  std::vector<std::vector<int>> prompts, outputs;  ///< per request: the prompt's and the output's token ids
  std::string prompts_file;                       ///< its "traffic.prompts_file", if any

  /// Whether a record was read.
  bool active() const { return !file.empty(); }

  /// How to serve the record's requests again, for a message: "--prompts
  /// FILE as it did", or "its --requests, --seed and --prompt-* flags" when
  /// its prompts were drawn.
  std::string how() const {
    return prompts_file.empty() ? "its --requests, --seed and --prompt-* flags" : "--prompts " + prompts_file + " as it did";
  }

  /// Parses `text`, the contents of the record at `path` (read by one rank
  /// and shared, or read here with read()). `flag` and `path` name it in the
  /// messages, and `writer` is the program whose --record it must be. Throws
  /// ConfigError when the text is not JSON, has no "prompts" or "outputs"
  /// array (a record from before prompts were recorded is named so), an
  /// entry that is not an array of token ids (integers in [0, 2^31)), or
  /// different numbers of prompts and outputs.
  static TokenRecord parse(const std::string& text, const std::string& path, std::string_view flag = "--baseline",
                           std::string_view writer = "serve_gpt") {
    using plan::JsonValue;
    const std::string what = std::string(flag) + " " + path;
    const JsonValue doc = plan::parse_json(text, what);
    auto tokens = [&](const char* key) {
      const JsonValue* a = doc.kind == JsonValue::Kind::object ? doc.find(key) : nullptr;
      WEFT_REQUIRE(a && a->kind == JsonValue::Kind::array, ConfigError, what, ": no \"", key,
                   "\" array found; expected a record written by ", writer, " --record",
                   std::string_view(key) == "prompts" && doc.kind == JsonValue::Kind::object && doc.find("outputs")
                       ? std::string(" (a record from before ") + std::string(writer) +
                             " recorded its prompts: record the baseline run again)"
                       : std::string());
      std::vector<std::vector<int>> out;
      for (std::size_t i = 0; i < a->array.size(); ++i) {
        const JsonValue& r = a->array[i];
        WEFT_REQUIRE(r.kind == JsonValue::Kind::array, ConfigError, what, ": ", key, "[", i, "] is not an array of token ids");
        out.emplace_back();
        for (std::size_t k = 0; k < r.array.size(); ++k) {
          const JsonValue& t = r.array[k];
          WEFT_REQUIRE(t.kind == JsonValue::Kind::number && t.number >= 0 && t.number < 2147483648.0 &&
                           t.number == std::floor(t.number),
                       ConfigError, what, ": ", key, "[", i, "][", k, "] is not a token id");
          out.back().push_back(int(t.number));
        }
      }
      return out;
    };
    TokenRecord b;
    b.file = path;
    b.outputs = tokens("outputs");
    b.prompts = tokens("prompts");
    if (const JsonValue* t = doc.find("traffic"); t && t->kind == JsonValue::Kind::object)
      if (const JsonValue* f = t->find("prompts_file"); f && f->kind == JsonValue::Kind::string) b.prompts_file = f->string;
    WEFT_REQUIRE(b.prompts.size() == b.outputs.size(), ConfigError, what, ": ", b.prompts.size(), " prompts but ",
                 b.outputs.size(), " outputs; the record is damaged");
    return b;
  }

  /// parse() of the file at `path`; ConfigError when it cannot be opened.
  static TokenRecord read(const std::string& path, std::string_view flag = "--baseline", std::string_view writer = "serve_gpt") {
    return parse(detail::file_text(std::string(flag) + " " + path, path), path, flag, writer);
  }

  /// Checks, before any work, that this run's requests are the record's:
  /// as many, and request by request the same prompt token for token.
  /// Outputs of other prompts cannot be compared, so a difference throws
  /// ConfigError naming the request, the first differing token (or "the end
  /// (N tokens)" of the shorter prompt) on both sides, and how() to serve
  /// the record's requests.
  void check_prompts(const std::vector<std::vector<int>>& run, std::string_view flag = "--baseline") const {
    WEFT_REQUIRE(prompts.size() == run.size(), ConfigError, flag, " ", file, " has ", prompts.size(), " requests, this run ",
                 run.size(), "; serve the baseline's requests (", how(), ")");
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const auto& mine = run[i];
      const auto& theirs = prompts[i];
      std::size_t k = 0;
      while (k < mine.size() && k < theirs.size() && mine[k] == theirs[k]) ++k;
      if (k == mine.size() && k == theirs.size()) continue;
      const auto tok = [](const std::vector<int>& v, std::size_t j) {
        return j < v.size() ? std::to_string(v[j]) : "the end (" + std::to_string(v.size()) + " tokens)";
      };
      detail::throw_error<ConfigError>(flag, " ", file, ": the prompt of request ", i, " differs at token ", k, ": this run's ",
                                       tok(mine, k), ", the baseline's ", tok(theirs, k),
                                       "; the outputs of other prompts cannot be compared. Serve the baseline's requests (",
                                       how(), ")");
    }
  }
};

/// The verdict of a run's output tokens against a TokenRecord: request by
/// request in request order, token by token, up to the first difference.
struct TokenParity {
  bool match = true;           ///< every request's output equals the record's
  std::size_t requests = 0;    ///< requests compared
  std::size_t tokens = 0;      ///< tokens equal before the first difference (all of them when match)
  std::size_t request = 0;     ///< the first differing request (when !match)
  std::size_t position = 0;    ///< the first differing token of that request
  std::string mine, theirs;    ///< what stands there on each side, in words

  /// Compares `run` (this run's output tokens per request) with `record`'s
  /// outputs. `rejected_why[i]`, when given and not empty, says why this run
  /// rejected request i (its output is then empty), for the message. Throws
  /// ConfigError when the numbers of requests differ (check_prompts refuses
  /// that before any work).
  static TokenParity compare(const std::vector<std::vector<int>>& run, const TokenRecord& record,
                             const std::vector<std::string>& rejected_why = {}) {
    WEFT_REQUIRE(run.size() == record.outputs.size(), ConfigError, "weft::TokenParity::compare: the run has ", run.size(),
                 " requests but the baseline ", record.file, " ", record.outputs.size());
    TokenParity p;
    p.requests = run.size();
    for (std::size_t i = 0; i < run.size(); ++i) {
      const auto& mine = run[i];
      const auto& theirs = record.outputs[i];
      std::size_t k = 0;
      while (k < mine.size() && k < theirs.size() && mine[k] == theirs[k]) ++k;
      p.tokens += k;
      if (k == mine.size() && k == theirs.size()) continue;
      p.match = false;
      p.request = i;
      p.position = k;
      const bool rejected = i < rejected_why.size() && !rejected_why[i].empty();
      p.mine = k < mine.size() ? "this run's token is " + std::to_string(mine[k])
               : rejected      ? "this run rejected it (" + rejected_why[i] + ")"
                               : "this run's output ends there (" + std::to_string(mine.size()) + " tokens)";
      p.theirs = k < theirs.size() ? "the baseline's is " + std::to_string(theirs[k])
                 : theirs.empty()  ? std::string("the baseline has no tokens (rejected there)")
                                   : "the baseline's ends there (" + std::to_string(theirs.size()) + " tokens)";
      break;
    }
    return p;
  }

  /// "<program>: the outputs match --baseline <file>: R requests, N tokens
  /// identical" or "<program>: error: the outputs differ from --baseline
  /// <file> at request I, token K: <mine>, <theirs> (the N tokens before it,
  /// in request order, are identical)".
  std::string line(std::string_view program, std::string_view file, std::string_view flag = "--baseline") const {
    std::string s(program);
    if (match)
      return s + ": the outputs match " + std::string(flag) + " " + std::string(file) + ": " + std::to_string(requests) +
             " requests, " + std::to_string(tokens) + " tokens identical";
    return s + ": error: the outputs differ from " + std::string(flag) + " " + std::string(file) + " at request " +
           std::to_string(request) + ", token " + std::to_string(position) + ": " + mine + ", " + theirs + " (the " +
           std::to_string(tokens) + " tokens before it, in request order, are identical)";
  }

  /// The verdict as a record's "baseline" object (docs/serving.md): file,
  /// requests, match, identical_tokens, first_difference ({request, token},
  /// or null when the outputs match).
  metrics::Json json(const std::string& file) const {
    return metrics::Json::object()
        .set("file", file)
        .set("requests", requests)
        .set("match", match)
        .set("identical_tokens", tokens)
        .set("first_difference", match ? metrics::Json()
                                       : metrics::Json::object().set("request", request).set("token", position));
  }
};

}  // namespace weft
