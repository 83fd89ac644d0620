// weft-plan: ranks the parallel layouts of a model on a cluster (training) or
// the serving layouts of a replica (serving), as a table or as JSON.
//   weft-plan --preset NAME|--model FILE.json --gpus N [--topology FILE.json]
//             [--train|--serve] [--json] [--top K] [--batch B --context C]
//             [--schedule gpipe|1f1b|interleaved:V|zb]
//             [--run-top K [--train-gpt PATH] [--launcher "mpirun -n {n}"] [--steps N] [--workdir DIR]]
// --run-top: "heuristics pick candidates, benchmarks pick the winner" -- the
// top K fitting layouts that this build of train_gpt accepts (it is asked with
// train_gpt --check, so the filter grows with train_gpt) are trained for a few
// steps, and their measured step time and memory are printed beside the
// predicted ones (a table, or with --json one document, schema
// docs/schema/run_top.schema.json).
//   mpirun -n N weft-plan --calibrate FILE.json
// --calibrate: measures this machine as the planner sees it (the core's FMA
// peak, the gemm rate, memory per rank, MPI's links inside a host and across
// hosts; weft/plan/calibrate.hpp) and writes a topology file for --topology.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <weft/comm/environment.hpp>
#include <weft/metrics/json.hpp>
#include <weft/ops/blas_threads.hpp>
#include <weft/parity.hpp>
#include <weft/plan/calibrate.hpp>
#include <weft/plan/presets.hpp>

#ifndef WEFT_TRAIN_GPT_PATH
#define WEFT_TRAIN_GPT_PATH "train_gpt"
#endif

namespace {

using namespace weft::plan;

struct Args {
  std::string preset, model_file, topology_file;
  std::string calibrate;  // --calibrate FILE: measure this machine and write a topology file
  std::size_t gpus = 0, top = 10, batch = 8, context = 4096;
  bool serve = false, json = false, rejected = false;
  std::size_t run_top = 0, steps = 6;        // --run-top K: train the top K candidates for --steps steps
  std::string train_gpt = WEFT_TRAIN_GPT_PATH;  // the train_gpt executable
  std::string launcher = "mpirun -n {n}";    // {n}: the ranks; split at spaces
  std::string workdir;                        // records and logs (default: a new /tmp directory)
  std::string schedule = "1f1b";              // pipeline schedule of layouts with pp > 1
};

// The most factorisations of --gpus planned (about 4 layouts each).
constexpr std::size_t kMaxFactorisations = 20000;

// One line per flag; --help prints it to stdout, a bad command line to stderr.
std::string usage_text() {
  std::string presets;
  for (const auto& n : preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  return "usage: weft-plan --preset NAME|--model FILE.json --gpus N [flags]\n"
         "       mpirun -n N weft-plan --calibrate FILE.json\n"
         "  --preset NAME         a published model shape: " + presets + "\n"
         "  --model FILE.json     a model description (its fields: docs/plan.md)\n"
         "  --gpus N              devices to plan for, 1.." + std::to_string(max_gpus) + "\n"
         "  --topology FILE.json  the cluster (default: nodes of 8 devices of 80 GB)\n"
         "  --train               rank training layouts (the default)\n"
         "  --serve               rank serving layouts of a replica\n"
         "  --json                one JSON document instead of a table\n"
         "  --top K               rows of the table (10)\n"
         "  --rejected            also list every rejected layout and why\n"
         "  --batch B             serving: concurrent sequences (8)\n"
         "  --context C           serving: tokens of context per sequence (4096)\n"
         "  --schedule S          pipeline schedule of layouts with pp > 1: gpipe, 1f1b, interleaved:V or zb (1f1b)\n"
         "  --run-top K           train the top K fitting layouts with train_gpt; measured beside predicted\n"
         "  --train-gpt PATH      the train_gpt that --run-top launches (default: this build's)\n"
         "  --launcher CMD        how --run-top launches, {n} the rank count ('mpirun -n {n}')\n"
         "  --steps N             steps of each --run-top run (6)\n"
         "  --workdir DIR         records and logs of --run-top (default: a new directory under /tmp)\n"
         "  --calibrate FILE.json measure this machine and write it as a topology file for --topology: one\n"
         "                        device per rank, the FMA peak and gemm rate of a rank, MemAvailable / its\n"
         "                        node's ranks, MPI's bandwidth and latency inside a host and across hosts\n"
         "                        (launch 2 or more ranks; 2 on each of 2 hosts measure both links)\n"
         "  --help                this text\n"
         "Each flag may be given once. Exit status: 0 a plan (or, with --calibrate, the file written); 1 no valid\n"
         "layout (the most common reasons are printed) or no --run-top candidate ran; 2 a bad flag or input file\n"
         "(--calibrate: one rank, or a file that cannot be written).\n";
}

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "weft-plan: " << why << "\n" << usage_text();
  std::exit(2);
}

// A positive integer no larger than max; anything else (an overflow
// included) is an error naming the flag and the largest accepted value.
std::size_t count(const std::string& flag, const char* v, std::size_t max = INT_MAX) {
  const std::string t = v;
  const bool digits = !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
  if (!digits) usage(flag + " " + t + ": expected a positive integer");
  errno = 0;
  const unsigned long long x = std::strtoull(v, nullptr, 10);
  if (errno == ERANGE || x > max)
    usage(flag + " " + t + ": larger than the largest accepted value " + std::to_string(max));
  if (x == 0) usage(flag + " " + t + ": expected a positive integer");
  return std::size_t(x);
}

Args parse(int argc, char** argv) {
  Args a;
  std::set<std::string> seen;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") {
      std::cout << usage_text();
      std::exit(0);
    }
    if (f.rfind("--", 0) == 0 && !seen.insert(f == "--train" ? "--serve" : f).second)
      usage(f == "--train" || f == "--serve" ? "give one of --train and --serve, once"
                                             : f + " is given twice; give each flag once");
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage(f + " needs a value");
      return argv[++i];
    };
    if (f == "--preset") a.preset = next();
    else if (f == "--model") a.model_file = next();
    else if (f == "--topology") a.topology_file = next();
    else if (f == "--gpus") a.gpus = count(f, next(), max_gpus);
    else if (f == "--top") a.top = count(f, next());
    else if (f == "--batch") a.batch = count(f, next());
    else if (f == "--context") a.context = count(f, next());
    else if (f == "--run-top") a.run_top = count(f, next());
    else if (f == "--steps") a.steps = count(f, next());
    else if (f == "--train-gpt") a.train_gpt = next();
    else if (f == "--launcher") a.launcher = next();
    else if (f == "--workdir") a.workdir = next();
    else if (f == "--schedule") a.schedule = next();
    else if (f == "--train") a.serve = false;
    else if (f == "--serve") a.serve = true;
    else if (f == "--json") a.json = true;
    else if (f == "--rejected") a.rejected = true;
    else if (f == "--calibrate") a.calibrate = next();
    else usage("unknown flag " + f);
  }
  if (seen.count("--calibrate")) {
    if (a.calibrate.empty()) usage("--calibrate needs the name of the file to write");
    if (seen.size() > 1) usage("--calibrate takes no other flag; plan with the file it writes (--topology) afterwards");
    return a;
  }
  if (a.preset.empty() == a.model_file.empty()) usage("give exactly one of --preset and --model");
  if (!a.gpus) usage("--gpus is required");
  // Every layout is listed (and costed when valid), so the work grows with
  // the factorisations of --gpus, not with --gpus: refuse a count that would
  // take minutes rather than answer late.
  if (const std::size_t f = factorisation_count(a.gpus); f > kMaxFactorisations)
    usage("--gpus " + std::to_string(a.gpus) + " has " + std::to_string(f) +
          " factorisations into tp x pp x cp x dp, more than the " + std::to_string(kMaxFactorisations) +
          " weft-plan enumerates (2^24 has 2925); plan for a device count with fewer divisors");
  if (a.run_top && a.serve) usage("--run-top measures training layouts; it does not combine with --serve");
  if (a.run_top && a.launcher.find("{n}") == std::string::npos) usage("--launcher must contain {n} (the rank count)");
  if (a.run_top && a.train_gpt.find('/') != std::string::npos && ::access(a.train_gpt.c_str(), X_OK) != 0)
    usage("--train-gpt " + a.train_gpt + ": cannot run it (" + std::strerror(errno) +
          "); give the path of a built train_gpt executable");
  return a;
}

// The most frequent rejection rules over `reasons_of` each layout, most
// frequent first, at most k of them: a rule is a reason with its numbers
// left out ("tp 3 does not divide heads 32" and "tp 5 ..." are one rule),
// shown by its first reason, with the number of layouts it rejects.
std::vector<std::pair<std::string, std::size_t>> top_reasons(const std::vector<std::vector<std::string>>& reasons_of,
                                                             std::size_t k) {
  std::map<std::string, std::pair<std::string, std::size_t>> rules;  // rule -> (first reason, layouts)
  std::vector<std::string> order;
  for (const auto& rs : reasons_of) {
    std::set<std::string> here;  // a layout counts once per rule
    for (const auto& r : rs) {
      std::string rule;
      for (char c : r)
        if (!std::isdigit(static_cast<unsigned char>(c))) rule += c;
        else if (rule.empty() || rule.back() != '#') rule += '#';
      if (!here.insert(rule).second) continue;
      auto [it, fresh] = rules.try_emplace(rule, r, 0);
      if (fresh) order.push_back(rule);
      ++it->second.second;
    }
  }
  std::vector<std::pair<std::string, std::size_t>> v;
  for (const auto& rule : order) v.push_back(rules[rule]);
  std::stable_sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (v.size() > k) v.resize(k);
  return v;
}

// "no valid layout of ...: reason (n of N layouts); ..." for text output.
std::string no_layout_message(const std::string& what, const std::vector<std::vector<std::string>>& reasons_of) {
  std::string msg = "no valid layout of " + what + "; every one of the " + std::to_string(reasons_of.size()) +
                    " layouts is rejected. The most common reasons:";
  for (const auto& [r, n] : top_reasons(reasons_of, 3))
    msg += "\n  " + r + " (this rule rejects " + std::to_string(n) + " of " + std::to_string(reasons_of.size()) + " layouts)";
  return msg;
}

weft::metrics::Json top_reasons_json(const std::vector<std::vector<std::string>>& reasons_of) {
  weft::metrics::Json::Array out;
  for (const auto& [r, n] : top_reasons(reasons_of, 3))
    out.push_back(weft::metrics::Json::object().set("reason", r).set("layouts_rejected_by_this_rule", n));
  return weft::metrics::Json(out);
}

// train_gpt's --mesh value of a layout.
std::string mesh_flag(const MeshSpec& s) {
  std::string r = "dp=" + std::to_string(s.dp) + ",tp=" + std::to_string(s.tp) + ",pp=" + std::to_string(s.pp) +
                  ",cp=" + std::to_string(s.cp);
  if (s.ep > 1) r += ",ep=" + std::to_string(s.ep);
  return r;
}

// A layout as the tables name it: the mesh and, with cp > 1, the context variant.
std::string mesh_name(const MeshSpec& s) {
  std::string r = mesh_flag(s);
  if (s.cp > 1) r.append(":").append(to_string(s.context));
  return r;
}

double gb(double bytes) { return bytes / 1e9; }
// Bytes as "12.3 GB" (GB = 1e9 bytes, as the topology's memory_gb), with
// three significant digits below 1 GB.
std::string gb_text(double bytes) {
  char b[48];
  if (bytes >= 1e9) std::snprintf(b, sizeof b, "%.1f GB", bytes / 1e9);
  else std::snprintf(b, sizeof b, "%.3g GB", bytes / 1e9);
  return b;
}

// ---- --run-top: measured against predicted ----------------------------------

// train_gpt's flags for the model, or throws naming the field train_gpt cannot express.
std::vector<std::string> train_gpt_model_flags(const ModelSpec& m) {
  auto need = [&](bool ok, const char* field, const std::string& why) {
    WEFT_REQUIRE(ok, weft::ConfigError, "--run-top: model field \"", field, "\" ", why,
                 "; train_gpt cannot run this model (it trains weft's fp32 GPT)");
  };
  need(m.experts == 0, "experts", "is " + std::to_string(m.experts));
  need(m.bias, "bias", "is false");
  need(!m.flash_attention, "flash_attention", "is true");
  need(m.param_bytes == 4 && m.grad_bytes == 4 && m.optim_bytes == 4 && m.act_bytes == 4, "param_bytes",
       "(or grad/optim/act bytes) is not 4");
  need(m.master_bytes == 0, "master_bytes", "is not 0");
  need(m.saved_bytes == 0 || m.saved_bytes == 4, "saved_bytes", "is not 4 (train_gpt's fp32 run keeps its activations in 4 bytes)");
  need(m.product_bytes == 0, "product_bytes", "is not 0 (train_gpt's fp32 run stages no 2-byte operands)");
  need(m.vocab >= 256, "vocab", "is below the 256 byte values of train_gpt's data");
  need(m.optimizer == Optimizer::adamw || m.sgd_momentum, "sgd_momentum", "is false");
  ModelSpec plain = m;
  plain.ffn_hidden = 0;
  need(m.ffn_hidden == 0 || m.ffn_hidden == plain.hidden(), "ffn_hidden", "differs from train_gpt's fixed rule");
  std::vector<std::string> f = {"--layers", std::to_string(m.layers), "--d-model", std::to_string(m.d_model),
                                "--heads", std::to_string(m.heads), "--kv-heads", std::to_string(m.kv()),
                                "--seq", std::to_string(m.seq), "--vocab", std::to_string(m.vocab),
                                "--batch", std::to_string(m.global_batch),
                                "--norm", m.layernorm ? "layernorm" : "rmsnorm",
                                "--mlp", m.mlp == Mlp::gelu ? "gelu" : "swiglu",
                                "--pos", m.learned_positions ? "learned" : "rotary",
                                "--optimizer", m.optimizer == Optimizer::adamw ? "adamw" : "sgd"};
  if (m.recompute) f.push_back("--recompute");
  return f;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `launcher(n) train_gpt args`, output into log; returns the exit status.
int launch(const Args& a, std::size_t n, const std::vector<std::string>& args, const std::string& log) {
  std::string cmd, l = a.launcher;
  for (std::size_t p; (p = l.find("{n}")) != std::string::npos;) l.replace(p, 3, std::to_string(n));
  std::istringstream words(l);
  for (std::string w; words >> w;) cmd.append(shell_quote(w)).append(" ");
  cmd.append(shell_quote(a.train_gpt));
  for (const auto& x : args) cmd.append(" ").append(shell_quote(x));
  cmd.append(" > ").append(shell_quote(log)).append(" 2>&1");
  const int rc = std::system(cmd.c_str());
  return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

// The first "train_gpt: error:" line of a log (why train_gpt refused), else its last line.
std::string refusal(const std::string& log) {
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    const auto p = line.find("train_gpt: error: ");
    if (p != std::string::npos) return line.substr(p + 18);
    if (!line.empty() && line[0] != '-') last = line;
  }
  return last.empty() ? "no output" : last;
}

double number_at(const JsonValue& v, std::initializer_list<const char*> path, const std::string& what) {
  const JsonValue* x = &v;
  for (const char* k : path) {
    x = x->kind == JsonValue::Kind::object ? x->find(k) : nullptr;
    WEFT_REQUIRE(x, weft::ConfigError, what, ": field \"", k, "\" missing");
  }
  WEFT_REQUIRE(x->kind == JsonValue::Kind::number, weft::ConfigError, what, ": field is not a number");
  return x->number;
}

// One candidate --run-top trained (or skipped) and what its record says.
struct TopRun {
  const Candidate* c = nullptr;
  std::size_t rank = 0;       // position among the valid candidates
  std::string record, skip;   // record path; why it was not run (empty: it ran)
  double step_s = 0;          // measured: median step after warm-up
  bool has_memory = false;    // the record carries memory_bytes_per_rank
  double meas[6] = {0, 0, 0, 0, 0, 0};
};

const char* const kMemoryKeys[6] = {"parameters", "gradients", "optimizer_state", "activations", "temporary", "communication"};

std::array<double, 6> predicted_memory(const Candidate& c) {
  const auto& b = c.memory;
  return {b.parameters, b.gradients, b.optimizer_state, b.activations, b.temporary, b.communication};
}

std::string schedule_of(const MeshSpec& s) { return s.pp > 1 ? schedule_name(s.schedule, s.chunks) : "none"; }

// Trains the top K fitting candidates train_gpt accepts; progress goes to `log`.
std::vector<TopRun> run_candidates(const Args& a, const ModelSpec& m, const Topology& t, const std::vector<Candidate>& ranked,
                                   std::string& dir, std::FILE* log) {
  const auto model_flags = train_gpt_model_flags(m);
  dir = a.workdir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/weft-plan-XXXXXX";
    WEFT_REQUIRE(mkdtemp(tmpl), weft::ConfigError, "--run-top: cannot create a directory under /tmp");
    dir = tmpl;
  } else {
    WEFT_REQUIRE(std::system(("mkdir -p " + shell_quote(dir)).c_str()) == 0, weft::ConfigError, "--workdir ", dir,
                 ": cannot create it");
  }
  std::vector<TopRun> out;
  std::size_t ran = 0;
  std::fprintf(log, "\n--run-top %zu: asking %s which layouts it accepts (train_gpt --check); records in %s\n", a.run_top,
               a.train_gpt.c_str(), dir.c_str());
  std::size_t rank = 0;
  for (const auto& c : ranked) {
    if (!c.valid()) continue;
    ++rank;
    if (ran >= a.run_top) break;
    TopRun r;
    r.c = &c;
    r.rank = rank;
    if (!c.fits) {
      r.skip = "does not fit in " + std::to_string(int(t.memory_gb)) + " GB";
      std::fprintf(log, "  skip #%zu %s %s: %s\n", rank, mesh_name(c.mesh).c_str(), to_string(c.mesh.mode), r.skip.c_str());
      out.push_back(r);
      continue;
    }
    const std::size_t mbs = microbatches(m, c.mesh);
    std::vector<std::string> args = model_flags;
    for (const auto& x : {std::string("--microbatches"), std::to_string(mbs), std::string("--mesh"), mesh_flag(c.mesh),
                          std::string("--dp"), std::string(to_string(c.mesh.mode))})
      args.push_back(x);
    if (c.mesh.pp > 1) args.insert(args.end(), {"--schedule", schedule_name(c.mesh.schedule, c.mesh.chunks)});
    if (c.mesh.cp > 1) args.insert(args.end(), {"--context", to_string(c.mesh.context)});
    const std::string tag = dir + "/candidate" + std::to_string(rank);
    std::vector<std::string> check = args;
    check.push_back("--check");
    if (launch(a, 1, check, tag + ".check.log") != 0) {
      r.skip = "train_gpt refuses: " + refusal(tag + ".check.log");
      std::fprintf(log, "  skip #%zu %s %s: %s\n", rank, mesh_name(c.mesh).c_str(), to_string(c.mesh.mode), r.skip.c_str());
      out.push_back(r);
      continue;
    }
    args.insert(args.end(), {"--steps", std::to_string(a.steps), "--record", tag + ".json"});
    std::fprintf(log, "  run  #%zu %s %s on %zu ranks, %zu steps ...\n", rank, mesh_name(c.mesh).c_str(),
                 to_string(c.mesh.mode), c.mesh.world(), a.steps);
    std::fflush(log);
    const int rc = launch(a, c.mesh.world(), args, tag + ".log");
    WEFT_REQUIRE(rc == 0, weft::ConfigError, "--run-top: train_gpt failed (exit ", rc, ") for ", mesh_name(c.mesh), " ",
                 to_string(c.mesh.mode), ": ", refusal(tag + ".log"), " (log ", tag, ".log)");
    r.record = tag + ".json";
    // Measured: median step time after warm-up (global tokens / tokens per
    // second) and each category's largest value over the ranks, when the
    // record has them (every train_gpt run writes them; older records may not).
    const JsonValue rec = parse_json(read_text_file(r.record), r.record);
    r.step_s = number_at(rec, {"tokens_per_step"}, r.record) / number_at(rec, {"tokens_per_second"}, r.record);
    const JsonValue* per_rank = rec.find("memory_bytes_per_rank");
    r.has_memory = per_rank && per_rank->kind == JsonValue::Kind::array && !per_rank->array.empty();
    if (r.has_memory)
      for (const auto& one : per_rank->array)
        for (int k = 0; k < 6; ++k) r.meas[k] = std::max(r.meas[k], number_at(one, {kMemoryKeys[k]}, r.record));
    out.push_back(r);
    ++ran;
  }
  return out;
}

int run_top(const Args& a, const ModelSpec& m, const Topology& t, const std::vector<Candidate>& ranked) {
  std::string dir;
  const auto all = run_candidates(a, m, t, ranked, dir, a.json ? stderr : stdout);
  std::vector<const TopRun*> runs;
  for (const auto& r : all)
    if (r.skip.empty()) runs.push_back(&r);
  const TopRun* best = nullptr;
  for (const auto* r : runs)
    if (!best || r->step_s < best->step_s) best = r;
  if (a.json) {
    using weft::metrics::Json;
    auto cats = [](const double* v) {
      Json o = Json::object();
      for (int k = 0; k < 6; ++k) o.set(kMemoryKeys[k], v[k]);
      return o;
    };
    Json::Array ran, skipped;
    for (const auto& r : all) {
      Json j = Json::object();
      j.set("rank", r.rank).set("mesh", mesh_name(r.c->mesh)).set("dp_mode", to_string(r.c->mesh.mode))
          .set("schedule", schedule_of(r.c->mesh)).set("world_size", r.c->mesh.world());
      if (!r.skip.empty()) {
        skipped.push_back(j.set("reason", r.skip));
        continue;
      }
      const auto pred = predicted_memory(*r.c);
      Json predicted = Json::object();
      predicted.set("step_s", r.c->step_s).set("memory_bytes", cats(pred.data()));
      Json measured = Json::object();
      measured.set("step_s", r.step_s).set("memory_recorded", r.has_memory);
      Json ratio = Json::object();
      ratio.set("step_s", r.step_s / r.c->step_s);
      if (r.has_memory) {
        measured.set("memory_bytes", cats(r.meas));
        Json mr = Json::object();
        for (int k = 0; k < 6; ++k)
          mr.set(kMemoryKeys[k], pred[std::size_t(k)] > 0 ? Json(r.meas[k] / pred[std::size_t(k)]) : Json(nullptr));
        ratio.set("memory_bytes", mr);
      }
      j.set("record", r.record).set("predicted", predicted).set("measured", measured)
          .set("measured_over_predicted", ratio);
      ran.push_back(j);
    }
    Json out = Json::object();
    out.set("mode", "run_top").set("model", m.name).set("gpus", a.gpus).set("topology", t.name).set("steps", a.steps)
        .set("workdir", dir).set("step_time_method", "median step after warm-up, tokens_per_step / tokens_per_second")
        .set("memory_method", "measured: largest value over ranks of the record's memory_bytes_per_rank; "
                              "predicted: the planner's per-rank budget without headroom")
        .set("runs", Json(ran)).set("skipped", Json(skipped));
    if (best)
      out.set("fastest_measured", Json::object().set("mesh", mesh_name(best->c->mesh)).set("dp_mode", to_string(best->c->mesh.mode))
                                      .set("step_s", best->step_s))
          .set("planner_choice", Json::object().set("mesh", mesh_name(runs[0]->c->mesh))
                                     .set("dp_mode", to_string(runs[0]->c->mesh.mode)).set("step_s", runs[0]->c->step_s));
    std::cout << out.dump(2) << "\n";
    return runs.empty() ? 1 : 0;
  }
  if (runs.empty()) {
    std::printf("no candidate could be run\n");
    return 1;
  }
  std::printf("\nmeasured against predicted (%zu steps each; step time: median after warm-up; memory: largest rank, kB = 1e3 B;\n"
              "temporary and communication are train_gpt's buffers split as the planner splits them; headroom is not measured)\n",
              a.steps);
  std::printf("%-4s %-22s %-9s %10s %10s %6s | %-15s %-15s %-15s %-15s %-15s %-15s\n", "rank", "mesh", "dp-mode",
              "pred s", "meas s", "ratio", "params kB", "grads kB", "optim kB", "activ kB", "temp kB", "comm kB");
  std::printf("%-4s %-22s %-9s %10s %10s %6s | %-15s %-15s %-15s %-15s %-15s %-15s\n", "", "", "", "", "", "m/p",
              "pred/meas", "pred/meas", "pred/meas", "pred/meas", "pred/meas", "pred/meas");
  std::size_t shown = 0;
  for (const auto* r : runs) {
    const auto pred = predicted_memory(*r->c);
    std::printf("%-4zu %-22s %-9s %10.3g %10.3g %6.2f |", ++shown, mesh_name(r->c->mesh).c_str(), to_string(r->c->mesh.mode),
                r->c->step_s, r->step_s, r->step_s / r->c->step_s);
    for (int k = 0; k < 6; ++k) {
      char cell[40];
      if (r->has_memory) std::snprintf(cell, sizeof cell, "%.1f/%.1f", pred[std::size_t(k)] / 1e3, r->meas[k] / 1e3);
      else std::snprintf(cell, sizeof cell, "%.1f/-", pred[std::size_t(k)] / 1e3);
      std::printf(" %-15s", cell);
    }
    std::printf("\n");
  }
  std::printf("fastest measured: %s %s, %.3g s per step (planner's choice among these: %s %s)\n",
              mesh_name(best->c->mesh).c_str(), to_string(best->c->mesh.mode), best->step_s,
              mesh_name(runs[0]->c->mesh).c_str(), to_string(runs[0]->c->mesh.mode));
  return 0;
}

int train(const Args& a, const ModelSpec& m, const Topology& t) {
  const auto [sched, chunks] = parse_schedule_name(a.schedule);
  const auto ranked = rank_meshes(m, a.gpus, t, sched, chunks);
  std::size_t valid = 0;
  for (const auto& c : ranked) valid += c.valid();
  std::vector<std::vector<std::string>> reasons_of;
  for (const auto& c : ranked) reasons_of.push_back(c.reasons);
  const std::string what = m.name + " on " + std::to_string(a.gpus) + " GPUs";
  if (!valid && !a.json) {
    std::cerr << "weft-plan: " << no_layout_message(what, reasons_of) << "\n(--rejected lists every layout)\n";
    return 1;
  }
  // Layouts that are valid but none fits the memory: a plan that says no,
  // naming the smallest per-GPU memory that would fit one (exit status 1).
  const Candidate* smallest = nullptr;
  std::size_t fitting = 0;
  for (const auto& c : ranked)
    if (c.valid()) {
      fitting += c.fits;
      if (!smallest || c.memory.total() < smallest->memory.total()) smallest = &c;
    }
  const std::string no_fit =
      smallest && !fitting
          ? "no layout of " + what + " fits in " + gb_text(t.memory_gb * 1e9) + " per GPU: the smallest, " +
                mesh_name(smallest->mesh) + " " + to_string(smallest->mesh.mode) + ", needs " +
                gb_text(smallest->memory.total()) + " per GPU. Give GPUs with at least that much memory (--topology), " +
                "more GPUs (--gpus), or a smaller model"
          : std::string();
  if (a.run_top && a.json && valid && no_fit.empty()) return run_top(a, m, t, ranked);  // one JSON document: measured against predicted
  if (a.json) {
    using weft::metrics::Json;
    Json::Array cands, rej;
    for (const auto& c : ranked) {
      Json j = Json::object();
      j.set("mesh", mesh_name(c.mesh)).set("dp_mode", to_string(c.mesh.mode));
      if (c.valid()) {
        Json mem = Json::object();
        mem.set("parameters", c.memory.parameters).set("gradients", c.memory.gradients)
            .set("optimizer_state", c.memory.optimizer_state).set("activations", c.memory.activations)
            .set("temporary", c.memory.temporary).set("communication", c.memory.communication)
            .set("headroom", c.memory.headroom).set("total", c.memory.total());
        j.set("fits", c.fits).set("memory_bytes", mem).set("step_s", c.step_s).set("tokens_per_s", c.tokens_per_s)
            .set("compute_s", c.compute_s).set("bubble", c.bubble).set("tp_s", c.tp_s).set("cp_s", c.cp_s)
            .set("ep_s", c.ep_s).set("pp_s", c.pp_s).set("dp_s", c.dp_s);
        // The busiest pipeline rank's bytes per collective kind (CommStats convention).
        const CommVolume v = busiest_comm_volume(m, c.mesh);
        j.set("schedule", schedule_of(c.mesh)).set("context", c.mesh.cp > 1 ? to_string(c.mesh.context) : "none")
            .set("comm_bytes_per_step", Json::object().set("tp_all_reduce", v.tp_all_reduce).set("tp_all_gather", v.tp_all_gather)
                                            .set("tp_reduce_scatter", v.tp_reduce_scatter).set("pp_send", v.pp_send)
                                            .set("pp_recv", v.pp_recv).set("cp_send", v.cp_send)
                                            .set("cp_all_gather", v.cp_all_gather)
                                            .set("cp_reduce_scatter", v.cp_reduce_scatter)
                                            .set("cp_all_to_all", v.cp_all_to_all));
        cands.push_back(j);
      } else {
        Json::Array rs;
        for (const auto& r : c.reasons) rs.push_back(r);
        j.set("reasons", Json(rs));
        rej.push_back(j);
      }
    }
    Json out = Json::object();
    out.set("model", m.name).set("parameters", double(m.total_params())).set("gpus", a.gpus).set("topology", t.name)
        .set("mode", "train").set("candidates", Json(cands)).set("rejected", Json(rej));
    if (!valid) out.set("error", "no valid layout of " + what).set("top_rejection_reasons", top_reasons_json(reasons_of));
    if (!no_fit.empty()) out.set("error", no_fit).set("smallest_memory_bytes_per_gpu", smallest->memory.total());
    std::cout << out.dump(2) << "\n";
    return valid && no_fit.empty() ? 0 : 1;
  }
  std::printf("%s: %.2fB parameters, %zu GPUs (%s: %zu per node, %.0f GB each); %zu valid layouts of %zu; "
              "pipeline schedule %s\n",
              m.name.c_str(), double(m.total_params()) / 1e9, a.gpus, t.name.c_str(), t.gpus_per_node, t.memory_gb,
              valid, ranked.size(), schedule_name(sched, chunks).c_str());
  std::printf("%-4s %-30s %-9s %5s %8s %7s %7s %7s %7s %7s %7s %7s %6s %9s %10s\n", "rank", "mesh", "dp-mode", "fits",
              "total", "params", "grads", "optim", "activ", "temp", "comm", "headrm", "bubble", "step s", "tok/s");
  std::size_t shown = 0;
  for (const auto& c : ranked) {
    if (!c.valid() || shown >= a.top) continue;
    ++shown;
    const auto& b = c.memory;
    std::printf("%-4zu %-30s %-9s %5s %7.1fG %7.1f %7.1f %7.1f %7.1f %7.1f %7.2f %7.1f %6.3f %9.3f %10.0f\n", shown,
                mesh_name(c.mesh).c_str(), to_string(c.mesh.mode), c.fits ? "yes" : "NO", gb(b.total()), gb(b.parameters),
                gb(b.gradients), gb(b.optimizer_state), gb(b.activations), gb(b.temporary), gb(b.communication),
                gb(b.headroom), c.bubble, c.step_s, c.tokens_per_s);
  }
  if (!no_fit.empty()) {
    std::fflush(stdout);
    std::cerr << "weft-plan: " << no_fit << "\n";
    return 1;
  }
  if (a.run_top) {
    const int rc = run_top(a, m, t, ranked);
    if (rc) return rc;
  }
  if (a.rejected) {
    std::printf("\nrejected:\n");
    for (const auto& c : ranked) {
      if (c.valid()) continue;
      std::printf("  %-30s %-9s", mesh_name(c.mesh).c_str(), to_string(c.mesh.mode));
      for (std::size_t i = 0; i < c.reasons.size(); ++i) std::printf("%s%s", i ? "; " : " ", c.reasons[i].c_str());
      std::printf("\n");
    }
  }
  return valid ? 0 : 1;
}

int serve(const Args& a, const ModelSpec& m, const Topology& t) {
  const ServeSpec q{.batch = a.batch, .context = a.context, .kv_bytes = m.act_bytes};
  const auto plans = plan_serving(m, a.gpus, t, q);
  std::vector<std::vector<std::string>> reasons_of;
  bool usable = false;
  for (const auto& c : plans) reasons_of.push_back(c.reasons), usable = usable || c.reasons.empty();
  const std::string what = m.name + " serving on " + std::to_string(a.gpus) + " GPUs";
  if (!usable && !a.json) {
    std::cerr << "weft-plan: " << no_layout_message(what, reasons_of) << "\n";
    return 1;
  }
  if (a.json) {
    using weft::metrics::Json;
    Json::Array arr;
    for (const auto& c : plans) {
      Json j = Json::object();
      j.set("tp", c.tp).set("pp", c.pp).set("replicas", c.replicas);
      if (c.reasons.empty()) {
        Json mem = Json::object();
        mem.set("weights", c.memory.weights).set("kv_cache", c.memory.kv_cache).set("workspace", c.memory.workspace)
            .set("buffers", c.memory.buffers).set("headroom", c.memory.headroom).set("total", c.memory.total());
        j.set("fits", c.fits).set("memory_bytes", mem).set("tp_us_per_token", c.tp_us_per_token);
      } else {
        Json::Array rs;
        for (const auto& r : c.reasons) rs.push_back(r);
        j.set("reasons", Json(rs));
      }
      arr.push_back(j);
    }
    Json out = Json::object();
    out.set("model", m.name).set("gpus", a.gpus).set("topology", t.name).set("mode", "serve").set("batch", a.batch)
        .set("context", a.context).set("layouts", Json(arr));
    if (!usable) out.set("error", "no valid layout of " + what).set("top_rejection_reasons", top_reasons_json(reasons_of));
    std::cout << out.dump(2) << "\n";
    return usable ? 0 : 1;
  }
  std::printf("%s serving: batch %zu x context %zu on %zu GPUs (%.0f GB each)\n", m.name.c_str(), a.batch, a.context,
              a.gpus, t.memory_gb);
  std::printf("%-4s %-4s %-8s %5s %8s %8s %8s %8s %8s %12s  %s\n", "tp", "pp", "replicas", "fits", "total", "weights",
              "kv", "work", "buffers", "tp us/token", "note");
  for (const auto& c : plans) {
    if (!c.reasons.empty()) {
      std::printf("%-4zu %-4zu %-8zu %5s %8s %8s %8s %8s %8s %12s  %s\n", c.tp, c.pp, c.replicas, "-", "", "", "", "",
                  "", "", c.reasons.front().c_str());
      continue;
    }
    const auto& b = c.memory;
    std::printf("%-4zu %-4zu %-8zu %5s %7.1fG %8.1f %8.1f %8.2f %8.2f %12.1f\n", c.tp, c.pp, c.replicas,
                c.fits ? "yes" : "NO", gb(b.total()), gb(b.weights), gb(b.kv_cache), gb(b.workspace), gb(b.buffers),
                c.tp_us_per_token);
  }
  return 0;
}

}  // namespace

// --calibrate: every rank measures (weft::plan::calibrate), rank 0 writes
// the topology file. Its place is checked before anything is measured.
int calibrate(int argc, char** argv, const std::string& file) {
  weft::Environment env(argc, argv);
  const int rank = env.world().rank();
  int ok = 1;
  std::string why;
  if (rank == 0) {
    try {
      weft::check_output_file("--calibrate", file);
    } catch (const weft::Error& e) {
      ok = 0;
      why = e.what();
    }
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (!ok) {
    if (rank == 0) std::cerr << "weft-plan: " << why << "\n";
    return 2;
  }
  if (env.world().size() < 2) {
    std::cerr << "weft-plan: --calibrate on one rank has no link to measure; launch at least 2 ranks "
                 "(mpirun -n 4 with 2 slots on each of 2 hosts measures both links)\n";
    return 2;
  }
  const int per_node = weft::ranks_on_node(MPI_COMM_WORLD);
  const weft::ops::BlasThreads bt = weft::ops::set_blas_threads(0, per_node);
  if (rank == 0)
    std::printf("weft-plan: calibrating on %d ranks (%d BLAS thread(s) per rank): core peak, gemm, memory read, links\n",
                env.world().size(), bt.threads);
  std::fflush(stdout);
  weft::plan::Calibration c;
  try {
    c = weft::plan::calibrate(MPI_COMM_WORLD);
  } catch (const weft::Error& e) {  // printed here: leaving with it aborts the job (weft::Environment)
    std::cerr << "weft-plan: " << e.what() << "\n";
    return 2;
  }
  // A rank computes on its BLAS threads: its peak is theirs together.
  c.fma_gflops *= bt.threads;
  if (rank != 0) return 0;
  const std::string name = "calibrated on " + c.host + (c.hosts > 1 ? " and " + std::to_string(c.hosts - 1) + " more host(s)" : "") +
                           ": " + std::to_string(c.ranks) + " ranks, " + std::to_string(c.ranks_per_host) + " per host";
  try {
    weft::write_file_whole("--calibrate", file, c.json(name).dump(1) + "\n");
  } catch (const weft::Error& e) {  // a full disk since the check: said here, before weft::Environment ends the job
    std::cerr << "weft-plan: " << e.what() << "\n";
    return 2;
  }
  std::printf("weft-plan: per rank: fp32 FMA peak %.1f GFLOP/s (%s), gemm %.1f GFLOP/s (efficiency %.2f), read %.1f GB/s, "
              "memory %.2f GB\n",
              c.fma_gflops, c.fma_isa, c.gemm_gflops, std::min(1.0, c.gemm_gflops / c.fma_gflops), c.stream_read_gbs,
              c.memory_gb);
  std::printf("weft-plan: inside a host: %.3f GB/s, %.2f us%s; across hosts: %.3f GB/s, %.2f us%s\n", c.intra_bw_gbs,
              c.intra_latency_us, c.intra_measured ? "" : " (not measured: no second rank on rank 0's host)",
              c.inter_bw_gbs, c.inter_latency_us, c.inter_measured ? "" : " (not measured: one host; the figures inside it)");
  std::printf("weft-plan: topology written to %s (%d host(s))\n", file.c_str(), c.hosts);
  return 0;
}

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (!a.calibrate.empty()) {
    try {
      return calibrate(argc, argv, a.calibrate);
    } catch (const weft::Error& e) {
      std::cerr << "weft-plan: " << e.what() << "\n";
      return 2;
    }
  }
  try {
    ModelSpec m;
    if (!a.preset.empty()) {
      m = preset(a.preset);
    } else {
      m = model_from_json(parse_json(read_text_file(a.model_file), a.model_file), a.model_file);
    }
    Topology t;
    if (!a.topology_file.empty())
      t = topology_from_json(parse_json(read_text_file(a.topology_file), a.topology_file), a.topology_file);
    return a.serve ? serve(a, m, t) : train(a, m, t);
  } catch (const weft::Error& e) {
    std::cerr << "weft-plan: " << e.what() << "\n";
    return 2;
  }
}
