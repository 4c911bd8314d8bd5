// MEGABLU_CHECK: the bindings' argument checks, with messages built without std::ostream number formatting.
// On an H100 (2026-12-06, torch 2.11.0+cu130, the extension built there) every TORCH_CHECK whose message
// streamed a number (a size, d, path) ended the process with SIGSEGV instead of raising, while those with
// strings only (a device, a literal) raised (tests/ops/test_ext_errors.py). MEGABLU_CHECK(cond, parts...)
// passes TORCH_CHECK one std::string made here: numbers through std::to_string, sizes as [a, b], devices
// and dtypes by name. c10 headers only, so tests/ops/test_ext_msg.py builds it on a CPU. Confirmed on an H100
// (2026-12-06, sixteenth session): _throw_probe(3) (TORCH_CHECK streaming a number) and (4) (std::ostringstream
// number in a std::runtime_error) die with SIGSEGV, MEGABLU_CHECK with a number raises, and so do the checks
// that crashed before (its JUnit XML: git show f44378f:bench/results/2026-12-06c/ops17_probe_tests.xml).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace megablu {

inline std::string msg_part(const char* s) { return s; }
inline std::string msg_part(const std::string& s) { return s; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline std::string msg_part(T v) {
  return std::to_string(v);
}
inline std::string msg_part(bool v) { return v ? "true" : "false"; }
// a char would print as its code and any other pointer as a bool: refused at compile time
std::string msg_part(char) = delete;
template <typename T>
std::string msg_part(const T*) = delete;
inline std::string msg_part(double v) { return std::to_string(v); }
inline std::string msg_part(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
inline std::string msg_part(const c10::Device& d) { return d.str(); }
inline std::string msg_part(c10::ScalarType t) { return c10::toString(t); }
template <typename... Parts>
std::string msg(const Parts&... parts) {
  std::string s;
  ((s += msg_part(parts)), ...);
  return s;
}

}  // namespace megablu

#define MEGABLU_CHECK(cond, ...) TORCH_CHECK(cond, ::megablu::msg(__VA_ARGS__))
