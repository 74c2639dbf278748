// Standalone driver of the emulator self-test.
#include <cstdio>
#include <string>

int msl_emulator_selftest(std::string* log);

int main() {
  std::string log;
  const int failures = msl_emulator_selftest(&log);
  std::fputs(log.c_str(), stdout);
  return failures == 0 ? 0 : 1;
}
