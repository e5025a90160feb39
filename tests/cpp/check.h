// A tiny test harness for the C++ core: TEST(name) registers a case, CHECK* record failures
// (with file:line) without stopping the case, and main() prints "N passed, N failed".
#pragma once

#include <cmath>
#include <functional>
#include <atomic>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

namespace check {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

inline std::atomic<int>& failures() {  // checks may run on several threads (in-process ranks)
  static std::atomic<int> n{0};
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> body) { cases().push_back({name, std::move(body)}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  ++failures();
  std::cerr << file << ":" << line << ": " << what << "\n";
}

}  // namespace check

#define CHECK_CAT2(a, b) a##b
#define CHECK_CAT(a, b) CHECK_CAT2(a, b)
#define TEST(name)                                                      \
  static void name();                                                   \
  static const check::Register CHECK_CAT(register_, name)(#name, name); \
  static void name()

#define CHECK(cond)                                              \
  do {                                                           \
    if (!(cond)) check::fail(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                                         \
  do {                                                                                                \
    const double va_ = (a), vb_ = (b);                                                                \
    if (!(std::fabs(va_ - vb_) <= (tol))) {                                                          \
      check::fail(__FILE__, __LINE__, #a " = " + std::to_string(va_) + ", expected " + std::to_string(vb_)); \
    }                                                                                                 \
  } while (0)

// `expr` must throw `Type` whose what() contains `text`.
#define CHECK_THROWS(expr, Type, text)                                                                \
  do {                                                                                                \
    bool thrown_ = false;                                                                             \
    try {                                                                                             \
      expr;                                                                                           \
    } catch (const Type& e_) {                                                                        \
      thrown_ = true;                                                                                 \
      if (std::string(e_.what()).find(text) == std::string::npos) {                                   \
        check::fail(__FILE__, __LINE__, std::string("message '") + e_.what() + "' lacks '" + (text) + "'"); \
      }                                                                                               \
    }                                                                                                 \
    if (!thrown_) check::fail(__FILE__, __LINE__, #expr " did not throw " #Type);                     \
  } while (0)
