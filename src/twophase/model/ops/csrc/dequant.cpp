// GGUF block formats to float32: the arithmetic of quant.py's torch reference (and of gguf's numpy dequantize),
// q * d for Q8_0 and q * d + m for Q4_1. The products are exact in float32 (an 8- or 4-bit integer times a
// float16's 11-bit significand), so only the Q4_1 sum rounds, once, whether or not the compiler fuses it into an
// FMA: every path gives the same bits. One pass over the output, blocks split over torch's threads.
//
// One loop serves both layouts, by byte strides: the file's interleaved blocks (load time: d, (m,) quants per
// block) and quant.py's packed tensors (qs, d, m apart: the F.linear path of large batches, per call).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstring>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

constexpr int64_t QK = 32;  // weights per block

// Where block b's quants, scale and min start: base + b * stride (bytes). q4_1: 16 bytes of nibbles, element j
// in the low nibble of byte j and element j + 16 in its high nibble; q8_0: 32 int8.
struct BlockLayout {
  const uint8_t *q, *d, *m;
  int64_t q_stride, d_stride, m_stride;
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_f32(h);
}

void q8_0_blocks(const BlockLayout& l, float* out, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float scale = half_at(l.d + b * l.d_stride);
    const int8_t* q = reinterpret_cast<const int8_t*>(l.q + b * l.q_stride);
    for (int64_t j = 0; j < QK; ++j) out[b * QK + j] = static_cast<float>(q[j]) * scale;
  }
}

void q4_1_blocks(const BlockLayout& l, float* out, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float scale = half_at(l.d + b * l.d_stride), low = half_at(l.m + b * l.m_stride);
    const uint8_t* q = l.q + b * l.q_stride;
    float* o = out + b * QK;
    for (int64_t j = 0; j < QK / 2; ++j) {
      o[j] = static_cast<float>(q[j] & 0x0F) * scale + low;
      o[j + QK / 2] = static_cast<float>(q[j] >> 4) * scale + low;
    }
  }
}

at::Tensor run(const BlockLayout& layout, const std::string& fmt, int64_t n, int64_t k, const at::Tensor& like) {
  at::Tensor out = at::empty({n, k}, like.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const auto blocks = fmt == "q8_0" ? q8_0_blocks : q4_1_blocks;
  at::parallel_for(0, n * (k / QK), 2048, [&](int64_t b0, int64_t b1) { blocks(layout, dst, b0, b1); });
  return out;
}

void check_format(const std::string& fmt, const char* name) {
  TORCH_CHECK(fmt == "q8_0" || fmt == "q4_1", name, ": format must be q8_0 or q4_1, got ", fmt);
}

const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

}  // namespace

at::Tensor dequantize_gguf(const at::Tensor& raw, const std::string& fmt, int64_t n, int64_t k) {
  check_format(fmt, "dequantize_gguf");
  TORCH_CHECK(k % QK == 0, "dequantize_gguf: K must be a multiple of 32, got ", k);
  const int64_t blocks = n * (k / QK), block_bytes = fmt == "q8_0" ? 34 : 20;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == blocks * block_bytes,
              "dequantize_gguf: raw must be ", blocks * block_bytes, " contiguous bytes for [", n, ", ", k, "] ", fmt);
  const uint8_t* p = bytes(raw);
  const BlockLayout layout = fmt == "q8_0" ? BlockLayout{p + 2, p, nullptr, 34, 34, 0}
                                           : BlockLayout{p + 4, p, p + 2, 20, 20, 20};
  return run(layout, fmt, n, k, raw);
}

at::Tensor dequantize_blocks(const std::string& fmt, const std::vector<at::Tensor>& packed) {
  check_format(fmt, "dequantize_blocks");
  const bool q8 = fmt == "q8_0";
  TORCH_CHECK(packed.size() == (q8 ? 2u : 3u), "dequantize_blocks: q8_0 takes (qs, d), q4_1 (qs, d, m)");
  TORCH_CHECK(packed[0].element_size() == 1, "dequantize_blocks: qs must hold bytes");
  std::vector<at::Tensor> t;
  for (const at::Tensor& p : packed) t.push_back(p.contiguous());
  const int64_t bytes_per_block = q8 ? QK : QK / 2;
  const auto [n, k] = check_blocks(t[0], t[1], bytes_per_block);
  if (!q8) check_blocks(t[0], t[2], bytes_per_block);  // m: as d
  const BlockLayout layout{bytes(t[0]), bytes(t[1]), q8 ? nullptr : bytes(t[2]), bytes_per_block, 2, 2};
  return run(layout, fmt, n, k, t[0]);
}

}  // namespace tp
