// errors.cpp - the thread-local last-error message behind tm_last_error(), and the library version.
#include <cstdarg>
#include <cstdio>

#include "backends.h"

namespace {
// One message per thread: concurrent callers (torch worker threads, JVM threads) never see each other's errors.
thread_local char g_last_error[1024] = "";
}  // namespace

extern "C" int tm_set_error(int status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return status;
}

extern "C" TM_API const char* tm_last_error(void) { return g_last_error; }

// Kept in step with pyproject.toml's version.
extern "C" TM_API const char* tm_version(void) { return "0.1.0"; }
