// weft::FlagParser and weft::parse_mesh_spec: every accepted form of a flag
// (--name value, --name=value, switches alone and with a value, counts,
// reals, texts, choices, aliases, repeatable flags, --help) and every
// refusal, each asserted on the message a user reads; and the public
// weft::ranks_on_node. Single-rank.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <weft/comm/node.hpp>
#include <weft/core/flags.hpp>

#include "weft_test.hpp"

namespace {

// Runs parser.parse on the given arguments (argv[0] is "prog").
bool run(weft::FlagParser& p, std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return p.parse(static_cast<int>(argv.size()), argv.data());
}

// The message of the weft::ConfigError that f throws; fails when it throws none.
template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const weft::ConfigError& e) {
    return e.what();
  }
  FAIL("no weft::ConfigError was thrown");
  return {};
}

struct Options {
  std::size_t steps = 8;
  int layers = 2;
  std::uint64_t seed = 0;
  double lr = 1e-3, clip = 1.0;
  bool recompute = false;
  std::string record = "none", norm = "layernorm";
  std::vector<std::string> tags;
};

weft::FlagParser parser_for(Options& o) {
  weft::FlagParser p("prog");
  p.count("--steps", "N", "optimizer steps", o.steps)
      .count("--layers", "L", "blocks", o.layers, 1, 64)
      .count("--seed", "N", "seed", o.seed, 0, std::numeric_limits<std::uint64_t>::max())
      .real("--lr", "X", "learning rate", o.lr, weft::RealSign::positive)
      .real("--clip", "X", "clipping norm (0: none)", o.clip)
      .toggle("--recompute", "recompute activations", o.recompute)
      .text("--record", "FILE", "run record", o.record)
      .choice<std::string>("--norm", "normalization", o.norm, {{"layernorm", "layernorm"}, {"rmsnorm", "rmsnorm"}})
      .value("--tag", "T", "a tag (repeatable)", [&o](const std::string& v) { o.tags.push_back(v); })
      .repeatable("--tag")
      .alias("--compare", "--record");
  return p;
}

}  // namespace

TEST_CASE("flags: --name value and --name=value, every kind") {
  Options o;
  auto p = parser_for(o);
  CHECK(run(p, {"--steps", "12", "--layers=64", "--seed", "18446744073709551615", "--lr=3e-4", "--clip", "0",
                "--recompute", "--record", "-", "--norm=rmsnorm", "--tag", "a", "--tag=b"}));
  CHECK(o.steps == 12);
  CHECK(o.layers == 64);
  CHECK(o.seed == 18446744073709551615ull);
  CHECK(o.lr == doctest::Approx(3e-4));
  CHECK(o.clip == 0.0);
  CHECK(o.recompute);
  CHECK(o.record == "-");  // a value may start with '-'
  CHECK(o.norm == "rmsnorm");
  CHECK(o.tags == std::vector<std::string>{"a", "b"});
  CHECK(p.given("--steps"));
  CHECK(p.given("--compare"));  // an alias asks about its flag
  CHECK_FALSE(p.given("--nothing"));
}

TEST_CASE("flags: nothing given leaves the defaults") {
  Options o;
  auto p = parser_for(o);
  CHECK(run(p, {}));
  CHECK(o.steps == 8);
  CHECK_FALSE(p.given("--steps"));
}

TEST_CASE("flags: an empty value after '=' reaches the handler") {
  Options o;
  auto p = parser_for(o);
  CHECK(run(p, {"--record="}));
  CHECK(o.record.empty());
  CHECK(p.given("--record"));
}

TEST_CASE("flags: switches") {
  for (const char* yes : {"--recompute", "--recompute=yes", "--recompute=true", "--recompute=1", "--recompute=on"}) {
    Options o;
    auto p = parser_for(o);
    CHECK(run(p, {yes}));
    CHECK(o.recompute);
  }
  for (const char* no : {"--recompute=no", "--recompute=false", "--recompute=0", "--recompute=off"}) {
    Options o;
    o.recompute = true;
    auto p = parser_for(o);
    CHECK(run(p, {no}));
    CHECK_FALSE(o.recompute);
  }
  Options o;
  auto p = parser_for(o);
  CHECK(message_of([&] { run(p, {"--recompute=maybe"}); }) ==
        "--recompute=maybe: --recompute is a switch; give it alone or as --recompute=true or --recompute=false "
        "(yes/no, on/off, 1/0)");
  Options o2;
  auto p2 = parser_for(o2);
  // A switch takes no separate value: the word after it is an argument of its own.
  CHECK(message_of([&] { run(p2, {"--recompute", "false"}); }).find("unexpected argument 'false'") == 0);
}

TEST_CASE("flags: an alias runs its flag's handler") {
  Options o;
  auto p = parser_for(o);
  CHECK(run(p, {"--compare=ref.json"}));
  CHECK(o.record == "ref.json");
  CHECK(p.given("--record"));
}

TEST_CASE("flags: --help and -h stop parsing") {
  for (const char* h : {"--help", "-h"}) {
    Options o;
    auto p = parser_for(o);
    CHECK_FALSE(run(p, {"--steps", "3", h, "--bogus"}));
    CHECK(o.steps == 3);
  }
  const char* argv[] = {"prog", "--bogus", "-h"};
  CHECK(weft::FlagParser::help_requested(3, argv));
  CHECK_FALSE(weft::FlagParser::help_requested(2, argv));
}

TEST_CASE("flags: unknown flags, with and without a suggestion") {
  Options o;
  auto p = parser_for(o);
  CHECK(message_of([&] { run(p, {"--bogus", "3"}); }) == "unknown flag --bogus; run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"--step", "3"}); }) ==
        "unknown flag --step (did you mean --steps?); run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"--lrr=3"}); }) == "unknown flag --lrr (did you mean --lr?); run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"-steps", "3"}); }) ==
        "unknown flag -steps (did you mean --steps?); run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"--recomp"}); }) ==
        "unknown flag --recomp (did you mean --recompute?); run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"--comparee", "x"}); }) ==
        "unknown flag --comparee (did you mean --compare?); run prog --help for the flags");
}

TEST_CASE("flags: a missing value") {
  Options o;
  auto p = parser_for(o);
  CHECK(message_of([&] { run(p, {"--steps"}); }) == "--steps needs a value; give it as --steps N or --steps=N");
}

TEST_CASE("flags: a flag given twice") {
  Options o;
  auto p = parser_for(o);
  CHECK(message_of([&] { run(p, {"--steps", "3", "--steps=4"}); }) ==
        "--steps is given twice; give each flag once (the second value would silently replace the first)");
  Options o2;
  auto p2 = parser_for(o2);
  CHECK(message_of([&] { run(p2, {"--record", "a", "--compare", "b"}); }) ==
        "--record is given twice; give each flag once (the second value would silently replace the first)");
  Options o3;
  auto p3 = parser_for(o3);
  CHECK(message_of([&] { run(p3, {"--recompute", "--recompute=no"}); }).find("--recompute is given twice") == 0);
}

TEST_CASE("flags: positional arguments") {
  Options o;
  auto p = parser_for(o);
  CHECK(message_of([&] { run(p, {"steps"}); }) ==
        "unexpected argument 'steps': every argument is a flag (--name value or --name=value) (did you mean --steps?); "
        "run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"corpus.txt"}); }) ==
        "unexpected argument 'corpus.txt': every argument is a flag (--name value or --name=value); "
        "run prog --help for the flags");
  CHECK(message_of([&] { run(p, {"--"}); }).find("unexpected argument '--'") == 0);
  CHECK(message_of([&] { run(p, {"-"}); }).find("unexpected argument '-'") == 0);
}

TEST_CASE("flags: counts are strict") {
  auto refused = [](const std::vector<std::string>& args) {
    Options o;
    auto p = parser_for(o);
    return message_of([&] { run(p, args); });
  };
  CHECK(refused({"--steps", "0"}) == "--steps 0: out of range; expected an integer from 1 to 1099511627776");
  CHECK(refused({"--steps", "-4"}) == "--steps -4: out of range; expected an integer from 1 to 1099511627776");
  CHECK(refused({"--steps", "3x"}) == "--steps 3x: not an integer; expected an integer from 1 to 1099511627776");
  CHECK(refused({"--steps="}) == "--steps : not an integer; expected an integer from 1 to 1099511627776");
  CHECK(refused({"--layers", "65"}) == "--layers 65: out of range; expected an integer from 1 to 64");
  CHECK(refused({"--layers", "4294967298"}) == "--layers 4294967298: out of range; expected an integer from 1 to 64");
  CHECK(refused({"--seed", "18446744073709551616"}) ==
        "--seed 18446744073709551616: out of range; expected an integer from 0 to 18446744073709551615");
}

TEST_CASE("flags: reals are finite, non-negative or positive") {
  auto refused = [](const std::vector<std::string>& args) {
    Options o;
    auto p = parser_for(o);
    return message_of([&] { run(p, args); });
  };
  for (const char* bad : {"abc", "", "1.5x", " 1", "inf", "nan", "-1", "1e999"})
    CHECK(refused({"--clip", bad}) == std::string("--clip ") + bad + ": expected a non-negative number");
  CHECK(refused({"--lr", "0"}) == "--lr 0: expected a positive number");
  CHECK(refused({"--lr", "abc"}) == "--lr abc: expected a positive number");
  CHECK(weft::parse_real("x", "2.5") == 2.5);
  CHECK(weft::parse_real("x", "0") == 0.0);
  CHECK(weft::parse_real("x", "+1e-3", weft::RealSign::positive) == doctest::Approx(1e-3));
}

TEST_CASE("flags: choices") {
  Options o;
  auto p = parser_for(o);
  CHECK(message_of([&] { run(p, {"--norm", "batchnorm"}); }) == "--norm batchnorm: expected one of layernorm, rmsnorm");
}

TEST_CASE("flags: the usage text") {
  Options o;
  auto p = parser_for(o);
  const std::string u = p.usage();
  CHECK(u.find("usage: prog [flags]\n") == 0);
  CHECK(u.find("  --steps N") != std::string::npos);
  CHECK(u.find("optimizer steps\n") != std::string::npos);
  CHECK(u.find("  --recompute[=yes|no]") != std::string::npos);
  CHECK(u.find("  --norm layernorm|rmsnorm") != std::string::npos);
  CHECK(u.find("  --record FILE, --compare") != std::string::npos);
  CHECK(u.find("  --help") != std::string::npos);
  // The flags in the order registered, their help in one column.
  CHECK(u.find("--steps") < u.find("--layers"));
  const auto col = [&](const std::string& help) {
    const auto at = u.find(help);
    return at - (u.rfind('\n', at) + 1);
  };
  CHECK(col("optimizer steps") == col("learning rate"));
  p.usage_text("usage: prog, by hand\n");
  CHECK(p.usage() == "usage: prog, by hand\n");
}

TEST_CASE("flags: registration mistakes") {
  weft::FlagParser p("prog");
  bool b = false;
  p.toggle("--x", "", b);
  CHECK(message_of([&] { p.toggle("--x", "", b); }) == "FlagParser: --x is registered twice");
  CHECK(message_of([&] { p.toggle("x", "", b); }) == "FlagParser: flag name 'x' must start with -- and hold no '='");
  CHECK(message_of([&] { p.toggle("--a=b", "", b); }).find("must start with --") != std::string::npos);
  CHECK(message_of([&] { p.alias("--y", "--z"); }) == "FlagParser::alias: --z is not a registered flag");
  CHECK(message_of([&] { p.repeatable("--z"); }) == "FlagParser::repeatable: --z is not a registered flag");
}

TEST_CASE("mesh spec: accepted forms") {
  const std::vector<std::string> axes{"dp", "pp", "tp"};
  const auto m = weft::parse_mesh_spec("--mesh", "dp=2,pp=2,tp=2", axes);
  CHECK(m == weft::AxisSizes{{"dp", 2}, {"pp", 2}, {"tp", 2}});
  CHECK(weft::parse_mesh_spec("--mesh", "tp=16777216", axes) == weft::AxisSizes{{"tp", 16777216}});
  CHECK(weft::parse_mesh_spec("--mesh", "pp=3", axes).count("dp") == 0);  // left out: the caller's default
}

TEST_CASE("mesh spec: refusals") {
  const std::vector<std::string> axes{"dp", "pp", "tp"};
  auto refused = [&](const std::string& spec) { return message_of([&] { weft::parse_mesh_spec("--mesh", spec, axes); }); };
  CHECK(refused("dp2") == "--mesh dp2: expected axis=size items such as dp=2, got 'dp2'");
  CHECK(refused("") == "--mesh : expected axis=size items such as dp=2, got ''");
  CHECK(refused("dp=2,") == "--mesh dp=2,: expected axis=size items such as dp=2, got ''");
  CHECK(refused("xp=2") == "--mesh xp=2: unknown axis 'xp'; the axes are dp, pp, tp");
  CHECK(refused("dp=2,dp=1") == "--mesh dp=2,dp=1: axis dp is given twice; name each axis once");
  CHECK(refused("tp=0") == "--mesh tp 0: out of range; expected an integer from 1 to 16777216");
  CHECK(refused("tp=4294967298") == "--mesh tp 4294967298: out of range; expected an integer from 1 to 16777216");
  CHECK(refused("tp=two") == "--mesh tp two: not an integer; expected an integer from 1 to 16777216");
  CHECK(message_of([&] { weft::parse_mesh_spec("--mesh", "tp=5", axes, 4); }) ==
        "--mesh tp 5: out of range; expected an integer from 1 to 4");
}

TEST_CASE("ranks_on_node: the public count of this node's ranks") {
  const int n = weft::ranks_on_node(MPI_COMM_WORLD);
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  CHECK(n >= 1);
  CHECK(n <= world);
}
