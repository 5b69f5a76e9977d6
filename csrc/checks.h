// Input checks of the op kernels: TORCH_CHECK, TORCH_CHECK_VALUE and TORCH_CHECK_TYPE
// with the message put together here, numbers through std::to_string, and handed over
// as one string. Why: on the device (torch 2.11 wheel, this extension built there), a
// failing check whose message formatted an integer through a std::ostream (as c10::str
// does) died with SIGSEGV instead of raising; strings, std::to_string and c10::toString
// raised as they should (tests/gpu/test_op_errors_gpu.py, docs/design.md).
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace flexsparse {
namespace check_detail {

inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s; }
inline std::string piece(bool b) { return b ? "true" : "false"; }
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
std::string piece(T v) { return std::to_string(v); }
inline std::string piece(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const c10::Device& d) { return d.str(); }
inline std::string piece(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

}  // namespace check_detail

template <class... Args>
std::string check_message(const Args&... args) {
  std::string s;
  ((s += check_detail::piece(args)), ...);
  return s;
}

}  // namespace flexsparse

#define FLEXSPARSE_CHECK(cond, ...) TORCH_CHECK(cond, ::flexsparse::check_message(__VA_ARGS__))
#define FLEXSPARSE_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::flexsparse::check_message(__VA_ARGS__))
#define FLEXSPARSE_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::flexsparse::check_message(__VA_ARGS__))
