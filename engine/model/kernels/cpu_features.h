// What the CPU this process runs on can do, for the kernels' choice of body at run time.
#pragma once

#include <cpuid.h>
#include <cstdlib>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>

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

// AVX-512 VNNI (vpdpwssd): gguf_linear's int16 panel body, the decode path's bits at large steps.
inline bool cpu_has_avx512_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

// AVX-512 VBMI (byte permutes): gguf_linear's bf16 body regroups 4-bit codes with vpermt2b where it has it.
inline bool cpu_has_avx512_vbmi() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
  return has;
}

// AMX tiles with bf16 dot products (Sapphire Rapids on), on top of AVX-512 BF16, and the kernel's
// leave to use them: Linux hands a process the 8 KiB of tile state only once it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16 on); asked once, here.
// CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE. NANOSERVE_NO_AMX=1 in the environment
// turns it off (the AVX-512 BF16 body then runs, as on a CPU without AMX).
inline bool cpu_has_amx_bf16() {
  static const bool has = [] {
    const char* off = std::getenv("NANOSERVE_NO_AMX");
    if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}

}  // namespace
