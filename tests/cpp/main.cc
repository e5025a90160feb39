// Runs every registered test case; exits non-zero if any check failed.
#include <exception>
#include <iostream>

#include "check.h"

int main() {
  int passed = 0, failed = 0;
  for (const check::Case& c : check::cases()) {
    const int before = check::failures();
    try {
      c.body();
    } catch (const std::exception& e) {
      check::fail(c.name, 0, std::string("uncaught exception: ") + e.what());
    }
    const bool ok = check::failures() == before;
    (ok ? passed : failed) += 1;
    std::cout << (ok ? "PASS " : "FAIL ") << c.name << "\n";
  }
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
