// errors.cpp — the thread-local last-error message behind forge_last_error().
#include <cstdarg>
#include <cstdio>

#include "core/status.h"

namespace forge {
namespace {
thread_local char g_message[1024] = "";
}

forge_status fail(forge_status code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_message, sizeof(g_message), fmt, args);
  va_end(args);
  return code;
}

void clear_error() { g_message[0] = '\0'; }
const char* last_error() { return g_message; }

}  // namespace forge
