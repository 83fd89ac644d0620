// Published shapes of well-known open models as planner inputs, and the
// reader of model and topology description files (JSON).
#pragma once

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <weft/plan/json_read.hpp>
#include <weft/plan/meshes.hpp>
#include <weft/plan/model.hpp>

namespace weft::plan {

/// Names preset() knows.
inline std::vector<std::string> preset_names() { return {"gpt2-small", "llama2-7b", "llama2-70b", "mixtral-8x7b"}; }

/// A published model shape trained in BF16 with FP32 AdamW moments and
/// master weights (2 + 2 + 12 bytes a parameter), flash attention, 4096-token
/// sequences, micro-batch 1 and a 1024-sequence global batch (GPT-2: 1024
/// tokens, 512 sequences). Throws ConfigError for an unknown name.
inline ModelSpec preset(const std::string& name) {
  ModelSpec m;
  m.name = name;
  m.param_bytes = 2;
  m.grad_bytes = 2;
  m.optim_bytes = 4;
  m.master_bytes = 4;
  m.act_bytes = 2;
  m.flash_attention = true;
  m.micro_batch = 1;
  if (name == "gpt2-small") {  // Radford et al. 2019 (124M; head untied here)
    m.layers = 12, m.d_model = 768, m.heads = 12, m.vocab = 50257, m.seq = 1024, m.global_batch = 512;
    return m;
  }
  // Llama family: SwiGLU, RMSNorm, rotary positions, no biases.
  m.mlp = Mlp::swiglu, m.bias = false, m.layernorm = false, m.learned_positions = false;
  m.vocab = 32000, m.seq = 4096, m.global_batch = 1024;
  if (name == "llama2-7b") {  // Touvron et al. 2023
    m.layers = 32, m.d_model = 4096, m.heads = 32, m.ffn_hidden = 11008;
  } else if (name == "llama2-70b") {
    m.layers = 80, m.d_model = 8192, m.heads = 64, m.kv_heads = 8, m.ffn_hidden = 28672;
  } else if (name == "mixtral-8x7b") {  // Jiang et al. 2024
    m.layers = 32, m.d_model = 4096, m.heads = 32, m.kv_heads = 8, m.ffn_hidden = 14336, m.experts = 8, m.top_k = 2;
  } else {
    std::string all;
    for (const auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    ::weft::detail::throw_error<ConfigError>("--preset ", name, ": unknown preset; expected one of ", all);
  }
  return m;
}

/// The largest value model_from_json accepts for a field (the bytes fields
/// share "bytes", kv_heads, top_k and shared_experts share heads' and experts'): large enough
/// for any real model, small enough that parameter counts stay exact.
inline std::size_t model_field_max(const std::string& field) {
  if (field == "layers" || field == "ffn_hidden") return std::size_t(1) << 20;
  if (field == "d_model" || field == "heads") return std::size_t(1) << 18;
  if (field == "experts") return std::size_t(1) << 16;
  if (field == "bytes") return 16;
  if (field == "global_batch") return std::size_t(1) << 30;
  return std::size_t(1) << 24;  // vocab, seq, micro_batch
}

/// The whole text of a file; ConfigError naming it if unreadable.
inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path);
  WEFT_REQUIRE(in.good(), ConfigError, path, ": cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A model from a JSON object whose fields are ModelSpec's names; "preset"
/// starts from a preset, other fields override it. Without a preset the
/// shape and batch fields (layers, d_model, heads, vocab, seq, micro_batch,
/// global_batch) are required: a default there would plan another model.
/// Every integer field has a largest accepted value (model_field_max), so
/// that no product of them overflows.
inline ModelSpec model_from_json(const JsonValue& v, const std::string& what) {
  JsonFields f(v, what);
  const std::string base = f.text("preset", "");
  ModelSpec m = base.empty() ? ModelSpec{} : preset(base);
  m.name = f.text("name", base.empty() ? m.name : base);
  m.layers = f.size("layers", m.layers, model_field_max("layers"));
  m.d_model = f.size("d_model", m.d_model, model_field_max("d_model"));
  m.heads = f.size("heads", m.heads, model_field_max("heads"));
  m.kv_heads = f.size("kv_heads", m.kv_heads, model_field_max("heads"));
  m.ffn_hidden = f.size("ffn_hidden", m.ffn_hidden, model_field_max("ffn_hidden"));
  m.vocab = f.size("vocab", m.vocab, model_field_max("vocab"));
  m.experts = f.size("experts", m.experts, model_field_max("experts"));
  m.top_k = f.size("top_k", m.top_k, model_field_max("experts"));
  m.shared_experts = f.size("shared_experts", m.shared_experts, model_field_max("experts"));
  m.seq = f.size("seq", m.seq, model_field_max("seq"));
  m.micro_batch = f.size("micro_batch", m.micro_batch, model_field_max("micro_batch"));
  m.global_batch = f.size("global_batch", m.global_batch, model_field_max("global_batch"));
  m.mlp = f.choice("mlp", m.mlp == Mlp::gelu ? "gelu" : "swiglu", {"gelu", "swiglu"}) == "gelu" ? Mlp::gelu : Mlp::swiglu;
  m.bias = f.flag("bias", m.bias);
  m.layernorm = f.choice("norm", m.layernorm ? "layernorm" : "rmsnorm", {"layernorm", "rmsnorm"}) == "layernorm";
  m.learned_positions = f.choice("positions", m.learned_positions ? "learned" : "rotary", {"learned", "rotary"}) == "learned";
  m.flash_attention = f.flag("flash_attention", m.flash_attention);
  m.param_bytes = f.size("param_bytes", m.param_bytes, model_field_max("bytes"));
  m.grad_bytes = f.size("grad_bytes", m.grad_bytes, model_field_max("bytes"));
  m.optim_bytes = f.size("optim_bytes", m.optim_bytes, model_field_max("bytes"));
  m.master_bytes = f.size("master_bytes", m.master_bytes, model_field_max("bytes"));
  m.act_bytes = f.size("act_bytes", m.act_bytes, model_field_max("bytes"));
  m.saved_bytes = f.size("saved_bytes", m.saved_bytes, model_field_max("bytes"));
  m.product_bytes = f.size("product_bytes", m.product_bytes, model_field_max("bytes"));
  m.optimizer = f.choice("optimizer", m.optimizer == Optimizer::adamw ? "adamw" : "sgd", {"adamw", "sgd"}) == "adamw"
                    ? Optimizer::adamw
                    : Optimizer::sgd;
  m.sgd_momentum = f.flag("sgd_momentum", m.sgd_momentum);
  m.recompute = f.flag("recompute", m.recompute);
  f.no_unknown();
  if (base.empty()) {
    std::string missing;
    for (const char* k : {"layers", "d_model", "heads", "vocab", "seq", "micro_batch", "global_batch"})
      if (!f.has(k)) missing += std::string(missing.empty() ? "\"" : ", \"") + k + "\"";
    WEFT_REQUIRE(missing.empty(), ConfigError, what, ": required field", missing.find(',') == std::string::npos ? " " : "s ",
                 missing, " missing; a model file gives its shape (layers, d_model, heads, vocab, seq) and batch "
                 "(micro_batch, global_batch), or names a \"preset\" to start from");
  }
  m.validate();
  return m;
}

/// A topology from a JSON object whose fields are Topology's names.
inline Topology topology_from_json(const JsonValue& v, const std::string& what) {
  JsonFields f(v, what);
  Topology t;
  t.name = f.text("name", t.name);
  t.gpus_per_node = f.size("gpus_per_node", t.gpus_per_node, max_gpus);
  WEFT_REQUIRE(t.gpus_per_node > 0, ConfigError, what, ": field \"gpus_per_node\" must be positive");
  t.memory_gb = f.positive("memory_gb", t.memory_gb);
  t.peak_tflops = f.positive("peak_tflops", t.peak_tflops);
  t.compute_efficiency = f.positive("compute_efficiency", t.compute_efficiency);
  t.intra_bw_gbs = f.positive("intra_bw_gbs", t.intra_bw_gbs);
  t.intra_latency_us = f.positive("intra_latency_us", t.intra_latency_us);
  t.inter_bw_gbs = f.positive("inter_bw_gbs", t.inter_bw_gbs);
  t.inter_latency_us = f.positive("inter_latency_us", t.inter_latency_us);
  t.headroom_fraction = f.positive("headroom_fraction", t.headroom_fraction);
  if (const JsonValue* levels = f.array("switch_levels")) {
    for (std::size_t k = 0; k < levels->array.size(); ++k) {
      const std::string where = what + ": switch_levels[" + std::to_string(k) + "]";
      JsonFields lf(levels->array[k], where);
      Topology::SwitchLevel l;
      l.nodes = lf.size("nodes", 0, max_gpus);
      l.bw_gbs = lf.positive("bw_gbs", t.inter_bw_gbs);
      l.latency_us = lf.positive("latency_us", t.inter_latency_us);
      lf.no_unknown();
      WEFT_REQUIRE(l.nodes >= 1, ConfigError, where, ": field \"nodes\" must be at least 1");
      WEFT_REQUIRE(t.switch_levels.empty() || l.nodes > t.switch_levels.back().nodes, ConfigError, where,
                   ": field \"nodes\" is ", l.nodes, "; switch levels go innermost first, each joining more nodes than the one before (",
                   t.switch_levels.empty() ? 0 : t.switch_levels.back().nodes, ")");
      t.switch_levels.push_back(l);
    }
  }
  // What weft-plan --calibrate measured (plan/calibrate.hpp): kept in the
  // file for the reader, not used by the planner.
  if (f.has("calibration"))
    WEFT_REQUIRE(v.find("calibration")->kind == JsonValue::Kind::object, ConfigError, what,
                 ": field \"calibration\" must be an object (the figures weft-plan --calibrate measured)");
  f.no_unknown();
  WEFT_REQUIRE(t.compute_efficiency <= 1, ConfigError, what, ": field \"compute_efficiency\" is ", t.compute_efficiency,
               "; expected a fraction in (0, 1]");
  return t;
}

}  // namespace weft::plan
