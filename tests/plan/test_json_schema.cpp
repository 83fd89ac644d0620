// The run-record schema validator (weft/plan/json_schema.hpp): each keyword
// of its subset accepts what it should and rejects what it should, with the
// JSON path in the message; a record written by train_gpt passes the shipped
// schema, and the same record missing a field or with a wrong type fails it.
#include <algorithm>
#include <string>

#include <weft/plan/json_schema.hpp>
#include <weft/plan/presets.hpp>

#include "weft_test.hpp"

namespace {

using weft::plan::JsonValue;
using weft::plan::parse_json;
using weft::plan::schema_errors;

JsonValue shipped_schema() {
  const std::string path = std::string(WEFT_SOURCE_DIR) + "/docs/schema/run_record.schema.json";
  return parse_json(weft::plan::read_text_file(path), path);
}

JsonValue sample_record() {
  const std::string path = std::string(WEFT_SOURCE_DIR) + "/tests/plan/data/sample_run_record.json";
  return parse_json(weft::plan::read_text_file(path), path);
}

// The member `key` of an object (which must have it).
JsonValue& member(JsonValue& v, const std::string& key) {
  for (std::size_t i = 0; i < v.keys.size(); ++i)
    if (v.keys[i] == key) return v.members[i];
  FAIL("no member " << key);
  return v;
}

void erase(JsonValue& v, const std::string& key) {
  for (std::size_t i = 0; i < v.keys.size(); ++i)
    if (v.keys[i] == key) {
      v.keys.erase(v.keys.begin() + long(i));
      v.members.erase(v.members.begin() + long(i));
      return;
    }
  FAIL("no member " << key);
}

bool has(const std::vector<std::string>& errors, const std::string& text) {
  for (const auto& e : errors)
    if (e.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("schema: type, including integer and type lists") {
  const auto s = parse_json(R"({"type": "integer"})");
  CHECK(schema_errors(s, parse_json("3")).empty());
  CHECK(schema_errors(s, parse_json("-3")).empty());
  const auto e = schema_errors(s, parse_json("3.5"));
  REQUIRE(e.size() == 1);
  CHECK(e[0] == "$: expected integer, got number");
  CHECK(has(schema_errors(s, parse_json(R"("3")")), "expected integer, got string"));
  const auto n = parse_json(R"({"type": "number"})");
  CHECK(schema_errors(n, parse_json("3")).empty());
  CHECK(schema_errors(n, parse_json("3.25")).empty());
  CHECK(has(schema_errors(n, parse_json("null")), "expected number, got null"));
  const auto either = parse_json(R"({"type": ["number", "null"]})");
  CHECK(schema_errors(either, parse_json("null")).empty());
  CHECK(schema_errors(either, parse_json("1e-9")).empty());
  CHECK(has(schema_errors(either, parse_json("true")), "expected number or null, got boolean"));
  CHECK_THROWS_WITH_AS(schema_errors(parse_json(R"({"type": "float"})"), parse_json("1")),
                       doctest::Contains("unknown type \"float\""), weft::ConfigError);
}

TEST_CASE("schema: required, properties and items name the path") {
  const auto s = parse_json(R"({"type": "object", "required": ["a", "b"],
    "properties": {"a": {"type": "array", "items": {"type": "object", "required": ["x"],
                                                     "properties": {"x": {"type": "string"}}}},
                   "b": {"type": "boolean"}}})");
  CHECK(schema_errors(s, parse_json(R"({"a": [{"x": "1"}, {"x": "2", "y": 0}], "b": false, "extra": 1})")).empty());
  const auto e = schema_errors(s, parse_json(R"({"a": [{"x": "1"}, {"x": 2}, {}]})"));
  REQUIRE(e.size() == 3);
  CHECK(has(e, "$: required field \"b\" is missing"));
  CHECK(has(e, "$.a[1].x: expected string, got number"));
  CHECK(has(e, "$.a[2]: required field \"x\" is missing"));
  CHECK(has(schema_errors(s, parse_json("[]")), "$: expected object, got array"));
}

TEST_CASE("schema: enum and minimum") {
  const auto s = parse_json(R"({"type": "object", "properties": {
    "mode": {"type": "string", "enum": ["replicate", "fsdp"]},
    "n": {"type": "integer", "minimum": 1}, "t": {"type": ["number", "null"], "minimum": 0}}})");
  CHECK(schema_errors(s, parse_json(R"({"mode": "fsdp", "n": 1, "t": 0})")).empty());
  CHECK(schema_errors(s, parse_json(R"({"t": null})")).empty());
  CHECK(has(schema_errors(s, parse_json(R"({"mode": "zero3"})")), "$.mode: \"zero3\" is not one of \"replicate\", \"fsdp\""));
  CHECK(has(schema_errors(s, parse_json(R"({"n": 0})")), "$.n: 0 is less than the minimum 1"));
  CHECK(has(schema_errors(s, parse_json(R"({"t": -0.5})")), "$.t: -0.5 is less than the minimum 0"));
}

TEST_CASE("schema: keywords outside the subset are refused, not ignored") {
  CHECK_THROWS_WITH_AS(schema_errors(parse_json(R"({"type": "string", "pattern": "^a"})"), parse_json(R"("b")")),
                       doctest::Contains("keyword \"pattern\" is not supported"), weft::ConfigError);
  CHECK_THROWS_WITH_AS(
      schema_errors(parse_json(R"({"properties": {"a": {"additionalProperties": false}}})"), parse_json(R"({"a": {}})")),
      doctest::Contains("schema $.properties.a: keyword \"additionalProperties\""), weft::ConfigError);
}

TEST_CASE("schema: a train_gpt record passes the shipped schema") {
  const auto schema = shipped_schema();
  const auto errors = schema_errors(schema, sample_record());
  for (const auto& e : errors) INFO(e);
  CHECK(errors.empty());
}

TEST_CASE("schema: the record missing a field fails, naming it") {
  const auto schema = shipped_schema();
  for (const char* key : {"git_commit", "mfu", "exposed_comm_seconds", "loss_parity", "checkpoint_seconds", "counters", "identity"}) {
    auto rec = sample_record();
    erase(rec, key);
    const auto e = schema_errors(schema, rec);
    CHECK(e.size() == 1);
    CHECK(has(e, std::string("$: required field \"") + key + "\" is missing"));
  }
  auto rec = sample_record();
  erase(member(rec, "memory_bytes_per_rank").array[1], "activations");
  erase(member(member(rec, "step_time_seconds"), "slowest"), "rank");
  const auto e = schema_errors(schema, rec);
  CHECK(e.size() == 2);
  CHECK(has(e, "$.memory_bytes_per_rank[1]: required field \"activations\" is missing"));
  CHECK(has(e, "$.step_time_seconds.slowest: required field \"rank\" is missing"));
}

TEST_CASE("schema: the topology names the axes that cross hosts and the transport") {
  const auto schema = shipped_schema();
  auto rec = sample_record();
  auto& topo = member(rec, "topology");
  member(topo, "axes_crossing_hosts") = parse_json(R"(["tp", "xp"])");
  member(member(topo, "transport"), "between_hosts") = parse_json("7");
  erase(topo, "axes_inside_host");
  const auto e = schema_errors(schema, rec);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 3);
  CHECK(has(e, "$.topology.axes_crossing_hosts[1]: \"xp\" is not one of"));
  CHECK(has(e, "$.topology.transport.between_hosts: expected string or null, got number"));
  CHECK(has(e, "$.topology: required field \"axes_inside_host\" is missing"));
}

TEST_CASE("schema: the record with a wrong type or value fails, naming the path") {
  const auto schema = shipped_schema();
  auto rec = sample_record();
  member(rec, "tokens_per_second") = parse_json(R"("fast")");
  member(member(rec, "batch"), "global_tokens") = parse_json("128.5");
  member(member(rec, "mesh"), "dp_mode") = parse_json(R"("zero3")");
  member(rec, "input_stall_seconds") = parse_json("-1");
  member(rec, "loss").array[3] = parse_json(R"("5.1")");
  member(rec, "checkpoint_seconds") = parse_json("false");
  const auto e = schema_errors(schema, rec);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 6);
  CHECK(has(e, "$.tokens_per_second: expected number, got string"));
  CHECK(has(e, "$.batch.global_tokens: expected integer, got number"));
  CHECK(has(e, "$.mesh.dp_mode: \"zero3\" is not one of"));
  CHECK(has(e, "$.input_stall_seconds: -1 is less than the minimum 0"));
  CHECK(has(e, "$.loss[3]: expected number, got string"));
  CHECK(has(e, "$.checkpoint_seconds: expected number or null, got boolean"));
}

TEST_CASE("schema: the identity names the build and the machine; a host-only run's gpu is null") {
  const auto schema = shipped_schema();
  auto rec = sample_record();
  auto& id = member(rec, "identity");
  CHECK(member(id, "gpu").kind == JsonValue::Kind::null);
  member(id, "gpu") = parse_json(R"({"runtime": "cuda"})");
  erase(member(id, "cpu"), "isa");
  member(member(id, "compiler"), "flags") = parse_json("false");
  const auto e = schema_errors(schema, rec);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 3);
  CHECK(has(e, "$.identity.gpu: required field \"model\" is missing"));
  CHECK(has(e, "$.identity.cpu: required field \"isa\" is missing"));
  CHECK(has(e, "$.identity.compiler.flags: expected string or null, got boolean"));
}

// The moe object of a mixture-of-experts run (two steps of train_gpt
// --experts 4 --top-k 2 --capacity-factor 1.0), null for a dense one.
TEST_CASE("schema: the moe object of a MoE record is checked, null passes") {
  const auto schema = shipped_schema();
  const std::string moe = R"({"experts": 4, "top_k": 2, "dropless": false, "capacity_factor": 1, "router": "softmax", "normalize_gates": true, "aux_loss_coefficient": 0.01, "z_loss_coefficient": 0.001, "bias_balance": 0.001, "moe_every": 1, "moe_layers": 2, "shared_experts": 0, "expert_hidden": 128, "tokens_per_expert_min": [41, 9], "tokens_per_expert_mean": [64, 64], "tokens_per_expert_max": [83, 120], "imbalance": [1.2969, 1.875], "routing_entropy": [1.382, 1.3817], "dropped_slots": [44, 104], "dropped_fraction": [0.0859, 0.2031], "aux_loss": [0.0201, 0.0206], "z_loss": [0.004, 0.0039], "tokens_per_expert": [[41, 83, 60, 72, 9, 120, 70, 57], [50, 70, 66, 70, 12, 110, 75, 59]], "route_loss": [[5.51, 5.49, 5.6, 5.52, 5.7, 5.48, 5.5, 5.53], [5.4, 5.38, null, 5.41, 5.6, 5.37, 5.39, 5.42]], "exchange_seconds": [0, 0], "exchange_bytes": [0, 0], "note": "per step"})";
  auto rec = sample_record();
  rec.keys.push_back("moe");
  rec.members.push_back(parse_json(moe));
  CHECK(schema_errors(schema, rec).empty());
  member(member(rec, "moe"), "imbalance").array[1] = parse_json(R"("high")");
  member(member(rec, "moe"), "router") = parse_json(R"("argmax")");
  erase(member(rec, "moe"), "dropped_slots");
  member(member(rec, "moe"), "route_loss").array[0].array[2] = parse_json(R"("low")");
  auto e = schema_errors(schema, rec);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 4);
  CHECK(has(e, "$.moe.route_loss[0][2]: expected number or null, got string"));
  CHECK(has(e, "$.moe.imbalance[1]: expected number, got string"));
  CHECK(has(e, "$.moe.router: \"argmax\" is not one of"));
  CHECK(has(e, "$.moe: required field \"dropped_slots\" is missing"));
  member(rec, "moe") = parse_json("null");
  CHECK(schema_errors(schema, rec).empty());
  // A pipeline run does not measure the route quality: route_loss null passes.
  rec.members.back() = parse_json(moe);
  member(member(rec, "moe"), "route_loss") = parse_json("null");
  CHECK(schema_errors(schema, rec).empty());
}

// A run stops at its first non-finite loss, so a record with a null loss
// (what JSON writes for NaN) did not come from a run that checked. A null
// gradient norm is an fp16 step skipped for overflow (its norm is infinite
// by design; the step is listed in loss_scale.skipped), so the schema takes it.
TEST_CASE("schema: a null loss and an unknown stop reason fail; a skipped fp16 step's null gradient norm passes") {
  const auto schema = shipped_schema();
  auto rec = sample_record();
  member(rec, "loss").array[1] = parse_json("null");
  member(rec, "grad_norm").array[2] = parse_json("null");
  rec.keys.push_back("stop");
  rec.members.push_back(parse_json(R"({"reason": "tired", "steps_completed": 3})"));
  const auto e = schema_errors(schema, rec);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 2);
  CHECK(has(e, "$.loss[1]: expected number, got null"));
  CHECK(has(e, "$.stop.reason: \"tired\" is not one of \"completed\", \"diverged\""));
  member(rec, "stop") = parse_json(R"({"reason": "diverged", "steps_completed": 3, "step": 3, "loss": "nan"})");
  member(rec, "loss").array[1] = parse_json("2.5");
  member(rec, "grad_norm").array[2] = parse_json("\"inf\"");
  CHECK(has(schema_errors(schema, rec), "$.grad_norm[2]: expected number or null, got string"));
  member(rec, "grad_norm").array[2] = parse_json("1.5");
  CHECK(schema_errors(schema, rec).empty());
}

// fp16 runs record their loss scaler (train_gpt's loss_scale; null otherwise).
TEST_CASE("schema: the loss scaler of an fp16 record is checked") {
  const auto schema = shipped_schema();
  auto rec = sample_record();
  CHECK(schema_errors(schema, rec).empty());
  const std::string scaler = R"({"initial": 16777216, "min": 1, "growth_interval": 1000, "hysteresis": 2,
      "growth_factor": 2, "backoff_factor": 0.5, "scale": 4194304, "growth_tracker": 1, "hysteresis_tracker": 0,
      "skipped_steps": 2, "per_step": [16777216, 16777216, 8388608, 4194304], "skipped": [0, 1]})";
  auto with = [&](const std::string& text) {
    auto r = rec;
    const auto it = std::find(r.keys.begin(), r.keys.end(), "loss_scale");
    if (it == r.keys.end()) {
      r.keys.push_back("loss_scale");
      r.members.push_back(parse_json(text));
    } else {
      r.members[std::size_t(it - r.keys.begin())] = parse_json(text);
    }
    return schema_errors(schema, r);
  };
  CHECK(with("null").empty());
  CHECK(with(scaler).empty());
  std::string negative = scaler;
  negative.replace(negative.find(R"("skipped": [0, 1])"), std::string(R"("skipped": [0, 1])").size(), R"("skipped": [-1])");
  CHECK(has(with(negative), "$.loss_scale.skipped[0]: -1 is less than the minimum 0"));
  std::string text_scale = scaler;
  text_scale.replace(text_scale.find(R"("scale": 4194304)"), std::string(R"("scale": 4194304)").size(), R"("scale": "big")");
  CHECK(has(with(text_scale), "$.loss_scale.scale: expected number"));
  CHECK(has(with(R"({"initial": 65536})"), "$.loss_scale: required field \"per_step\" is missing"));
}

// The Kokkos event counters (weft/metrics/counters.hpp) of both records:
// train_gpt's first step and the steps after it, serve_gpt's first step and
// its decode steps; every count a non-negative integer, a missing one named.
TEST_CASE("schema: the counters of the train and serve records are checked") {
  const auto schema = shipped_schema();
  auto rec = sample_record();
  auto& c = member(rec, "counters");
  member(member(c, "first_step"), "kernels") = parse_json("12.5");
  member(member(c, "after_first"), "allocations") = parse_json("-1");
  erase(member(c, "after_first"), "deep_copies_host_device");
  member(c, "fences_reported") = parse_json("0");
  auto e = schema_errors(schema, rec);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 4);
  CHECK(has(e, "$.counters.first_step.kernels: expected integer, got number"));
  CHECK(has(e, "$.counters.after_first.allocations: -1 is less than the minimum 0"));
  CHECK(has(e, "$.counters.after_first: required field \"deep_copies_host_device\" is missing"));
  CHECK(has(e, "$.counters.fences_reported: expected boolean, got number"));
  member(member(rec, "counters"), "after_first") = parse_json("null");  // a one-step run
  member(member(member(rec, "counters"), "first_step"), "kernels") = parse_json("12");
  member(member(rec, "counters"), "fences_reported") = parse_json("false");
  CHECK(schema_errors(schema, rec).empty());

  const std::string path = std::string(WEFT_SOURCE_DIR) + "/docs/schema/serve_record.schema.json";
  auto serve = parse_json(weft::plan::read_text_file(path), path);
  CHECK(has(schema_errors(serve, parse_json("{}")), "$: required field \"counters\" is missing"));
  const auto& sc = member(member(serve, "properties"), "counters");
  const std::string counts = R"({"kernels": 35, "parallel_for": 34, "parallel_reduce": 1, "parallel_scan": 0, "fences": 0,
    "deep_copies_host_device": 5, "deep_copies_same_space": 1, "fills": 0, "allocations": 1, "allocated_bytes": 2048})";
  auto ok = parse_json(R"({"first_step": )" + counts + R"(, "decode_step": )" + counts +
                       R"(, "decode_steps_counted": 4, "decode_sequences_max": 2, "fences_reported": false})");
  CHECK(schema_errors(sc, ok).empty());
  member(ok, "decode_step") = parse_json("null");
  CHECK(schema_errors(sc, ok).empty());
  erase(member(ok, "first_step"), "fences");
  member(ok, "decode_steps_counted") = parse_json(R"("4")");
  e = schema_errors(sc, ok);
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 2);
  CHECK(has(e, "$.first_step: required field \"fences\" is missing"));
  CHECK(has(e, "$.decode_steps_counted: expected integer, got string"));
}

// serve_gpt's record: every request's prompt (token ids, the --prompts file's
// or drawn), prompt_dist "file", and the --baseline parity with the first
// difference (docs/serving.md).
TEST_CASE("schema: serve_gpt's prompts and baseline parity are checked") {
  const std::string path = std::string(WEFT_SOURCE_DIR) + "/docs/schema/serve_record.schema.json";
  auto serve = parse_json(weft::plan::read_text_file(path), path);
  CHECK(has(schema_errors(serve, parse_json("{}")), "$: required field \"prompts\" is missing"));
  auto& props = member(serve, "properties");
  const auto& prompts = member(props, "prompts");
  CHECK(schema_errors(prompts, parse_json("[[1, 2], [0], []]")).empty());
  auto e = schema_errors(prompts, parse_json("[[1, -2], [0.5]]"));
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 2);
  CHECK(has(e, "$[0][1]: -2 is less than the minimum 0"));
  CHECK(has(e, "$[1][0]: expected integer, got number"));
  const auto& dist = member(member(member(props, "traffic"), "properties"), "prompt_dist");
  CHECK(schema_errors(dist, parse_json(R"("file")")).empty());
  CHECK(has(schema_errors(dist, parse_json(R"("gaussian")")), "is not one of"));
  const auto& base = member(props, "baseline");
  CHECK(schema_errors(base, parse_json("null")).empty());
  CHECK(schema_errors(base, parse_json(R"({"file": "a.json", "requests": 4, "match": true, "identical_tokens": 14,
                                          "first_difference": null})")).empty());
  CHECK(schema_errors(base, parse_json(R"({"file": "a.json", "requests": 4, "match": false, "identical_tokens": 3,
                                          "first_difference": {"request": 1, "token": 0}})")).empty());
  e = schema_errors(base, parse_json(R"({"file": "a.json", "requests": 4, "match": "no", "identical_tokens": 3,
                                        "first_difference": {"request": 1}})"));
  for (const auto& x : e) INFO(x);
  CHECK(e.size() == 2);
  CHECK(has(e, "$.match: expected boolean, got string"));
  CHECK(has(e, "$.first_difference: required field \"token\" is missing"));
}
