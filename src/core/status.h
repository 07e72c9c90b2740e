// status.h — how any part of the library reports a failure: set the thread-local
// message (read back by forge_last_error) and return the code.
#pragma once

#include "forge/forge.h"

namespace forge {

// printf-style; returns `code` so callers can `return fail(...)`.
forge_status fail(forge_status code, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void clear_error();
const char* last_error();

}  // namespace forge
