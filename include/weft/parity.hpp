// Loss-curve parity and run records for programs built on weft: the pieces
// that train_gpt's and custom_model's --baseline and --record need, public so
// that a user's program gets the same checks without copying them.
//
//   weft::LossCurve base = weft::LossCurve::read(path, steps);   // before step 0: a bad file fails at once
//   weft::RecordFile rec(record_path);                           // before step 0: an unwritable place fails at once
//   ... train, collecting one loss per step ...
//   const weft::Parity p = base.compare(losses, tolerance);      // worst relative difference
//   std::puts(p.line("my_train", base.file).c_str());            // "the loss curve follows ..." or "error: ..."
//   rec.write(json);                                             // whole or not at all
//   return p.follows() ? 0 : 1;
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/metrics/json.hpp>
#include <weft/plan/json_read.hpp>

namespace weft {

/// The verdict of a loss curve against a baseline.
struct Parity {
  double worst = 0;      ///< max over the steps of |loss - baseline| / max(|baseline|, 1e-30)
  double tolerance = 0;  ///< the largest worst that passes
  std::size_t steps = 0; ///< steps compared
  /// Whether worst <= tolerance.
  bool follows() const { return worst <= tolerance; }
  /// "<program>: the loss curve follows <file> (worst relative difference W
  /// <= T over N steps)" or "<program>: error: the loss curve departs from
  /// <file>: worst relative difference W > T over N steps".
  std::string line(std::string_view program, std::string_view file) const {
    char buf[160];
    std::snprintf(buf, sizeof buf, follows() ? " (worst relative difference %.3g <= %.3g over %zu steps)"
                                             : ": worst relative difference %.3g > %.3g over %zu steps",
                  worst, tolerance, steps);
    return std::string(program) + (follows() ? ": the loss curve follows " : ": error: the loss curve departs from ") +
           std::string(file) + buf;
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
  /// the option in the messages. Throws ConfigError, naming the file and
  /// what is wrong, when it cannot be opened, is not JSON, has no "loss"
  /// array of numbers, or is shorter than `steps`: call it before step 0,
  /// so that a bad file costs no training.
  static LossCurve read(const std::string& path, std::size_t steps, std::string_view flag = "--baseline") {
    const std::string what = std::string(flag) + " " + path;
    std::ifstream f(path);
    WEFT_REQUIRE(f.good(), ConfigError, what, ": cannot open the file (", std::strerror(errno), ")");
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const plan::JsonValue doc = plan::parse_json(text, what);
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
                 " this run compares; record a longer baseline or run fewer steps");
    return c;
  }

  /// The worst relative difference of `run` (one loss per step run) against
  /// this curve's first run.size() steps, with `tolerance`. Throws
  /// ConfigError when the run has more steps than the curve.
  Parity compare(const std::vector<double>& run, double tolerance) const {
    WEFT_REQUIRE(run.size() <= loss.size(), ConfigError, "weft::LossCurve::compare: the run has ", run.size(),
                 " steps but the baseline ", file, " only ", loss.size());
    Parity p;
    p.tolerance = tolerance;
    p.steps = run.size();
    for (std::size_t i = 0; i < run.size(); ++i) {
      const double d = std::abs(run[i] - loss[i]) / std::max(std::abs(loss[i]), 1e-30);
      p.worst = std::max(p.worst, std::isnan(d) ? HUGE_VAL : d);  // a NaN loss never follows
    }
    return p;
  }
};

/// A run record's file. Constructing it checks that the place can be
/// written (it creates and removes `path`.tmp), so that a wrong path fails
/// before step 0; write() writes the record to `path`.tmp and renames it over
/// `path`, so a reader never sees half a record and an earlier record stays
/// whole until the new one is complete. Default-constructed: no record.
class RecordFile {
 public:
  RecordFile() = default;
  /// Throws ConfigError when `path`.tmp cannot be created (`flag` names the option).
  explicit RecordFile(std::string path, std::string_view flag = "--record") : path_(std::move(path)), flag_(flag) {
    if (path_.empty()) return;
    const std::string tmp = path_ + ".tmp";
    {
      std::ofstream probe(tmp);
      WEFT_REQUIRE(probe.good(), ConfigError, flag_, " ", path_, ": cannot write there (", std::strerror(errno),
                   "); choose a writable path");
    }
    std::remove(tmp.c_str());
  }
  /// Whether a path was given.
  bool active() const { return !path_.empty(); }
  /// The path.
  const std::string& path() const { return path_; }
  /// Writes `rec` (pretty-printed) as the record. Throws ConfigError when the
  /// file cannot be written or renamed; the previous record is then intact.
  void write(const metrics::Json& rec) const {
    if (path_.empty()) return;
    const std::string tmp = path_ + ".tmp";
    {
      std::ofstream f(tmp);
      f << rec.dump(2) << "\n";
      f.flush();
      WEFT_REQUIRE(f.good(), ConfigError, flag_, " ", path_, ": cannot write the record (", std::strerror(errno), ")");
    }
    WEFT_REQUIRE(std::rename(tmp.c_str(), path_.c_str()) == 0, ConfigError, flag_, " ", path_,
                 ": cannot move the finished record into place (", std::strerror(errno), ")");
  }

 private:
  std::string path_;
  std::string flag_ = "--record";
};

}  // namespace weft
