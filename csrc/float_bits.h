// float32 <-> bfloat16 as torch converts (c10::BFloat16): widening is exact; narrowing rounds to nearest even,
// NaN to the canonical quiet NaN. Written on the bits, branch-free, so loops over them vectorize. For float,
// both are the identity. Used by the kernels that must round exactly where torch's ops round.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace oppo {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  const uint16_t bits = f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

}  // namespace oppo
