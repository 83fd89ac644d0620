// weft/parity.hpp: the loss-curve baseline and the run record file that
// programs built on weft use for --baseline and --record.
// - LossCurve::read takes a record's "loss" array and refuses, naming the
//   file and the fault, a missing file, text that is not JSON, a record
//   without a loss array, a non-number entry and a curve shorter than the
//   steps to compare;
// - compare gives the worst relative difference (a NaN never follows) and
//   the verdict line;
// - read with a RunIdentity refuses a record of another run, naming the
//   fields that differ, and ignores fields the record lacks;
// - compare with `first` compares a resumed run's losses with the same steps
//   of the curve and names the worst step; Parity::json is the record's
//   "loss_parity" object;
// - RecordFile (check_output_file) refuses a directory, a missing directory
//   and a directory that cannot take a file when constructed, writes whole
//   records through a temporary it renames (none is left behind), and a
//   written record reads back as a baseline; write_file_whole throws IoError
//   and leaves nothing when it cannot write;
// - check_outputs_not_inputs refuses an output that is an input under
//   another spelling, and json_at / json_text / value_text read identities;
// - TokenRecord::parse takes a generation record's prompts and outputs and
//   refuses, naming the entry, what is not one; check_prompts refuses other
//   requests before any work; TokenParity::compare names the first
//   differing token (a longer, shorter or rejected output too), and its
//   line and json are the verdict and the record's "baseline" object.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/stat.h>
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
std::size_t files_in(const std::string& dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

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
  write_text(bad, R"({"loss": []})");
  CHECK(contains(config_error([&] { weft::LossCurve::read(bad, 0); }), "no \"loss\" array found"));
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("LossCurve::read with a run identity refuses a record of another run before any step") {
  if (weft::test::world().rank() != 0) return;
  const std::string rec = scratch("identity.json");
  write_text(rec, R"({"config": {"d_model": 64, "data": "corpus.txt", "lr": 0.1}, "loss": [2.5, 2.0]})");
  const weft::RunIdentity same = {{"config.d_model", weft::value_text(64)}, {"config.data", "corpus.txt"},
                                  {"config.lr", weft::value_text(0.1)}, {"config.seed", "7"}};  // seed: absent there
  CHECK(weft::LossCurve::read(rec, 2, "--baseline", same).loss.size() == 2);
  const weft::RunIdentity other = {{"config.d_model", weft::value_text(32)}, {"config.data", "other.txt"}};
  const std::string e = config_error([&] { weft::LossCurve::read(rec, 2, "--baseline", other); });
  CHECK(contains(e, "--baseline " + rec + " is a record of another model or data (config.d_model 64 there, 32 in "
                    "this run, config.data corpus.txt there, other.txt in this run)"));
  // The identity is checked before the length: the reason given is the real one.
  CHECK(contains(config_error([&] { weft::LossCurve::read(rec, 5, "--baseline", other); }), "another model"));
  std::remove(rec.c_str());
}

TEST_CASE("json_at, json_text and value_text: the identity of a run as text") {
  const auto doc = weft::plan::parse_json(R"({"a": {"b": 0.1, "s": "x", "t": true, "n": null, "o": {}}})", "doc");
  CHECK(weft::json_text(weft::json_at(doc, "a.b")) == weft::value_text(0.1));
  CHECK(weft::value_text(0.1) == "0.10000000000000001");
  CHECK(weft::value_text(32) == "32");
  CHECK(weft::json_text(weft::json_at(doc, "a.s")) == "x");
  CHECK(weft::json_text(weft::json_at(doc, "a.t")) == "true");
  CHECK(weft::json_text(weft::json_at(doc, "a.n")) == "(not a value)");
  CHECK(weft::json_text(weft::json_at(doc, "a.o")) == "(not a value)");
  CHECK(weft::json_at(doc, "a.missing") == nullptr);
  CHECK(weft::json_at(doc, "a.b.c") == nullptr);  // b is not an object
  CHECK(weft::json_text(nullptr) == "(absent)");
  CHECK(weft::identity_differences(doc, {{"a.b", "0.2"}, {"a.s", "x"}, {"z", "1"}}) ==
        "a.b 0.10000000000000001 there, 0.2 in this run");
}

TEST_CASE("TokenRecord::parse takes prompts and outputs and refuses what is not a generation record") {
  const std::string rec = R"({"prompts": [[1, 2], [3]], "outputs": [[7, 8, 9], []], "traffic": {"prompts_file": "p.txt"}})";
  const auto r = weft::TokenRecord::parse(rec, "base.json");
  CHECK(r.active());
  CHECK(r.file == "base.json");
  CHECK(r.prompts == std::vector<std::vector<int>>{{1, 2}, {3}});
  CHECK(r.outputs == std::vector<std::vector<int>>{{7, 8, 9}, {}});
  CHECK(r.how() == "--prompts p.txt as it did");
  CHECK(!weft::TokenRecord{}.active());
  auto refused = [](const std::string& text) { return config_error([&] { weft::TokenRecord::parse(text, "b.json"); }); };
  CHECK(contains(refused("{\"outputs\": [[1]]"), "--baseline b.json"));  // not JSON
  CHECK(contains(refused(R"({"outputs": [[1]]})"),
                 "--baseline b.json: no \"prompts\" array found; expected a record written by serve_gpt --record (a record "
                 "from before serve_gpt recorded its prompts: record the baseline run again)"));
  CHECK(contains(refused(R"({"prompts": [[1]]})"), "no \"outputs\" array found"));
  CHECK(contains(refused(R"({"prompts": [[1]], "outputs": [3]})"), "outputs[0] is not an array of token ids"));
  CHECK(contains(refused(R"({"prompts": [[1, 2.5]], "outputs": [[3]]})"), "prompts[0][1] is not a token id"));
  CHECK(contains(refused(R"({"prompts": [[1, -1]], "outputs": [[3]]})"), "prompts[0][1] is not a token id"));
  CHECK(contains(refused(R"({"prompts": [[1], [2]], "outputs": [[3]]})"), "2 prompts but 1 outputs; the record is damaged"));
  CHECK(contains(config_error([&] { weft::TokenRecord::read(scratch("missing_tokens.json")); }), "cannot open the file"));
  if (weft::test::world().rank() != 0) return;
  const std::string path = scratch("tokens.json");
  write_text(path, rec);
  CHECK(weft::TokenRecord::read(path).outputs == r.outputs);
  std::remove(path.c_str());
}

TEST_CASE("TokenRecord::check_prompts and TokenParity: other requests refused, the first differing token named") {
  const auto r = weft::TokenRecord::parse(R"({"prompts": [[1, 2], [3]], "outputs": [[7, 8, 9], [4]]})", "base.json");
  CHECK(r.how() == "its --requests, --seed and --prompt-* flags");
  r.check_prompts({{1, 2}, {3}});  // the same requests: no error
  CHECK(contains(config_error([&] { r.check_prompts({{1, 2}}); }),
                 "--baseline base.json has 2 requests, this run 1; serve the baseline's requests (its --requests"));
  CHECK(contains(config_error([&] { r.check_prompts({{1, 2}, {5}}); }),
                 "--baseline base.json: the prompt of request 1 differs at token 0: this run's 5, the baseline's 3"));
  CHECK(contains(config_error([&] { r.check_prompts({{1}, {3}}); }),
                 "the prompt of request 0 differs at token 1: this run's the end (1 tokens), the baseline's 2"));

  const auto same = weft::TokenParity::compare({{7, 8, 9}, {4}}, r);
  CHECK(same.match);
  CHECK(same.requests == 2);
  CHECK(same.tokens == 4);
  CHECK(same.line("serve", "base.json") == "serve: the outputs match --baseline base.json: 2 requests, 4 tokens identical");
  CHECK(same.json("base.json").dump().find("\"first_difference\": null") != std::string::npos);

  const auto other = weft::TokenParity::compare({{7, 6, 9}, {4}}, r);
  CHECK(!other.match);
  CHECK(other.request == 0);
  CHECK(other.position == 1);
  CHECK(other.tokens == 1);
  CHECK(other.line("serve", "base.json") ==
        "serve: error: the outputs differ from --baseline base.json at request 0, token 1: this run's token is 6, the "
        "baseline's is 8 (the 1 tokens before it, in request order, are identical)");
  const std::string j = other.json("base.json").dump();
  CHECK(contains(j, "\"match\": false"));
  CHECK(contains(j, "\"request\": 0"));
  CHECK(contains(j, "\"token\": 1"));

  const auto shorter = weft::TokenParity::compare({{7, 8, 9}, {}}, r, {"", "too long"});
  CHECK(!shorter.match);
  CHECK(shorter.request == 1);
  CHECK(shorter.position == 0);
  CHECK(shorter.tokens == 3);
  CHECK(shorter.mine == "this run rejected it (too long)");
  CHECK(shorter.theirs == "the baseline's is 4");
  const auto longer = weft::TokenParity::compare({{7, 8, 9, 1}, {4}}, r);
  CHECK(longer.mine == "this run's token is 1");
  CHECK(longer.theirs == "the baseline's ends there (3 tokens)");
  const auto rejected_there = weft::TokenParity::compare({{7, 8, 9}, {4}},
                                                         weft::TokenRecord::parse(R"({"prompts": [[1], [3]], "outputs": [[7, 8, 9], []]})", "b"));
  CHECK(rejected_there.theirs == "the baseline has no tokens (rejected there)");
  CHECK(contains(config_error([&] { weft::TokenParity::compare({{7}}, r); }), "the run has 1 requests but the baseline base.json 2"));
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
  CHECK(q.line("prog", c.file) == "prog: error: the loss curve departs from ref.json: worst relative difference 0.5 > 1e-05 over 2 steps "
                                  "(step 1: loss 1.5, baseline 1)");
  CHECK(!c.compare({std::nan("")}, 1.0).follows());
  CHECK(contains(config_error([&] { c.compare({1, 2, 3, 4}, 1e-5); }), "the run has 4 steps but the baseline ref.json only 3"));
  CHECK(contains(config_error([&] { c.compare({1, 2}, 1e-5, 2); }), "the run has 4 steps but the baseline ref.json only 3"));
}

TEST_CASE("LossCurve::compare from a resumed step names the worst step as the baseline counts it") {
  weft::LossCurve c;
  c.file = "ref.json";
  c.loss = {4.0, 2.0, 1.0, 0.5};
  // A run resumed at step 2: its losses are steps 2 and 3.
  const auto p = c.compare({1.0, 0.25}, 1e-5, 2);
  CHECK(p.steps == 2);
  CHECK(p.worst_step == 3);
  CHECK(p.run_at_worst == 0.25);
  CHECK(p.baseline_at_worst == 0.5);
  CHECK(std::abs(p.worst - 0.5) < 1e-15);
  CHECK(p.line("prog", c.file) ==
        "prog: error: the loss curve departs from ref.json: worst relative difference 0.5 > 1e-05 over 2 steps "
        "(step 3: loss 0.25, baseline 0.5)");
  // The first of equal worsts; a NaN is the worst there is.
  const auto q = c.compare({4.0, std::nan(""), 1.0}, 1e-5);
  CHECK(q.worst_step == 1);
  CHECK(std::isinf(q.worst));
  const std::string j = p.json("ref.json").dump();
  for (const char* part : {"\"baseline\": \"ref.json\"", "\"steps_compared\": 2", "\"max_relative_difference\": 0.5",
                           "\"worst_step\": 3", "\"tolerance\": 1.0000000000000001e-05", "\"pass\": false"})
    CHECK_MESSAGE(contains(j, part), j, " lacks ", part);
  CHECK(contains(q.json("ref.json").dump(), "\"max_relative_difference\": null"));  // a NaN loss
}

TEST_CASE("RecordFile refuses an unwritable place at once and writes whole records") {
  if (weft::test::world().rank() != 0) return;
  CHECK(contains(config_error([] { weft::RecordFile("/nonexistent-dir/run.json"); }),
                 "--record /nonexistent-dir/run.json: the directory /nonexistent-dir does not exist"));
  CHECK(contains(config_error([] { weft::RecordFile("/tmp", "--out"); }), "--out /tmp: is a directory; give a file name"));
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

TEST_CASE("check_output_file refuses a directory that cannot take a file; write_file_whole leaves nothing on failure") {
  if (weft::test::world().rank() != 0) return;
  const std::string dir = scratch("dir");
  std::filesystem::create_directory(dir);
  weft::check_output_file("--record", dir + "/run.json");  // writable: passes and leaves nothing
  CHECK(files_in(dir) == 0);
  weft::write_file_whole("--record", dir + "/run.json", "first\n");
  weft::write_file_whole("--record", dir + "/run.json", "second\n");
  std::ifstream in(dir + "/run.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text == "second\n");
  CHECK(files_in(dir) == 1);  // no temporary left
  std::string io;
  try {
    weft::write_file_whole("--record", dir + "/missing/run.json", "x");
  } catch (const weft::IoError& e) {
    io = e.what();
  }
  CHECK(contains(io, "--record " + dir + "/missing/run.json: cannot create "));
  if (::geteuid() != 0) {  // root writes anywhere: the permission check is a non-root one
    ::chmod(dir.c_str(), 0555);
    CHECK(contains(config_error([&] { weft::check_output_file("--record", dir + "/new.json"); }),
                   "cannot create a file in " + dir));
    ::chmod(dir.c_str(), 0755);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("check_outputs_not_inputs refuses an output that is an input under another spelling") {
  if (weft::test::world().rank() != 0) return;
  const std::string in = scratch("input.json");
  write_text(in, "{}");
  const std::string dir = in.substr(0, in.find_last_of('/'));
  const std::string respelled = dir + "/./" + in.substr(in.find_last_of('/') + 1);
  CHECK(weft::same_file(in, respelled));
  CHECK(!weft::same_file(in, scratch("absent.json")));
  CHECK(!weft::same_file("", in));
  const std::string e = config_error([&] { weft::check_outputs_not_inputs({{"--record", respelled}}, {{"--baseline", in}}); });
  CHECK(contains(e, "--record " + respelled + " is the same file as --baseline " + in + " (the same device and inode)"));
  weft::check_outputs_not_inputs({{"--record", scratch("other.json")}, {"--checkpoint", ""}}, {{"--baseline", in}, {"--data", ""}});
  std::remove(in.c_str());
}
