// What every result file records: a minimal JSON writer, the commit and the date (shared by
// epcomm_bench and epcomm_silu_bench).
#pragma once

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <ostream>
#include <string>
#include <vector>

#include <sys/wait.h>

namespace epbench {

// The commit the benchmark runs from (EPCOMM_COMMIT, else `git rev-parse HEAD`), with
// "+modified" where tracked files differ from it (else "unknown"): a figure taken from an
// uncommitted tree, or from a copy whose git metadata is older than its files (a device machine's
// copy of a working tree), is then not quoted as that commit's.
inline std::string git_commit() {
  if (const char* env = std::getenv("EPCOMM_COMMIT")) return env;
  std::string out;
  if (FILE* p = popen("git rev-parse HEAD 2>/dev/null", "r")) {
    char buf[128];
    while (std::fgets(buf, sizeof buf, p))
      out += buf;
    const int status = pclose(p);
    while (!out.empty() && std::isspace(static_cast<unsigned char>(out.back())))
      out.pop_back();
    if (status == 0 && out.size() >= 7) {
      // 1: the tracked files differ from HEAD (0: they do not; anything else: unknown).
      const int diff = std::system("git diff --quiet HEAD -- 2>/dev/null");
      if (diff != -1 && WIFEXITED(diff) && WEXITSTATUS(diff) == 1) out += "+modified";
      return out;
    }
  }
  return "unknown";
}

inline std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// A minimal JSON writer: objects and arrays nest, commas and indentation are automatic.
class JsonWriter {
 public:
  explicit JsonWriter(std::ostream& os) : os_(os) {}
  void begin_object(const char* key = nullptr) { open(key, '{'); }
  void end_object() { close('}'); }
  void begin_array(const char* key = nullptr) { open(key, '['); }
  void end_array() { close(']'); }
  void value(const char* key, const std::string& s) {
    prefix(key);
    os_ << quote(s);
  }
  void value(const char* key, const char* s) { value(key, std::string(s)); }
  void value(const char* key, double v) {
    prefix(key);
    if (!std::isfinite(v)) {
      os_ << "null";
      return;
    }
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    os_ << buf;
  }
  void value(const char* key, int v) { value(key, double(v)); }
  void value(const char* key, bool v) {
    prefix(key);
    os_ << (v ? "true" : "false");
  }
  void numbers(const char* key, const std::vector<double>& v) {
    prefix(key);
    os_ << '[';
    for (size_t i = 0; i < v.size(); ++i) {
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.9g", v[i]);
      os_ << (i ? ", " : "") << buf;
    }
    os_ << ']';
  }

 private:
  static std::string quote(const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') {
        q += '\\';
        q += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        q += buf;
      } else {
        q += c;
      }
    }
    return q + "\"";
  }
  void prefix(const char* key) {
    if (!first_.empty()) {
      if (!first_.back()) os_ << ',';
      first_.back() = false;
      os_ << '\n' << std::string(2 * first_.size(), ' ');
    }
    if (key) os_ << quote(key) << ": ";
  }
  void open(const char* key, char bracket) {
    prefix(key);
    os_ << bracket;
    first_.push_back(true);
  }
  void close(char bracket) {
    first_.pop_back();
    os_ << '\n' << std::string(2 * first_.size(), ' ') << bracket;
  }

  std::ostream& os_;
  std::vector<bool> first_;
};

}  // namespace epbench
