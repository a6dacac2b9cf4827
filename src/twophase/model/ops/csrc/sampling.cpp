// Top-p (nucleus) filtering of float32 logits rows without sorting the vocabulary. The cut is bracketed from a
// sorted sample of the row, the entries inside the bracket are collected in one branch-free pass, and the exact cut
// among them is found by selection (quickselect on the logits, carrying each side's probability mass): O(vocab).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kSample = 1024;      // entries of a row sampled (evenly spaced) to bracket the cut
constexpr int64_t kBracketSlack = 48;  // sample ranks on either side of the estimated cut

struct Entry {
  float logit, weight;
};

#ifdef __AVX2__
// lo, hi += the low and high halves of x, widened to float64.
inline void add_f64(__m256d& lo, __m256d& hi, __m256 x) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

// The sum of lo's and hi's lanes.
inline double hsum_f64(__m256d lo, __m256d hi) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

// w[i] = exp(row[i] - max) (0 for -inf) for a row without NaN and with a finite max; returns the float64 total,
// or 0 when the row is to be left alone (NaN, no finite max).
double weigh_row(const float* row, int64_t n, float* w) {
  float mx = kNegInf;
  bool nan = false;
  int64_t j = 0;
#ifdef __AVX2__
  __m256 mv = _mm256_set1_ps(kNegInf), unordered = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    mv = _mm256_max_ps(mv, x), unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  mx = hmax(mv);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; j < n; ++j) mx = std::max(mx, row[j]), nan |= std::isnan(row[j]);
  if (nan || !std::isfinite(mx)) return 0.0;
  double total = 0.0;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 m = _mm256_set1_ps(mx), neg_inf = _mm256_set1_ps(kNegInf);
  __m256d t0 = _mm256_setzero_pd(), t1 = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    // exp256 clamps far below the max to exp(-87); a -inf logit weighs exactly 0
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, neg_inf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(x, m)));
    _mm256_storeu_ps(w + i, e);
    add_f64(t0, t1, e);
  }
  total = hsum_f64(t0, t1);
#endif
  for (; i < n; ++i) w[i] = row[i] == kNegInf ? 0.f : std::exp(row[i] - mx), total += w[i];
  return total;
}

// The smallest logit v the top-p set keeps among entries e (target = top_p * total; `above` = the mass of every
// entry of the row greater than all of e, below target): sorted best first, an entry is kept while the mass
// strictly above its value is below target, so the kept set is {logit >= v}. A pivot splits e into greater /
// equal / less, and the mass above decides which side holds v; `above` stays below target, so the best is kept.
float select_cut(Entry* begin, Entry* end, double above, double target) {
  while (true) {
    const auto size = end - begin;
    const float a = begin->logit, b = begin[size / 2].logit, c = end[-1].logit;  // median of three as the pivot
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    Entry* greater_end = std::partition(begin, end, [&](const Entry& x) { return x.logit > pivot; });
    Entry* equal_end = std::partition(greater_end, end, [&](const Entry& x) { return x.logit == pivot; });
    double greater = 0.0, equal = 0.0;
    for (Entry* it = begin; it != greater_end; ++it) greater += it->weight;
    for (Entry* it = greater_end; it != equal_end; ++it) equal += it->weight;
    if (above + greater >= target) {  // the pivot is cut: v is among the greater ones (some: above < target)
      end = greater_end;
    } else if (above + greater + equal >= target || equal_end == end) {
      return pivot;  // the pivot is kept and everything below it is cut
    } else {  // the pivot and everything above it are kept: v is among the less ones
      above += greater + equal;
      begin = equal_end;
    }
  }
}

// (lo, hi): logits of the sample that likely bracket the cut, from the sampled entries sorted best first and their
// mass scaled to the row's.
std::pair<float, float> bracket(const float* row, const float* w, int64_t n, double target, double total,
                                std::vector<Entry>& sample) {
  const int64_t step = std::max<int64_t>(1, n / kSample);
  sample.clear();
  double sampled = 0.0;
  for (int64_t i = 0; i < n; i += step) sample.push_back({row[i], w[i]}), sampled += w[i];
  std::sort(sample.begin(), sample.end(), [](const Entry& x, const Entry& y) { return x.logit > y.logit; });
  const int64_t m = static_cast<int64_t>(sample.size());
  int64_t r = 0;
  for (double mass = 0.0; r < m - 1 && mass * total < target * sampled; ++r) mass += sample[r].weight;
  // open-ended past the sample's ends: the row's best (or worst) entries need not be in the sample
  const float inf = std::numeric_limits<float>::infinity();
  return {r + kBracketSlack < m ? sample[r + kBracketSlack].logit : -inf,
          r - kBracketSlack >= 0 ? sample[r - kBracketSlack].logit : inf};
}

// The float64 masses of the entries with logit > hi and with logit >= lo.
std::pair<double, double> masses_outside(const float* row, const float* w, int64_t n, float lo, float hi) {
  double above = 0.0, from = 0.0;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 h = _mm256_set1_ps(hi), l = _mm256_set1_ps(lo);
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, f0 = a0, f1 = a0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i), e = _mm256_loadu_ps(w + i);
    const __m256 over = _mm256_and_ps(_mm256_cmp_ps(x, h, _CMP_GT_OQ), e);
    const __m256 from_lo = _mm256_and_ps(_mm256_cmp_ps(x, l, _CMP_GE_OQ), e);
    add_f64(a0, a1, over);
    add_f64(f0, f1, from_lo);
  }
  above = hsum_f64(a0, a1), from = hsum_f64(f0, f1);
#endif
  for (; i < n; ++i) above += row[i] > hi ? w[i] : 0.f, from += row[i] >= lo ? w[i] : 0.f;
  return {above, from};
}

// The row's cut for target = top_p * total (> 0): select_cut over the entries in the sample's bracket [lo, hi] when
// it holds the cut, else over the whole row.
float top_p_cut(const float* row, const float* w, int64_t n, double target, double total, std::vector<Entry>& buf,
                std::vector<Entry>& sample) {
  auto [lo, hi] = bracket(row, w, n, target, total, sample);
  auto [above_hi, from_lo] = masses_outside(row, w, n, lo, hi);  // {logit > hi}, {logit >= lo}
  if (!(above_hi < target && from_lo >= target)) {
    lo = kNegInf, hi = std::numeric_limits<float>::infinity(), above_hi = 0.0;
  }
  buf.resize(n);
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free: every entry written, the count advanced when it is inside
    buf[count] = {row[i], w[i]};
    count += static_cast<int64_t>(row[i] >= lo) & static_cast<int64_t>(row[i] <= hi);
  }
  return select_cut(buf.data(), buf.data() + count, above_hi, target);
}

// The index of row[0..n)'s first maximum, NaN counting as the maximum (torch.max's indices); n >= 1.
int64_t argmax_row(const float* row, int64_t n) {
  int64_t j = 0, best = 0;
  float best_value = row[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    // each lane keeps its first maximum (strictly greater replaces); lanes then meet at the smallest index
    __m512 value = _mm512_loadu_ps(row);
    __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i at = index;
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    const __m512i step = _mm512_set1_epi32(16);
    for (j = 16; j + 16 <= n; j += 16) {
      at = _mm512_add_epi32(at, step);
      const __m512 x = _mm512_loadu_ps(row + j);
      const __mmask16 greater = _mm512_cmp_ps_mask(x, value, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      value = _mm512_mask_mov_ps(value, greater, x);
      index = _mm512_mask_mov_epi32(index, greater, at);
    }
    if (nan) return std::find_if(row, row + n, [](float x) { return std::isnan(x); }) - row;
    best_value = _mm512_reduce_max_ps(value);
    const __mmask16 top = _mm512_cmp_ps_mask(value, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(top, index);
  }
#endif
  for (; j < n; ++j) {  // what the vector part left (all of a short row): it saw no NaN
    if (std::isnan(row[j])) return j;
    if (row[j] > best_value) best_value = row[j], best = j;
  }
  return best;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be a float32 [rows, vocab] tensor with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* data = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ids[r] = argmax_row(data + r * ld, n);
  });
  return out;
}

void top_p_mask_(at::Tensor& logits, const at::Tensor& top_p_in) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [rows, vocab] tensor");
  const at::Tensor top_p = top_p_in.to(at::kDouble).contiguous();
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == logits.size(0), "top_p must be [rows]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  float* data = logits.data_ptr<float>();
  const double* p = top_p.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(n);
    std::vector<Entry> buf, sample;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = data + r * n;
      if (!(p[r] < 1.0) || n == 0) continue;
      const double total = weigh_row(row, n, w.data());
      if (!(total > 0.0) || !std::isfinite(total)) continue;
      const double target = std::max(p[r], 0.0) * total;
      // top_p 0: no mass lies below it, so the best alone (with its ties) is kept
      const float cut = target > 0.0 ? top_p_cut(row, w.data(), n, target, total, buf, sample)
                                     : *std::max_element(row, row + n);
      for (int64_t i = 0; i < n; ++i) row[i] = row[i] < cut ? kNegInf : row[i];
    }
  });
}

}  // namespace tp
