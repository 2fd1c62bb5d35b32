/* bf16 <-> fp32, bit by bit, as torch converts: widening is exact; narrowing rounds to nearest
 * even and keeps a NaN a NaN. Shared by the kernels in this folder (engine/kernels/native.py
 * hashes the headers here with each source, so a change here rebuilds them all). */
#ifndef INFERSIGHT_BF16_H
#define INFERSIGHT_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#endif
