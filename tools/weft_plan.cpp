// weft-plan: ranks the parallel layouts of a model on a cluster (training) or
// the serving layouts of a replica (serving), as a table or as JSON.
//   weft-plan --preset NAME|--model FILE.json --gpus N [--topology FILE.json]
//             [--train|--serve] [--json] [--top K] [--batch B --context C]
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include <weft/metrics/json.hpp>
#include <weft/plan/presets.hpp>

namespace {

using namespace weft::plan;

struct Args {
  std::string preset, model_file, topology_file;
  std::size_t gpus = 0, top = 10, batch = 8, context = 4096;
  bool serve = false, json = false, rejected = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "weft-plan: " << why << "\n"
            << "usage: weft-plan --preset NAME|--model FILE.json --gpus N [--topology FILE.json] [--train|--serve]\n"
               "                 [--json] [--top K] [--rejected] [--batch B] [--context C]\n"
               "presets:";
  for (const auto& n : preset_names()) std::cerr << ' ' << n;
  std::cerr << "\n";
  std::exit(2);
}

std::size_t count(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!*v || *end || x <= 0) usage(flag + " " + v + ": expected a positive integer");
  return std::size_t(x);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage(f + " needs a value");
      return argv[++i];
    };
    if (f == "--preset") a.preset = next();
    else if (f == "--model") a.model_file = next();
    else if (f == "--topology") a.topology_file = next();
    else if (f == "--gpus") a.gpus = count(f, next());
    else if (f == "--top") a.top = count(f, next());
    else if (f == "--batch") a.batch = count(f, next());
    else if (f == "--context") a.context = count(f, next());
    else if (f == "--train") a.serve = false;
    else if (f == "--serve") a.serve = true;
    else if (f == "--json") a.json = true;
    else if (f == "--rejected") a.rejected = true;
    else if (f == "--help" || f == "-h") usage("help");
    else usage("unknown flag " + f);
  }
  if (a.preset.empty() == a.model_file.empty()) usage("give exactly one of --preset and --model");
  if (!a.gpus) usage("--gpus is required");
  return a;
}

std::string mesh_name(const MeshSpec& s) {
  std::string r = "dp=" + std::to_string(s.dp) + ",tp=" + std::to_string(s.tp) + ",pp=" + std::to_string(s.pp) +
                  ",cp=" + std::to_string(s.cp);
  if (s.ep > 1) r += ",ep=" + std::to_string(s.ep);
  return r;
}

double gb(double bytes) { return bytes / 1e9; }

int train(const Args& a, const ModelSpec& m, const Topology& t) {
  const auto ranked = rank_meshes(m, a.gpus, t);
  std::size_t valid = 0;
  for (const auto& c : ranked) valid += c.valid();
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
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("%s: %.2fB parameters, %zu GPUs (%s: %zu per node, %.0f GB each); %zu valid layouts of %zu\n",
              m.name.c_str(), double(m.total_params()) / 1e9, a.gpus, t.name.c_str(), t.gpus_per_node, t.memory_gb,
              valid, ranked.size());
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
    std::cout << out.dump(2) << "\n";
    return 0;
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

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
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
