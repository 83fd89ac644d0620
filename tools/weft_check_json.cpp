// weft-check-json: validates JSON files (train_gpt run records) against a
// schema in the subset weft/plan/json_schema.hpp supports.
//   weft-check-json --schema docs/schema/run_record.schema.json run.json [more.json ...]
// Prints "FILE: valid" or one line per violation; exit status 0 when every
// file is valid, 1 when one is not, 2 for unreadable or malformed input.
#include <cstdio>
#include <string>
#include <vector>

#include <weft/plan/json_schema.hpp>
#include <weft/plan/presets.hpp>

int main(int argc, char** argv) {
  std::string schema_file;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--schema" && i + 1 < argc) {
      schema_file = argv[++i];
    } else if (a == "--help" || a == "-h" || a.rfind("--", 0) == 0) {
      std::fprintf(a == "--help" || a == "-h" ? stdout : stderr,
                   "usage: weft-check-json --schema SCHEMA.json FILE.json [FILE.json ...]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    } else {
      files.push_back(a);
    }
  }
  if (schema_file.empty() || files.empty()) {
    std::fprintf(stderr, "weft-check-json: give --schema SCHEMA.json and at least one file\n");
    return 2;
  }
  int status = 0;
  try {
    const auto schema = weft::plan::parse_json(weft::plan::read_text_file(schema_file), schema_file);
    for (const auto& f : files) {
      const auto errors = weft::plan::schema_errors(schema, weft::plan::parse_json(weft::plan::read_text_file(f), f));
      if (errors.empty()) std::printf("%s: valid\n", f.c_str());
      for (const auto& e : errors) std::printf("%s: %s\n", f.c_str(), e.c_str());
      if (!errors.empty()) status = 1;
    }
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "weft-check-json: %s\n", e.what());
    return 2;
  }
  return status;
}
