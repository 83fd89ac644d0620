// weft/parity.hpp: the loss-curve baseline and the run record file that
// programs built on weft use for --baseline and --record.
// - LossCurve::read takes a record's "loss" array and refuses, naming the
//   file and the fault, a missing file, text that is not JSON, a record
//   without a loss array, a non-number entry and a curve shorter than the
//   steps to compare;
// - compare gives the worst relative difference (a NaN never follows) and
//   the verdict line;
// - RecordFile refuses an unwritable place when constructed, writes whole
//   records through a temporary it renames (none is left behind), and a
//   written record reads back as a baseline.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <weft/parity.hpp>

#include "weft_test.hpp"

namespace {

std::string scratch(const std::string& name) {
  return "/tmp/weft_test_parity_" + std::to_string(::getpid()) + "_" + name;
}
void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}
bool exists(const std::string& path) { return std::ifstream(path).good(); }
template <class F>
std::string config_error(F f) {
  try {
    f();
  } catch (const weft::ConfigError& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("LossCurve::read takes a record's losses and refuses bad files before any step") {
  if (weft::test::world().rank() != 0) return;
  const std::string good = scratch("good.json");
  write_text(good, R"({"example": "x", "loss": [2.5, 2.0, 1.5]})");
  const auto c = weft::LossCurve::read(good, 3);
  CHECK(c.active());
  CHECK(c.file == good);
  CHECK(c.loss == std::vector<double>{2.5, 2.0, 1.5});
  CHECK(contains(config_error([&] { weft::LossCurve::read(good, 4); }), "has 3 steps, fewer than the 4 this run compares"));
  CHECK(contains(config_error([&] { weft::LossCurve::read(scratch("missing.json"), 1); }), "cannot open the file"));
  const std::string bad = scratch("bad.json");
  write_text(bad, "{\"loss\": [1, 2");
  CHECK(contains(config_error([&] { weft::LossCurve::read(bad, 1); }), "--baseline " + bad));
  write_text(bad, R"({"losses": [1, 2]})");
  CHECK(contains(config_error([&] { weft::LossCurve::read(bad, 1, "--compare"); }), "--compare " + bad + ": no \"loss\" array"));
  write_text(bad, R"({"loss": [1, "two"]})");
  CHECK(contains(config_error([&] { weft::LossCurve::read(bad, 1); }), "loss[1] is not a number"));
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("LossCurve::compare: the worst relative difference, NaN never follows, the verdict line") {
  weft::LossCurve c;
  c.file = "ref.json";
  c.loss = {2.0, 1.0, 0.5};
  const auto p = c.compare({2.0, 1.000001, 0.5}, 1e-5);
  CHECK(std::abs(p.worst - 1e-6) < 1e-12);
  CHECK(p.steps == 3);
  CHECK(p.follows());
  CHECK(p.line("prog", c.file) == "prog: the loss curve follows ref.json (worst relative difference 1e-06 <= 1e-05 over 3 steps)");
  const auto q = c.compare({2.0, 1.5}, 1e-5);
  CHECK(!q.follows());
  CHECK(std::abs(q.worst - 0.5) < 1e-15);
  CHECK(q.line("prog", c.file) == "prog: error: the loss curve departs from ref.json: worst relative difference 0.5 > 1e-05 over 2 steps");
  CHECK(!c.compare({std::nan("")}, 1.0).follows());
  CHECK(contains(config_error([&] { c.compare({1, 2, 3, 4}, 1e-5); }), "the run has 4 steps but the baseline ref.json only 3"));
}

TEST_CASE("RecordFile refuses an unwritable place at once and writes whole records") {
  if (weft::test::world().rank() != 0) return;
  CHECK(contains(config_error([] { weft::RecordFile("/nonexistent-dir/run.json"); }),
                 "--record /nonexistent-dir/run.json: cannot write there"));
  CHECK(!weft::RecordFile().active());
  const std::string path = scratch("record.json");
  weft::RecordFile rec(path);
  CHECK(rec.active());
  CHECK(!exists(path));           // nothing written before write()
  CHECK(!exists(path + ".tmp"));  // the probe is gone
  rec.write(weft::metrics::Json::object().set("loss", std::vector<double>{3.0, 2.0}));
  CHECK(!exists(path + ".tmp"));
  const auto c = weft::LossCurve::read(path, 2);
  CHECK(c.loss == std::vector<double>{3.0, 2.0});
  rec.write(weft::metrics::Json::object().set("loss", std::vector<double>{1.0}));  // replaces the whole record
  CHECK(weft::LossCurve::read(path, 1).loss == std::vector<double>{1.0});
  std::remove(path.c_str());
}
