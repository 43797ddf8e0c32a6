// What the CPU this process runs on can do, for the kernels' choice of body at run time.
#pragma once

namespace {

// AVX-512 F/BW/DQ/VL: what the kernels' AVX-512 bodies are compiled for (`#pragma GCC target`).
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}

// AVX-512 BF16 on top: the bf16 dot products (vdpbf16ps) of gguf_linear's bf16 panel body.
inline bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

// AVX-512 VBMI (byte permutes): gguf_linear's bf16 body regroups 4-bit codes with vpermt2b where it has it.
inline bool cpu_has_avx512_vbmi() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
  return has;
}

}  // namespace
