// The one rule of the bridge: no C++ exception crosses into Rust. Every entry point returns
// nullptr on success or a malloc'ed error message that Rust takes ownership of (and frees with
// eng_free_error). Pointers to tensors are `at::Tensor*`, the same representation tch uses.
#pragma once
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

inline char* eng_make_error(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) std::memcpy(out, message.c_str(), message.size() + 1);
  return out;
}

// c10::Error::what() carries a C++ backtrace; users want the message.
#define ENG_PROTECT(...)                                             \
  try {                                                              \
    __VA_ARGS__;                                                     \
    return nullptr;                                                  \
  } catch (const c10::Error& e) {                                    \
    return eng_make_error(e.what_without_backtrace());               \
  } catch (const std::exception& e) {                                \
    return eng_make_error(e.what());                                 \
  } catch (...) {                                                    \
    return eng_make_error("unknown C++ exception in engine bridge"); \
  }

