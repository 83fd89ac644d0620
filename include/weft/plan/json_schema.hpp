// A validator for the subset of JSON Schema that weft's run-record schema
// (docs/schema/run_record.schema.json) uses: type, required, properties,
// items, enum and minimum, plus the annotations $schema, $id, title and
// description. A schema that uses any other keyword is rejected rather than
// half-checked, so a record is never reported valid against rules that were
// silently ignored.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/plan/json_read.hpp>

namespace weft::plan {

namespace detail {

inline const char* json_kind_name(JsonValue::Kind k) {
  switch (k) {
    case JsonValue::Kind::null: return "null";
    case JsonValue::Kind::boolean: return "boolean";
    case JsonValue::Kind::number: return "number";
    case JsonValue::Kind::string: return "string";
    case JsonValue::Kind::array: return "array";
    case JsonValue::Kind::object: return "object";
  }
  return "unknown";
}

// Whether v is of the JSON Schema type named t ("integer": a number without a fraction).
inline bool json_is_type(const JsonValue& v, const std::string& t, const std::string& where) {
  if (t == "integer") return v.kind == JsonValue::Kind::number && std::floor(v.number) == v.number;
  if (t == "number" || t == "null" || t == "boolean" || t == "string" || t == "array" || t == "object")
    return t == json_kind_name(v.kind);
  ::weft::detail::throw_error<ConfigError>("schema ", where, ": unknown type \"", t,
                                           "\"; expected null, boolean, number, integer, string, array or object");
}

inline bool json_equal(const JsonValue& a, const JsonValue& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case JsonValue::Kind::null: return true;
    case JsonValue::Kind::boolean: return a.boolean == b.boolean;
    case JsonValue::Kind::number: return a.number == b.number;
    case JsonValue::Kind::string: return a.string == b.string;
    case JsonValue::Kind::array:
      if (a.array.size() != b.array.size()) return false;
      for (std::size_t i = 0; i < a.array.size(); ++i)
        if (!json_equal(a.array[i], b.array[i])) return false;
      return true;
    case JsonValue::Kind::object:
      if (a.keys.size() != b.keys.size()) return false;
      for (std::size_t i = 0; i < a.keys.size(); ++i) {
        const JsonValue* o = b.find(a.keys[i]);
        if (!o || !json_equal(a.members[i], *o)) return false;
      }
      return true;
  }
  return false;
}

inline std::string json_brief(const JsonValue& v) {
  switch (v.kind) {
    case JsonValue::Kind::string: return "\"" + v.string + "\"";
    case JsonValue::Kind::number: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", v.number);
      return buf;
    }
    case JsonValue::Kind::boolean: return v.boolean ? "true" : "false";
    default: return json_kind_name(v.kind);
  }
}

// spath: where in the schema (for schema errors); path: where in the document.
inline void schema_check(const JsonValue& schema, const JsonValue& v, const std::string& spath, const std::string& path,
                         std::vector<std::string>& errors) {
  WEFT_REQUIRE(schema.kind == JsonValue::Kind::object, ConfigError, "schema ", spath, ": expected an object");
  for (const auto& k : schema.keys) {
    const bool known = k == "type" || k == "required" || k == "properties" || k == "items" || k == "enum" ||
                       k == "minimum" || k == "$schema" || k == "$id" || k == "title" || k == "description";
    WEFT_REQUIRE(known, ConfigError, "schema ", spath, ": keyword \"", k,
                 "\" is not supported (type, required, properties, items, enum, minimum and annotations are)");
  }
  if (const JsonValue* t = schema.find("type")) {
    std::vector<std::string> types;
    if (t->kind == JsonValue::Kind::string) {
      types.push_back(t->string);
    } else {
      WEFT_REQUIRE(t->kind == JsonValue::Kind::array && !t->array.empty(), ConfigError, "schema ", spath,
                   ".type: expected a type name or a non-empty array of them");
      for (const auto& x : t->array) {
        WEFT_REQUIRE(x.kind == JsonValue::Kind::string, ConfigError, "schema ", spath, ".type: expected type names");
        types.push_back(x.string);
      }
    }
    bool ok = false;
    std::string names;
    for (const auto& name : types) {
      ok = json_is_type(v, name, spath + ".type") || ok;
      names += (names.empty() ? "" : " or ") + name;
    }
    if (!ok) {
      errors.push_back(path + ": expected " + names + ", got " + json_kind_name(v.kind));
      return;  // the remaining keywords would only repeat the mismatch
    }
  }
  if (const JsonValue* e = schema.find("enum")) {
    WEFT_REQUIRE(e->kind == JsonValue::Kind::array, ConfigError, "schema ", spath, ".enum: expected an array");
    bool found = false;
    std::string list;
    for (const auto& x : e->array) {
      found = found || json_equal(x, v);
      list += std::string(list.empty() ? "" : ", ").append(json_brief(x));
    }
    if (!found) errors.push_back(path + ": " + json_brief(v) + " is not one of " + list);
  }
  if (const JsonValue* m = schema.find("minimum")) {
    WEFT_REQUIRE(m->kind == JsonValue::Kind::number, ConfigError, "schema ", spath, ".minimum: expected a number");
    if (v.kind == JsonValue::Kind::number && !(v.number >= m->number))
      errors.push_back(path + ": " + json_brief(v) + " is less than the minimum " + json_brief(*m));
  }
  if (const JsonValue* r = schema.find("required")) {
    WEFT_REQUIRE(r->kind == JsonValue::Kind::array, ConfigError, "schema ", spath, ".required: expected an array");
    if (v.kind == JsonValue::Kind::object)
      for (const auto& name : r->array) {
        WEFT_REQUIRE(name.kind == JsonValue::Kind::string, ConfigError, "schema ", spath, ".required: expected names");
        if (!v.find(name.string)) errors.push_back(path + ": required field \"" + name.string + "\" is missing");
      }
  }
  if (const JsonValue* p = schema.find("properties")) {
    WEFT_REQUIRE(p->kind == JsonValue::Kind::object, ConfigError, "schema ", spath, ".properties: expected an object");
    if (v.kind == JsonValue::Kind::object)
      for (std::size_t i = 0; i < p->keys.size(); ++i)
        if (const JsonValue* x = v.find(p->keys[i]))
          schema_check(p->members[i], *x, spath + ".properties." + p->keys[i], path + "." + p->keys[i], errors);
  }
  if (const JsonValue* it = schema.find("items")) {
    if (v.kind == JsonValue::Kind::array)
      for (std::size_t i = 0; i < v.array.size(); ++i)
        schema_check(*it, v.array[i], spath + ".items", path + "[" + std::to_string(i) + "]", errors);
  }
}

}  // namespace detail

/// Every way `doc` violates `schema`, one message each naming the JSON path
/// ("$.memory_bytes_per_rank[1].parameters: expected integer, got string");
/// empty when the document is valid. Throws ConfigError, naming the place in
/// the schema, when the schema itself is malformed or uses a keyword outside
/// the supported subset (type, required, properties, items, enum, minimum).
inline std::vector<std::string> schema_errors(const JsonValue& schema, const JsonValue& doc) {
  std::vector<std::string> errors;
  detail::schema_check(schema, doc, "$", "$", errors);
  return errors;
}

}  // namespace weft::plan
