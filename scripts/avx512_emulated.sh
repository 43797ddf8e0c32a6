#!/usr/bin/env bash
# Checks gguf_linear's AVX-512 bodies (the int16 panels, the AVX-512 decode tiles) on a CPU without
# AVX-512, by emulating them with SIMDe: their bits, not their speed. Needs Debian's libsimde-dev
# (apt-get install libsimde-dev; 0.7.4 on bookworm).
#
#   bash scripts/avx512_emulated.sh [pytest args]   # default: the int16 tests of test_batch_invariance.py
#
# Copies engine/model/kernels/ to build/avx512-emulated/, drops the AVX-512 target pragmas (the AMX
# function keeps its own and never runs), maps the intrinsics to SIMDe's (those SIMDe 0.7.4 lacks
# are written out below), makes cpu_features.h report AVX-512 F/BW/DQ/VL, VNNI and VBMI but not BF16
# (that body is a placeholder here), builds gguf_linear.cpp alone and runs pytest with it loaded in
# place of the cached build: tests that need the other kernels (the real model's) fail under it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/avx512-emulated
rm -rf "$out" && mkdir -p "$out"
cp engine/model/kernels/*.cpp engine/model/kernels/*.h "$out/"
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
src = open(f"{out}/gguf_linear.cpp").read()
src = src.replace("#include <immintrin.h>\n", '#include <immintrin.h>\n#include "emulated_avx512.h"\n', 1)
src = re.sub(r"#pragma GCC (push_options|pop_options|target\([^)]*\))\n", "", src)
src = re.sub(r'__attribute__\(\(target\("([^"]*)"\)\)\)', lambda m: m.group(0) if "amx" in m.group(1) else "", src)
open(f"{out}/gguf_linear.cpp", "w").write(src)
features = open(f"{out}/cpu_features.h").read()
for name in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni", "avx512vbmi"):
    features = features.replace(f'__builtin_cpu_supports("{name}")', "true")
features = features.replace('__builtin_cpu_supports("avx512bf16")', "false")
open(f"{out}/cpu_features.h", "w").write(features)
PY
cat > "$out/emulated_avx512.h" <<'H'
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <cstdint>
#include <cstring>
// variadic: template arguments' commas inside the calls
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(...) simde_mm512_madd_epi16(__VA_ARGS__)
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps(...) simde_mm512_fmadd_ps(__VA_ARGS__)
// lane by lane where SIMDe 0.7.4 has none
#define EMU_LANES(name, In, InT, n, Out, OutT, expr)                   \
  static inline Out emu_##name(In a) {                                 \
    InT in[n]; OutT out[n]; std::memcpy(in, &a, sizeof in);             \
    for (int i = 0; i < n; ++i) out[i] = static_cast<OutT>(expr);       \
    Out r; std::memcpy(&r, out, sizeof out); return r;                  \
  }
EMU_LANES(cvtepu8_epi16, simde__m256i, uint8_t, 32, simde__m512i, uint16_t, in[i])
EMU_LANES(cvtepu8_epi32, simde__m128i, uint8_t, 16, simde__m512i, uint32_t, in[i])
EMU_LANES(cvtepi8_epi32, simde__m128i, int8_t, 16, simde__m512i, int32_t, in[i])
EMU_LANES(cvtepi32_epi16, simde__m512i, int32_t, 16, simde__m256i, int16_t, in[i])
EMU_LANES(cvtepi32_ps, simde__m512i, int32_t, 16, simde__m512, float, in[i])
EMU_LANES(cvtph_ps, simde__m256i, uint16_t, 16, simde__m512, float, _cvtsh_ss(in[i]))
static inline simde__m256 emu_extractf32x8_ps(simde__m512 a, int half) {
  simde__m256 r; std::memcpy(&r, reinterpret_cast<const char*>(&a) + 32 * half, 32); return r;
}
static inline simde__m512i emu_i32gather_epi32(simde__m512i index, const void* base, int scale) {
  int32_t at[16], out[16]; std::memcpy(at, &index, 64);
  for (int i = 0; i < 16; ++i) std::memcpy(&out[i], static_cast<const char*>(base) + int64_t{at[i]} * scale, 4);
  simde__m512i r; std::memcpy(&r, out, 64); return r;
}
static inline void emu_mask_storeu_ps(void* p, uint16_t mask, simde__m512 a) {
  float in[16]; std::memcpy(in, &a, 64);
  for (int i = 0; i < 16; ++i) if (mask >> i & 1) std::memcpy(static_cast<char*>(p) + 4 * i, &in[i], 4);
}
static inline simde__m512bh emu_cvtne2ps_pbh(simde__m512, simde__m512) {  // placeholder: the bf16 body never runs
  simde__m512bh r; std::memset(&r, 0, sizeof r); return r;
}
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) emu_cvtepu8_epi16(a)
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) emu_cvtepu8_epi32(a)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) emu_cvtepi8_epi32(a)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) emu_cvtepi32_epi16(a)
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) emu_cvtepi32_ps(a)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) emu_cvtph_ps(a)
#undef _mm512_extractf32x8_ps
#define _mm512_extractf32x8_ps(a, half) emu_extractf32x8_ps(a, half)
#undef _mm512_i32gather_epi32
#define _mm512_i32gather_epi32(index, base, scale) emu_i32gather_epi32(index, base, scale)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, mask, a) emu_mask_storeu_ps(p, mask, a)
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) emu_cvtne2ps_pbh(a, b)
H
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  . .venv/bin/activate
fi
python - "$out" <<'PY'
import sys
from torch.utils.cpp_extension import load
from nanoserve.engine.model.kernels import CFLAGS, LIBRARY_NAME  # the real build's flags
out = sys.argv[1]
load(name=LIBRARY_NAME, sources=[f"{out}/gguf_linear.cpp"], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
     build_directory=out, is_python_module=False, verbose=False)
PY
if [ $# -eq 0 ]; then
  set -- -q -p no:cacheprovider tests/engine/model/test_batch_invariance.py -k int16
fi
python - "$out/nanoserve_kernels.so" "$@" <<'PY'
import sys
import pytest
import torch
from nanoserve.engine.model import kernels
torch.ops.load_library(sys.argv[1])
kernels._state.update(loaded=True, reason="")  # this library in place of the cached build
print(f"kernels from {sys.argv[1]} (AVX-512 emulated): int16 panels {kernels.has_int16_panels()}")
sys.exit(pytest.main(sys.argv[2:]))
PY
