// GGUF block formats to float32 at load time, straight from the file's block bytes: the arithmetic of quant.py's
// torch reference (and of gguf's numpy dequantize), q * d for Q8_0 and q * d + m for Q4_1. The products are exact
// in float32 (an 8- or 4-bit integer times a float16's 11-bit significand), so only the Q4_1 sum rounds, once,
// whether or not the compiler fuses it into an FMA: both paths give the same bits. One pass over the output,
// rows split over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstring>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

constexpr int64_t QK = 32;  // weights per block

inline uint16_t half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Q8_0 block: float16 d, 32 int8 q.
void q8_0_blocks(const uint8_t* raw, float* out, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = raw + b * 34;
    const float scale = half_to_f32(half_at(blk));
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int64_t j = 0; j < QK; ++j) out[b * QK + j] = static_cast<float>(q[j]) * scale;
  }
}

// Q4_1 block: float16 d, float16 m, 16 bytes holding element j in the low nibble and j + 16 in the high one.
void q4_1_blocks(const uint8_t* raw, float* out, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = raw + b * 20;
    const float scale = half_to_f32(half_at(blk)), low = half_to_f32(half_at(blk + 2));
    const uint8_t* q = blk + 4;
    float* o = out + b * QK;
    for (int64_t j = 0; j < QK / 2; ++j) {
      o[j] = static_cast<float>(q[j] & 0x0F) * scale + low;
      o[j + QK / 2] = static_cast<float>(q[j] >> 4) * scale + low;
    }
  }
}

}  // namespace

at::Tensor dequantize_gguf(const at::Tensor& raw, const std::string& fmt, int64_t n, int64_t k) {
  TORCH_CHECK(fmt == "q8_0" || fmt == "q4_1", "dequantize_gguf: format must be q8_0 or q4_1, got ", fmt);
  TORCH_CHECK(k % QK == 0 && n >= 0, "dequantize_gguf: K must be a multiple of 32");
  const int64_t blocks = n * (k / QK), block_bytes = fmt == "q8_0" ? 34 : 20;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == blocks * block_bytes,
              "dequantize_gguf: raw must be ", blocks * block_bytes, " contiguous bytes for [", n, ", ", k, "] ", fmt);
  at::Tensor out = at::empty({n, k}, raw.options().dtype(at::kFloat));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const auto run = fmt == "q8_0" ? q8_0_blocks : q4_1_blocks;
  at::parallel_for(0, blocks, 2048, [&](int64_t b0, int64_t b1) { run(src, dst, b0, b1); });
  return out;
}

}  // namespace tp
