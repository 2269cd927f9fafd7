// json.hpp — the little JSON ikbo-bench writes: objects built field by field
// (insertion order kept), strings escaped, numbers with 6 significant digits,
// non-finite or absent numbers as null.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace ikbo::bench {

inline std::string json_quote(std::string_view text) {
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      quoted += '\\';
      quoted += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(c));
      quoted += escape;
    } else {
      quoted += c;
    }
  }
  return quoted + '"';
}

class JsonObject {
 public:
  JsonObject& add(std::string_view key, std::string_view value) {
    return add_json(key, json_quote(value));
  }
  // Without this, a string literal would convert to bool before string_view.
  JsonObject& add(std::string_view key, const char* value) {
    return add(key, std::string_view(value));
  }
  JsonObject& add(std::string_view key, bool value) {
    return add_json(key, value ? "true" : "false");
  }
  template <std::integral Integer>
  JsonObject& add(std::string_view key, Integer value) {
    return add_json(key, std::to_string(value));
  }
  JsonObject& add(std::string_view key, double value) {
    if (!std::isfinite(value)) return add_json(key, "null");
    char text[32];
    std::snprintf(text, sizeof text, "%.6g", value);
    return add_json(key, text);
  }
  JsonObject& add(std::string_view key, std::optional<double> value) {
    return value ? add(key, *value) : add_json(key, "null");
  }
  // `json` is already a JSON value (a nested object or array).
  JsonObject& add_json(std::string_view key, std::string_view json) {
    if (!body_.empty()) body_ += ", ";
    body_ += json_quote(key);
    body_ += ": ";
    body_ += json;
    return *this;
  }

  std::string str() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

}  // namespace ikbo::bench
