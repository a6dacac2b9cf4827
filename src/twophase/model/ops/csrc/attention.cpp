// Varlen causal attention over a paged KV cache, read in place (no gather), flash-style online softmax in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <limits>
#include <vector>
#include "common.h"
#include "dot_bf16.h"
#include "ops.h"

namespace tp {
namespace {

// Keys scored per softmax update: one kv head's K and V rows of a chunk (16 KB at D = 64, float32) stay in L1 for
// the query heads that share them (64-key chunks, 32 KB, spilled: 1.1-1.3x slower).
constexpr int64_t KEY_CHUNK = 32;
static_assert(KEY_CHUNK % 4 == 0, "scores_d64 writes keys in groups of four");
constexpr int64_t Q_TILE = 16;     // query positions per work item (times `groups` heads)
// ... on attend_dot, whose items pack each key chunk's K and V into panels once for all their rows, and whose later
// row blocks skip the chunks past their queries: prefill attention of 8 prompts x 256 tokens x 30 layers on 2 Zen 4
// cores, medians of 5 runs, 90.9 ms against 95.3 at 16 and 99.4 at 64 (with the row blocks' skip; at 16 it skips
// nothing)
constexpr int32_t DOT_Q_TILE = 32;
constexpr int64_t kMaxDotBlocks = 16;  // tiles of rows an attend_dot item may take (192 rows: 16 query heads a kv head)
// A request with at most this many queries (a decode row, a short speculative check) is one work item over all its
// kv heads when there are enough such requests to share the threads: a cache slot holds every kv head's row
// side by side ([slots, KVH, D]), so one item per kv head read a third of each slot's bytes at a time (a strided
// stream the prefetcher follows badly), where one item over all heads reads each slot's rows whole.
constexpr int64_t WHOLE_SLOT_MAX_QUERIES = 4;
constexpr int64_t WHOLE_SLOT_ITEMS_PER_THREAD = 4;  // fewer requests than this per thread: one item per kv head

struct WorkItem {
  int32_t req, kv0, kv1, q0, q1;  // kv heads [kv0, kv1) x query rows [q0, q1) of request `req` (offsets within it)
  int64_t rows(int64_t groups) const { return static_cast<int64_t>(kv1 - kv0) * (q1 - q0) * groups; }
};

struct Args {
  int64_t H, KVH, D, groups, block_size, max_blocks;
  int64_t row;  // a cache row's elements: D, or D + kInt8RowExtra in an int8 cache (its scale after the values)
  int64_t q_s0, o_s0, k_s0, k_s1, v_s0, v_s1;  // element strides: q token, out token; cache slot and head
  float scale;
  const int32_t *block_tables, *seq_lens, *qsl;
  int64_t dot_min_queries;  // requests with this many queries take attend_dot (D = 64); 0: none, as for a float32 cache
  bool dot_fma;  // attend_dot sums its products on float32 FMAs (fma_tile) instead of vdpbf16ps
};

// Per-thread scratch, sized for one work item.
struct Scratch {
  const WorkItem* prefetched = nullptr;  // the item whose first chunk this thread's previous item prefetched (attend)
  // k/vbuf: a chunk widened; row: one row, off AVX2; kt: one kv head's K rows of a chunk transposed (scores_kt)
  std::vector<float> q, acc, s, m, l, kbuf, vbuf, row, kt;
  std::vector<int64_t> pos;
  // attend_dot: the queries and probabilities as bfloat16 rows (row-major, a pair an int32), a key chunk's K and
  // V in panels ([pairs][32][2] bfloat16: K with d in pairs and keys as columns, V with keys in pairs and d as columns)
  std::vector<int32_t> qp, pp;
  std::vector<float> qf, pf;  // instead, where attend_dot sums on FMAs (Args::dot_fma): the same rounded rows as float32
  std::vector<float> lv;
  std::vector<uint16_t> kpanel, vpanel;
  std::vector<uint16_t> kdeq, vdeq;  // attend_dot over an int8 cache: a chunk's K / V rows as bfloat16
  std::vector<float> ks;  // an int8 cache's K scales of a chunk (attend_rows_paired)
  std::vector<int8_t> q8;  // an int8 cache's items on AVX512-VNNI: each row of q as an int8 row (64 + its scale)
  // dot: with attend_dot's buffers (a call that has such items); fma: with its float32 rows too
  Scratch(int64_t rows, int64_t D, bool dot, bool int8, bool fma = false)
      : q(rows * D), acc(rows * D), s(rows * KEY_CHUNK), m(rows), l(rows), kbuf(KEY_CHUNK * D),
        vbuf(KEY_CHUNK * D), row(D), kt(KEY_CHUNK * D), pos(rows), qp(dot && !fma ? rows * D / 2 : 0),
        pp(dot && !fma ? rows * KEY_CHUNK / 2 : 0), qf(dot && fma ? rows * D : 0), pf(dot && fma ? rows * KEY_CHUNK : 0),
        lv(dot ? rows * 16 : 0), kpanel(dot ? KEY_CHUNK * D : 0), vpanel(dot ? KEY_CHUNK * D : 0),
        kdeq(dot && int8 ? KEY_CHUNK * D : 0), vdeq(dot && int8 ? KEY_CHUNK * D : 0), ks(int8 ? KEY_CHUNK : 0),
        q8(int8 ? rows * (D + kInt8RowExtra) : 0) {}
};

// The next key chunk's K / V rows of the kv head being worked on (k[j] + k_off, v[j] + v_off for j < n; n = 0:
// none), brought into L2 by attend_rows_paired's loops one row as each of this chunk's rows is read. Spread over the
// chunk's keys, the prefetches stay within what the core can have in flight; issued at once (32 keys' rows of K and
// V a kv head), they stalled it. Decode attention over 32 requests x 320 keys x 30 layers, bfloat16, 2 Zen 4 cores:
// 12.9-14.3 ms against 15.4-17.9 at once (11.4 against 14.4 with every request's blocks in order), 35.9 without
// prefetching. Into L1 instead: 16.7-18.9; every kv head's rows at once during the first one's keys: 15.7-16.2.
template <class T>
struct NextRows {
  const T* const* k = nullptr;
  const T* const* v = nullptr;
  int64_t n = 0, k_off = 0, v_off = 0;
};

// Row j of rows (+ off) into L2 where j < n: a D == 64 bfloat16 row, two lines (an int8 row's 68 bytes start in the
// first of them). Always inlined: as a plain inline helper GCC 12 compiled the prefetches to nothing (no prefetcht1 in
// the object); check with objdump -d.
template <class T>
__attribute__((always_inline)) inline void prefetch_row_l2(const T* const* rows, int64_t n, int64_t off, int64_t j) {
#ifdef __AVX2__
  if (j < n) {
    const char* row = reinterpret_cast<const char*>(rows[j] + off);
    _mm_prefetch(row, _MM_HINT_T1), _mm_prefetch(row + 64, _MM_HINT_T1);
  }
#else
  (void)rows, (void)n, (void)off, (void)j;
#endif
}

// Row pointers of keys/values p0..p0+n-1 of one kv head, in place (bfloat16 rows are widened where they are read,
// see attend: copying every chunk into float32 buffers made served decode slower than the float32 cache).
template <class T>
inline void kv_rows(const T* cache, int64_t s0, int64_t head_off, const int32_t* bt, int64_t bs, int64_t p0,
                    int64_t n, const T** rows) {
  int64_t block = p0 / bs, off = p0 % bs;  // walked forward: no division per key
  for (int64_t j = 0; j < n; ++j, ++off) {
    if (off == bs) ++block, off = 0;
    rows[j] = cache + (static_cast<int64_t>(bt[block]) * bs + off) * s0 + head_off;
  }
}

// Reads the slots of keys p0 .. p0 + n - 1 whole (every kv head from the row at K[j] / V[j] on, `bytes` each), one
// 32-byte load per 64-byte line in address order, so that the per-kv-head passes of a whole-slot item (attend) find
// them in cache. Those passes walk each slot a third at a time, three times, which the hardware prefetcher followed
// at two thirds of the rate of one pass in order: decode attention over 32 requests x 320 keys x 30 layers (float32,
// 2 Zen 3 cores) took 1.25-1.37x as long without this pass. Prefetch instructions for the same lines of this chunk
// changed nothing there: the loads are real. Since the AVX-512 kernels (attend_rows_paired) cut the work per key,
// only an item's first chunk is pulled (not even that where the thread's previous item prefetched it); the next
// chunk's rows are prefetched while a chunk is worked on (attend).
template <class T>
inline void pull_slots(const T* const* K, const T* const* V, int64_t n, int64_t bytes) {
#if defined(__AVX2__) && defined(__GNUC__)
  __m256i kacc = _mm256_setzero_si256(), vacc = kacc;
  for (int64_t j = 0; j < n; ++j) {
    const char* k = reinterpret_cast<const char*>(K[j]);
    const char* v = reinterpret_cast<const char*>(V[j]);
    for (int64_t off = 0; off + 32 <= bytes; off += 64) {
      kacc = _mm256_xor_si256(kacc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + off)));
      vacc = _mm256_xor_si256(vacc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + off)));
    }
  }
  __asm__ volatile("" : : "x"(kacc), "x"(vacc));  // the loads are the point: keep them
#else
  (void)K, (void)V, (void)n, (void)bytes;
#endif
}

// The n bfloat16 rows as float32 rows in buf (D apart).
inline void widen_rows(const uint16_t* const* rows, int64_t n, int64_t D, float* buf, const float** out) {
  for (int64_t j = 0; j < n; ++j) convert(buf + j * D, rows[j], D), out[j] = buf + j * D;
}

// The n int8 rows (values and scale) as float32 rows in buf (D apart).
inline void widen_rows(const int8_t* const* rows, int64_t n, int64_t D, float* buf, const float** out) {
  for (int64_t j = 0; j < n; ++j) dequantize_int8_row(buf + j * D, rows[j], D), out[j] = buf + j * D;
}

// A row's n values from d0 as float32: the row itself, or its bfloat16 values widened into buf.
inline const float* row_f32(const float* row, int64_t d0, int64_t, float*) { return row + d0; }
inline const float* row_f32(const uint16_t* row, int64_t d0, int64_t n, float* buf) {
  convert(buf, row + d0, n);
  return buf;
}

// s[j] = q . K[j] for j < n; returns max_j s[j] (any D; D == 64 takes scores_d64 below).
template <class T>
inline float scores(const float* q, const T* const* K, int64_t n, int64_t D, float* s, float* buf) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    s[j] = dot_f32(q, row_f32(K[j], 0, D, buf), D);
    mx = std::max(mx, s[j]);
  }
  return mx;
}

// acc = acc * alpha + sum_j p[j] * V[j] over D; 64-wide slabs of acc stay in registers across keys.
template <class T>
inline void accumulate(float* acc, float alpha, const float* p, const T* const* V, int64_t n, int64_t D, float* buf) {
  int64_t d0 = 0;
#ifdef __AVX2__
  const __m256 al = _mm256_set1_ps(alpha);
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 a[8];
    for (int d = 0; d < 8; ++d) a[d] = _mm256_mul_ps(al, _mm256_loadu_ps(acc + d0 + 8 * d));
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const T* v = V[j] + d0;
      for (int d = 0; d < 8; ++d) a[d] = _mm256_fmadd_ps(pj, load8(v + 8 * d), a[d]);
    }
    for (int d = 0; d < 8; ++d) _mm256_storeu_ps(acc + d0 + 8 * d, a[d]);
  }
#endif
  if (d0 < D) {
    if (alpha != 1.f) scale_f32(acc + d0, alpha, D - d0);
    for (int64_t j = 0; j < n; ++j) axpy_f32(acc + d0, p[j], row_f32(V[j], d0, D - d0, buf), D - d0);
  }
}

// Query rows that share one key chunk (one query's heads of a kv head) are scored and accumulated up to this many at a
// time, each key or value slab widened once for all of them; each row's arithmetic is the one-row arithmetic
// (the same FMA chains in the same order), so grouping never changes a bit. accumulate's group keeps slabs x rows
// in registers: all 8 slabs of three rows on AVX-512's 32 vector registers, half of them at a time on AVX2's 16.
constexpr int GROUP_ROWS = 3;
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int ACCUMULATOR_REGISTERS = 24;  // of 32 vector registers
#else
constexpr int ACCUMULATOR_REGISTERS = 12;  // of 16
#endif
// Value slabs a pass of accumulate_d64 for R rows: all 8 where R x 8 accumulators fit, else 4 (two passes).
constexpr int accumulate_slabs(int R) { return R * 8 <= ACCUMULATOR_REGISTERS ? 8 : 4; }

#ifdef __AVX2__
// scores() for R rows at D == 64: s[r][j] = q[r] . K[j] (rows of q and s 64 / KEY_CHUNK apart); mx[r] = max_j.
// Keys go four at a time, each one FMA chain over its 8 slabs (d ascending), and each key's 8 lanes are summed as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (hadd of keys 0 and 1, of keys 2 and 3, of the two, then the
// halves); the padding keys of the last group repeat the last key, so every key's sum is the same arithmetic wherever
// it falls in a group, and in whichever group of rows (scores_kt below computes the same sums). Keys go in two pairs:
// R x 2 chains, a slab of each pair's keys loaded into registers once for the R rows and each query slab once for
// the pair (R x 4 chains at once left GCC short of registers: it reloaded a query slab for every FMA and folded the
// key loads into each FMA, two loads an FMA). Decode attention over 32 requests x 320 keys x 30 layers (float32,
// 2 Zen 3 cores, with accumulate_d64's register loads): 0.93x the time of four keys at once (medians of 14 rounds
// in one process, both builds).
template <int R, class T>
inline void scores_d64(const float* q, const T* const* K, int64_t n, float* s, float* mx) {
  __m128 m[R];
  for (int r = 0; r < R; ++r) m[r] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 4) {
    const T* k[4] = {K[j], K[std::min(j + 1, n - 1)], K[std::min(j + 2, n - 1)], K[std::min(j + 3, n - 1)]};
    __m256 pair[2][R];  // per row: hadd of keys (0, 1) and of keys (2, 3)
    for (int h = 0; h < 2; ++h) {
      __m256 part[R][2];
      {
        __m256 k0 = load8(k[2 * h]), k1 = load8(k[2 * h + 1]);
        TP_IN_REGISTER(k0);
        TP_IN_REGISTER(k1);
        for (int r = 0; r < R; ++r) {
          const __m256 qd = _mm256_loadu_ps(q + r * 64);
          part[r][0] = _mm256_mul_ps(qd, k0), part[r][1] = _mm256_mul_ps(qd, k1);
        }
      }
      for (int d = 1; d < 8; ++d) {
        __m256 k0 = load8(k[2 * h] + 8 * d), k1 = load8(k[2 * h + 1] + 8 * d);
        TP_IN_REGISTER(k0);
        TP_IN_REGISTER(k1);  // one load each for the R rows (GCC folded them into each FMA)
        for (int r = 0; r < R; ++r) {
          const __m256 qd = _mm256_loadu_ps(q + r * 64 + 8 * d);
          part[r][0] = _mm256_fmadd_ps(qd, k0, part[r][0]);
          part[r][1] = _mm256_fmadd_ps(qd, k1, part[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) pair[h][r] = _mm256_hadd_ps(part[r][0], part[r][1]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 hsum = _mm256_hadd_ps(pair[0][r], pair[1][r]);
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(hsum), _mm256_extractf128_ps(hsum, 1));
      _mm_storeu_ps(s + r * KEY_CHUNK + j, s4);
      m[r] = _mm_max_ps(m[r], s4);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 v = _mm_max_ps(m[r], _mm_movehl_ps(m[r], m[r]));
    mx[r] = _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
  }
}

// K rows K[0..n) (n <= KEY_CHUNK, float32, D == 64) transposed into kt [64][KEY_CHUNK]: d-major, keys in lanes. Keys
// from n on repeat the last one (their scores are never used).
inline void transpose_chunk(const float* const* K, int64_t n, float* kt) {
  for (int64_t jb = 0; jb < KEY_CHUNK; jb += 8) {
    const float* k[8];
    for (int t = 0; t < 8; ++t) k[t] = K[std::min<int64_t>(jb + t, n - 1)];
    for (int db = 0; db < 64; db += 8) {
      __m256 r[8];
      for (int t = 0; t < 8; ++t) r[t] = _mm256_loadu_ps(k[t] + db);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = kt + db * KEY_CHUNK + jb;
      _mm256_storeu_ps(o + 0 * KEY_CHUNK, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * KEY_CHUNK, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * KEY_CHUNK, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * KEY_CHUNK, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * KEY_CHUNK, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * KEY_CHUNK, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * KEY_CHUNK, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * KEY_CHUNK, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// scores_d64 with the chunk's keys transposed (kt, transpose_chunk), 8 keys a vector: lane class i's partial sum
// A_i = sum over slabs s of q[8s + i] * k[8s + i] (a multiply, then FMAs in s order), summed as
// ((A0 + A1) + (A2 + A3)) + ((A4 + A5) + (A6 + A7)): scores_d64's arithmetic for every key, without its horizontal
// reductions. Pairs of lane classes for R rows x 2 key vectors at a time (12 accumulators at R = 3). For items of
// more than one query (prefill chunks), whose rows all read the chunk transposed once: prefill attention of 8 prompts
// x 256 tokens x 30 layers (float32, 2 Zen 3 cores, with accumulate_d64's register loads) took 0.74x the time of
// scores_d64 (medians of 6 rounds in one process, both builds).
template <int R>
inline void scores_kt(const float* q, const float* kt, int64_t n, float* s, float* mx) {
  __m256 m[R];
  for (int r = 0; r < R; ++r) m[r] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nb = j0 + 8 < n ? 2 : 1;  // key vectors in this pass
    __m256 pairs[4][R][2];               // A_2p + A_2p+1
    for (int p = 0; p < 4; ++p) {
      const int i = 2 * p;
      __m256 a[2][R][2];  // [lane class i, i + 1][row][key vector]
      for (int c = 0; c < 2; ++c) {
        const __m256 k0 = _mm256_loadu_ps(kt + (i + c) * KEY_CHUNK + j0);
        const __m256 k1 = _mm256_loadu_ps(kt + (i + c) * KEY_CHUNK + j0 + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 qv = _mm256_broadcast_ss(q + r * 64 + i + c);
          a[c][r][0] = _mm256_mul_ps(qv, k0);
          a[c][r][1] = _mm256_mul_ps(qv, k1);
        }
      }
      for (int sl = 1; sl < 8; ++sl)
        for (int c = 0; c < 2; ++c) {
          const int d = 8 * sl + i + c;
          __m256 k0 = _mm256_loadu_ps(kt + d * KEY_CHUNK + j0);
          __m256 k1 = _mm256_loadu_ps(kt + d * KEY_CHUNK + j0 + 8);
          TP_IN_REGISTER(k0);
          TP_IN_REGISTER(k1);  // one load each for the R rows, not one an FMA
          for (int r = 0; r < R; ++r) {
            const __m256 qv = _mm256_broadcast_ss(q + r * 64 + d);
            a[c][r][0] = _mm256_fmadd_ps(qv, k0, a[c][r][0]);
            a[c][r][1] = _mm256_fmadd_ps(qv, k1, a[c][r][1]);
          }
        }
      for (int r = 0; r < R; ++r)
        for (int b = 0; b < 2; ++b) pairs[p][r][b] = _mm256_add_ps(a[0][r][b], a[1][r][b]);
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < nb; ++b) {
        const __m256 sc = _mm256_add_ps(_mm256_add_ps(pairs[0][r][b], pairs[1][r][b]),
                                        _mm256_add_ps(pairs[2][r][b], pairs[3][r][b]));
        _mm256_storeu_ps(s + r * KEY_CHUNK + j0 + 8 * b, sc);
        const int64_t valid = n - (j0 + 8 * b);  // keys of this vector below n
        const __m256 live = valid >= 8 ? sc
            : _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), sc,
                               _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                                                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        m[r] = _mm256_max_ps(m[r], live);
      }
  }
  for (int r = 0; r < R; ++r) mx[r] = hmax(m[r]);
}

// accumulate() for R rows at D == 64: acc[r] = acc[r] * alpha[r] + sum_j p[r][j] * V[j] (rows of acc 64 apart, of
// p KEY_CHUNK apart), S slabs of 8 at a time (8 / S passes over the keys, S = accumulate_slabs(R)): each value slab
// is loaded once for the R rows (into a register: GCC folded it into each of the R FMAs, which at R = 3 made the loop
// load-bound). Every element's arithmetic is accumulate()'s (alpha times acc, then one FMA a key in key order).
template <int R, int S, class T>
inline void accumulate_d64(float* acc, const float* alpha, const float* p, const T* const* V, int64_t n) {
  static_assert(8 % S == 0, "S slabs a pass");
  for (int d0 = 0; d0 < 8; d0 += S) {
    __m256 a[R][S];
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < S; ++d)
        a[r][d] = _mm256_mul_ps(_mm256_set1_ps(alpha[r]), _mm256_loadu_ps(acc + r * 64 + 8 * (d0 + d)));
    for (int64_t j = 0; j < n; ++j) {
      __m256 pj[R];
      for (int r = 0; r < R; ++r) pj[r] = _mm256_set1_ps(p[r * KEY_CHUNK + j]);
      for (int d = 0; d < S; ++d) {
        __m256 v = load8(V[j] + 8 * (d0 + d));
        TP_IN_REGISTER(v);  // one load for the R rows (GCC folded it into each FMA)
        for (int r = 0; r < R; ++r) a[r][d] = _mm256_fmadd_ps(pj[r], v, a[r][d]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < S; ++d) _mm256_storeu_ps(acc + r * 64 + 8 * (d0 + d), a[r][d]);
  }
}
#endif

#if defined(__AVX512F__)
#define TP_HAVE_PAIRED_D64 1
// bfloat16 K / V rows at D == 64 on AVX-512, widened without shuffles: a row's 64 values load as 32 lanes of pairs
// (d even in the low half, d odd in the high), so lane << 16 is the even d's float32 and lane & 0xffff0000 the odd
// d's. q and acc are held in the same order: w[0] = d 0, 2, .., 30; w[1] = d 1, 3, .., 31; w[2] and w[3] the same for
// d 32 .. 63. Against the AVX2 kernels above: a quarter of the widening instructions and half the FMA instructions.
inline void widen_pairs(const uint16_t* row, __m512 w[4]) {
  const __m512i lo = _mm512_loadu_si512(row), hi = _mm512_loadu_si512(row + 32);
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
  w[1] = _mm512_castsi512_ps(_mm512_and_si512(lo, odd));
  w[2] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
  w[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, odd));
}

// A float32 row of 64 in natural order -> the even / odd order of widen_pairs, and back.
inline void split_pairs(const float* x, __m512 w[4]) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int h = 0; h < 2; ++h) {
    const __m512 a = _mm512_loadu_ps(x + 32 * h), b = _mm512_loadu_ps(x + 32 * h + 16);
    w[2 * h] = _mm512_permutex2var_ps(a, even, b);
    w[2 * h + 1] = _mm512_permutex2var_ps(a, odd, b);
  }
}
inline void merge_pairs(const __m512 w[4], float* x) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int h = 0; h < 2; ++h) {
    _mm512_storeu_ps(x + 32 * h, _mm512_permutex2var_ps(w[2 * h], lo, w[2 * h + 1]));
    _mm512_storeu_ps(x + 32 * h + 16, _mm512_permutex2var_ps(w[2 * h], hi, w[2 * h + 1]));
  }
}

// An int8 cache row's 64 values as float32 in natural order (w[i] = d 16i .. 16i + 15), unscaled: two instructions
// a vector where widen_pairs takes one, on half the bytes. Queries and accumulators over an int8 cache stay in natural
// order (row_order / natural_order below).
inline void widen_pairs(const int8_t* row, __m512 w[4]) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i))));
}

// A float32 row of 64 in natural order -> the order widen_pairs gives T's rows, and back.
inline void row_order(const float* x, __m512 w[4], const uint16_t*) { split_pairs(x, w); }
inline void row_order(const float* x, __m512 w[4], const int8_t*) {
  for (int i = 0; i < 4; ++i) w[i] = _mm512_loadu_ps(x + 16 * i);
}
inline void natural_order(const __m512 w[4], float* x, const uint16_t*) { merge_pairs(w, x); }
inline void natural_order(const __m512 w[4], float* x, const int8_t*) {
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(x + 16 * i, w[i]);
}

// Two 16-lane vectors -> one: the first four tree levels of sixteen keys' sums, each a level of one shuffle pair and
// an add. Every key's 16 partial sums meet in the same order wherever the key falls: ((q0 + q2) + (q1 + q3)) over the
// vector's quarters, then lanes (0 + 2) + (1 + 3).
inline __m512 fold_quarters(__m512 a, __m512 b) {  // keys a, b -> [a: q0+q2, q1+q3 | b: the same]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
}
inline __m512 fold_halves(__m512 a, __m512 b) {  // (keys 0, 1), (keys 2, 3) -> keys 0..3, a quarter each
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}
inline __m512 fold_lanes(__m512 a, __m512 b) {  // keys 0..3, keys 4..7 -> quarter i: lanes 0 + 2, 1 + 3 of i, i + 4
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 fold_pairs(__m512 a, __m512 b) {  // keys 0..7, keys 8..15 -> lane 4i + m: key i + 4m
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// The integer versions of the folds (exact sums: any order gives the same), for scores16_int8.
inline __m512i fold_quarters(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xee));
}
inline __m512i fold_halves(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}
inline __m512i fold_lanes(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i fold_pairs(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512 in_key_order(__m512i order, __m512 x) { return _mm512_permutexvar_ps(order, x); }
inline __m512i in_key_order(__m512i order, __m512i x) { return _mm512_permutexvar_epi32(order, x); }

// The 16 keys j0 .. j0 + 15 (past n the last key again: the same arithmetic) of R rows: part(k, parts) gives key
// row k's partial-sum vector of each row (16 lanes of V, float or int32), and the fold tree reduces 16 of them to one
// vector of 16 sums a row, in key order (next: the rows prefetched one a key, NextRows).
template <int R, class V, class T, class Part>
inline void fold16(const T* const* K, int64_t j0, int64_t n, V out[R], const T* const* next, int64_t next_n,
                   int64_t next_off, const Part& part) {
  V half[R][2];
  for (int h = 0; h < 2; ++h) {
    V quad[R][2];
    for (int e = 0; e < 2; ++e) {
      V pair[R][2];
      for (int c = 0; c < 2; ++c) {
        V parts[2][R];
        for (int t = 0; t < 2; ++t) {
          const int64_t j = j0 + 8 * h + 4 * e + 2 * c + t;
          prefetch_row_l2(next, next_n, next_off, j);
          part(K[std::min<int64_t>(j, n - 1)], parts[t]);
        }
        for (int r = 0; r < R; ++r) pair[r][c] = fold_quarters(parts[0][r], parts[1][r]);
      }
      for (int r = 0; r < R; ++r) quad[r][e] = fold_halves(pair[r][0], pair[r][1]);
    }
    for (int r = 0; r < R; ++r) half[r][h] = fold_lanes(quad[r][0], quad[r][1]);
  }
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);  // key k: lane 4(k%4)+k/4
  for (int r = 0; r < R; ++r) out[r] = in_key_order(order, fold_pairs(half[r][0], half[r][1]));
}

// 16 keys' scores of R rows (fold16): q in K's row order (rows 64 apart), each key widened and multiplied in float32.
template <int R, class T>
inline void scores16_paired(const float* q, const T* const* K, int64_t j0, int64_t n, __m512 out[R],
                            const T* const* next, int64_t next_n, int64_t next_off) {
  fold16<R>(K, j0, n, out, next, next_n, next_off, [&](const T* row, __m512 parts[R]) {
    __m512 k[4];
    widen_pairs(row, k);
    for (int r = 0; r < R; ++r) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + r * 64), k[0]);
      for (int d = 1; d < 4; ++d) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * 64 + 16 * d), k[d], acc);
      parts[r] = acc;
    }
  });
}

#ifdef __AVX512VNNI__
#define TP_HAVE_INT8_QK 1
// Over an int8 cache with AVX512-VNNI, q . k for 16 keys in integers (fold16): each query row rounded to int8 like a
// cache row (q8, its own scale), each key row's 64 values plus 128 as vpdpbusd's unsigned operand (one instruction a
// key and row, where the float path widens the key and runs four FMAs), the 128 * sum(q8) that adds taken off after
// the tree. out[r] lane t: the integer sum of key j0 + t.
template <int R>
inline void scores16_int8(const __m512i* q8, const int8_t* const* K, int64_t j0, int64_t n, __m512i out[R],
                          const int8_t* const* next, int64_t next_n, int64_t next_off) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  fold16<R>(K, j0, n, out, next, next_n, next_off, [&](const int8_t* row, __m512i parts[R]) {
    const __m512i k = _mm512_xor_si512(_mm512_loadu_si512(row), bias);
    for (int r = 0; r < R; ++r) parts[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k, q8[r]);
  });
}

// scores_paired over an int8 cache on AVX512-VNNI: s[r][j] = s_q[r] * ks[j] * (q8[r] . K[j]).
// qrows: the rows' q as int8 rows (quantize_int8_row, 64 + kInt8RowExtra apart).
template <int R>
inline void scores_int8(const int8_t* qrows, const int8_t* const* K, int64_t n, float* s, float* mx,
                        const int8_t* const* next, int64_t next_n, int64_t next_off, const float* ks) {
  __m512i q8[R];
  __m512i offset[R];  // 128 * sum(q8): what the keys' +128 added
  float qs[R];
  for (int r = 0; r < R; ++r) {
    const int8_t* row = qrows + r * (64 + kInt8RowExtra);
    q8[r] = _mm512_loadu_si512(row);
    qs[r] = int8_row_scale(row, 64);
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q8[r]);
    offset[r] = _mm512_set1_epi32(128 * _mm512_reduce_add_epi32(sum));
  }
  __m512 m[R];
  for (int r = 0; r < R; ++r) m[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    __m512i dots[R];
    scores16_int8<R>(q8, K, j0, n, dots, next, next_n, next_off);
    const __m512 scale = _mm512_loadu_ps(ks + j0);
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(qs[r]), scale),
                                      _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[r], offset[r])));
      _mm512_storeu_ps(s + r * KEY_CHUNK + j0, sc), m[r] = _mm512_max_ps(m[r], sc);
    }
  }
  for (int r = 0; r < R; ++r) mx[r] = _mm512_reduce_max_ps(m[r]);
}
#endif

// scores_d64 for bfloat16 or int8 keys on AVX-512: s[r][j] = q[r] . K[j] (q rows 64 apart in natural order, s rows
// KEY_CHUNK apart, 16 keys a store), times the key's scale in an int8 cache (ks: KEY_CHUNK of them, the padding keys'
// the last key's); mx[r] = max_j (the padding keys repeat the last one, so they cannot raise it).
template <int R, class T>
inline void scores_paired(const float* q, const T* const* K, int64_t n, float* s, float* mx,
                          const T* const* next, int64_t next_n, int64_t next_off, const float* ks) {
  alignas(64) float qp[R * 64];
  for (int r = 0; r < R; ++r) {
    __m512 w[4];
    row_order(q + r * 64, w, K[0]);
    for (int d = 0; d < 4; ++d) _mm512_store_ps(qp + r * 64 + 16 * d, w[d]);
  }
  __m512 m[R];
  for (int r = 0; r < R; ++r) m[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    __m512 sc[R];
    scores16_paired<R>(qp, K, j0, n, sc, next, next_n, next_off);
    if constexpr (std::is_same_v<T, int8_t>) {
      const __m512 scale = _mm512_loadu_ps(ks + j0);
      for (int r = 0; r < R; ++r) sc[r] = _mm512_mul_ps(sc[r], scale);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * KEY_CHUNK + j0, sc[r]), m[r] = _mm512_max_ps(m[r], sc[r]);
  }
  for (int r = 0; r < R; ++r) mx[r] = _mm512_reduce_max_ps(m[r]);
}

// accumulate_d64 for bfloat16 or int8 values on AVX-512: acc[r] = acc[r] * alpha[r] + sum_j p[r][j] * V[j], acc held
// in V's row order over the keys (an int8 cache's p carries the value rows' scales, see attend_rows_paired).
template <int R, class T>
inline void accumulate_paired(float* acc, const float* alpha, const float* p, const T* const* V, int64_t n,
                              const T* const* next, int64_t next_n, int64_t next_off) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r) {
    row_order(acc + r * 64, a[r], V[0]);
    for (int d = 0; d < 4; ++d) a[r][d] = _mm512_mul_ps(_mm512_set1_ps(alpha[r]), a[r][d]);
  }
  for (int64_t j = 0; j < n; ++j) {
    prefetch_row_l2(next, next_n, next_off, j);
    __m512 v[4];
    widen_pairs(V[j], v);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * KEY_CHUNK + j]);
      for (int d = 0; d < 4; ++d) a[r][d] = _mm512_fmadd_ps(pj, v[d], a[r][d]);
    }
  }
  for (int r = 0; r < R; ++r) natural_order(a[r], acc + r * 64, V[0]);
}
#endif

// The online softmax's step for rows r0 .. r0 + R - 1 whose chunk scores (nv of them, KEY_CHUNK apart in sc.s) have
// maxima mx: the scores become exp(s - m_new), alpha[r] = exp(m_old - m_new) rescales what the rows hold.
inline void softmax_update(int64_t r0, int R, int64_t nv, const float* mx, float* alpha, Scratch& sc) {
  float* s = sc.s.data() + r0 * KEY_CHUNK;
  for (int r = 0; r < R; ++r) {
    const int64_t rr = r0 + r;
    const float m_new = std::max(sc.m[rr], mx[r]);
    alpha[r] = std::exp(sc.m[rr] - m_new);  // 0 on the first chunk (m = -inf)
    const float psum = exp_sub_sum(s + r * KEY_CHUNK, s + r * KEY_CHUNK, m_new, nv);
    sc.l[rr] = sc.l[rr] * alpha[r] + psum;
    sc.m[rr] = m_new;
  }
}

// Whether rows of a T cache with head dim D take attend_rows_paired (bfloat16 or int8 at D == 64, where AVX-512 is
// built).
template <class T>
constexpr bool takes_paired(int64_t D) {
#ifdef TP_HAVE_PAIRED_D64
  return (std::is_same_v<T, uint16_t> || std::is_same_v<T, int8_t>) && D == 64;
#else
  return (void)D, false;
#endif
}

#ifdef TP_HAVE_PAIRED_D64
// x[j] *= f[j], j < n.
inline void scale_by(float* x, const float* f, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(x + j, _mm512_mul_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(f + j)));
  for (; j < n; ++j) x[j] *= f[j];
}

// attend_rows for bfloat16 or int8 rows at D == 64 on AVX-512 (scores_paired, accumulate_paired). Over an int8
// cache the scores take each key's scale (sc.ks, filled per chunk), and after the softmax's step (whose sums count
// the probabilities alone) each probability takes its value row's scale.
template <class T>
inline void attend_rows_paired(const T* const* K, const T* const* V, int64_t r0, int R, int64_t nv, Scratch& sc,
                               const NextRows<T>& next) {
  float mx[GROUP_ROWS], alpha[GROUP_ROWS];
  float* s = sc.s.data() + r0 * KEY_CHUNK;
  float* q = sc.q.data() + r0 * 64;
  float* acc = sc.acc.data() + r0 * 64;
  alignas(64) float vs[KEY_CHUNK];
  if constexpr (std::is_same_v<T, int8_t>) {
    for (int64_t j = 0; j < KEY_CHUNK; ++j) sc.ks[j] = int8_row_scale(K[std::min(j, nv - 1)], 64);
    for (int64_t j = 0; j < nv; ++j) vs[j] = int8_row_scale(V[j], 64);
  }
  auto rows = [&](auto r) {
    constexpr int RR = decltype(r)::value;
#ifdef TP_HAVE_INT8_QK
    if constexpr (std::is_same_v<T, int8_t>)
      scores_int8<RR>(sc.q8.data() + r0 * (64 + kInt8RowExtra), K, nv, s, mx, next.k, next.n, next.k_off, sc.ks.data());
    else
#endif
    scores_paired<RR>(q, K, nv, s, mx, next.k, next.n, next.k_off, sc.ks.data());
    softmax_update(r0, RR, nv, mx, alpha, sc);
    if constexpr (std::is_same_v<T, int8_t>)
      for (int rr = 0; rr < RR; ++rr) scale_by(s + rr * KEY_CHUNK, vs, nv);
    accumulate_paired<RR>(acc, alpha, s, V, nv, next.v, next.n, next.v_off);
  };
  static_assert(GROUP_ROWS == 3, "one case a row count");
  switch (R) {
    case 1: return rows(std::integral_constant<int, 1>{});
    case 2: return rows(std::integral_constant<int, 2>{});
    default: return rows(std::integral_constant<int, 3>{});
  }
}
#endif

// Rows r0 .. r0 + R - 1 (R <= GROUP_ROWS, one query's heads: the same nv keys) over keys p0 .. p0 + nv - 1: scores,
// the online softmax update, and the values.
template <class T>
inline void attend_rows_widened(const T* const* K, const T* const* V, int64_t r0, int R, int64_t nv, int64_t D,
                                Scratch& sc, const NextRows<T>& next, const float* kt) {
  float mx[GROUP_ROWS], alpha[GROUP_ROWS];
  float* s = sc.s.data() + r0 * KEY_CHUNK;
  float* q = sc.q.data() + r0 * D;
  float* acc = sc.acc.data() + r0 * D;
#ifdef TP_HAVE_PAIRED_D64
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (takes_paired<T>(D)) return attend_rows_paired(K, V, r0, R, nv, sc, next);
  }
#endif
#ifdef __AVX2__
  if (kt) {
    switch (R) {
      case 1: scores_kt<1>(q, kt, nv, s, mx); break;
      case 2: scores_kt<2>(q, kt, nv, s, mx); break;
      default: scores_kt<3>(q, kt, nv, s, mx); break;
    }
  } else if (D == 64) {
    switch (R) {
      case 1: scores_d64<1>(q, K, nv, s, mx); break;
      case 2: scores_d64<2>(q, K, nv, s, mx); break;
      default: scores_d64<3>(q, K, nv, s, mx); break;
    }
  } else
#endif
    for (int r = 0; r < R; ++r) mx[r] = scores(q + r * D, K, nv, D, s + r * KEY_CHUNK, sc.row.data());
  softmax_update(r0, R, nv, mx, alpha, sc);
#ifdef __AVX2__
  if (D == 64) {
    switch (R) {
      case 1: accumulate_d64<1, accumulate_slabs(1)>(acc, alpha, s, V, nv); return;
      case 2: accumulate_d64<2, accumulate_slabs(2)>(acc, alpha, s, V, nv); return;
      default: accumulate_d64<3, accumulate_slabs(3)>(acc, alpha, s, V, nv); return;
    }
  }
#endif
  for (int r = 0; r < R; ++r) accumulate(acc + r * D, alpha[r], s + r * KEY_CHUNK, V, nv, D, sc.row.data());
}

// attend_rows_widened above, for float32 and bfloat16 rows; int8 rows reach here at D == 64 on AVX-512 only (the
// attend loop widens them into float32 rows elsewhere).
template <class T>
inline void attend_rows(const T* const* K, const T* const* V, int64_t r0, int R, int64_t nv, int64_t D, Scratch& sc,
                        const NextRows<T>& next = {}, const float* kt = nullptr) {
  if constexpr (std::is_same_v<T, int8_t>) {
#ifdef TP_HAVE_PAIRED_D64
    (void)D, (void)kt;
    attend_rows_paired(K, V, r0, R, nv, sc, next);
#else
    (void)K, (void)V, (void)r0, (void)R, (void)nv, (void)D, (void)sc, (void)next, (void)kt;
    TORCH_CHECK(false, "attend_rows: int8 rows are widened first where AVX-512 is not built");
#endif
  } else {
    attend_rows_widened(K, V, r0, R, nv, D, sc, next, kt);
  }
}

// Where row rr of a work item comes from: rows come G to a query (the query's heads of one kv head), per_head
// (queries x G) to a kv head.
struct ItemRows {
  int64_t G, per_head, kv0, q0;
  ItemRows(const Args& a, const WorkItem& w) : G(a.groups), per_head((w.q1 - w.q0) * a.groups), kv0(w.kv0), q0(w.q0) {}
  int64_t head(int64_t rr) const { return (kv0 + rr / per_head) * G + rr % G; }
  int64_t query(int64_t rr) const { return q0 + (rr % per_head) / G; }  // within the request
};

// dst = s * src over n values, float32 or bfloat16 either side: widened, scaled and (bfloat16 dst) rounded once, in one
// pass over registers. As a pass into memory (widen; scale in place) and a second pass back, each vector was stored
// in one width and loaded in another, and the wider loads waited for the narrower stores to retire: begin_item and
// finish_item were 4.3% and 10.8% of prefill attention's samples (8 x 256 tokens, 2 Zen 4 cores), finish_item 0.8%
// of a 32-row decode step's.
template <class D, class S>
inline void scaled_copy(D* dst, const S* src, float s, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) store16(dst + i, _mm512_mul_ps(_mm512_set1_ps(s), load16(src + i)));
#endif
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_mul_ps(_mm256_set1_ps(s), load8(src + i)));
#endif
  for (; i < n; ++i) {
    float x;
    convert(&x, src + i, 1);
    x *= s;
    convert(dst + i, &x, 1);
  }
}

// The rows of an item lie apart (a query's rows of q, of out): the row this many ahead is prefetched as one is
// copied, so that the copies' cache misses overlap. Prefill attention of 8 x 256 tokens over 30 layers, 2 Zen 4
// cores, q a view of a qkv output: the row copies were ~20% of its samples (in memmove), and it took 109.5 -> 102.3
// ms with both changes (medians of 4 alternating builds; 12 rows ahead instead of 4 the same); in the engine's
// 2,048-token prefill steps the copies went from ~2.9% of the samples to 1.2%.
constexpr int64_t kRowPrefetch = 4;

// Starts item w: its rows' queries into sc.q (float32, times the scale), their key positions into sc.pos, the online
// softmax's state (acc, m, l) reset.
template <class QT>
void begin_item(const Args& a, const WorkItem& w, const QT* q, Scratch& sc) {
  const ItemRows at(a, w);
  const int64_t D = a.D, rows = w.rows(a.groups), tok0 = a.qsl[w.req];
  const int64_t start = a.seq_lens[w.req] - (a.qsl[w.req + 1] - tok0);  // the request's first query position
  auto q_row = [&](int64_t rr) { return q + (tok0 + at.query(rr)) * a.q_s0 + at.head(rr) * D; };
  for (int64_t rr = 0; rr < rows; ++rr) {
    if (rr + kRowPrefetch < rows) prefetch_bytes(q_row(rr + kRowPrefetch), D * sizeof(QT));
    scaled_copy(sc.q.data() + rr * D, q_row(rr), a.scale, D);
    sc.pos[rr] = start + at.query(rr);
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
}

// Ends item w: each row's acc divided by its softmax sum, written to out in out's dtype (bfloat16: that float32
// quotient rounded once).
template <class OT>
void finish_item(const Args& a, const WorkItem& w, OT* out, Scratch& sc) {
  const ItemRows at(a, w);
  const int64_t D = a.D, tok0 = a.qsl[w.req], rows = w.rows(a.groups);
  auto out_row = [&](int64_t rr) { return out + (tok0 + at.query(rr)) * a.o_s0 + at.head(rr) * D; };
  for (int64_t rr = 0; rr < rows; ++rr) {
    if (rr + kRowPrefetch < rows) prefetch_bytes(out_row(rr + kRowPrefetch), D * sizeof(OT));
    scaled_copy(out_row(rr), sc.acc.data() + rr * D, sc.l[rr] > 0.f ? 1.f / sc.l[rr] : 0.f, D);
  }
}

// One work item: for each kv head g of [kv0, kv1), its (q1-q0) queries x groups heads; online softmax over key
// chunks, every kv head's rows of a chunk before the next chunk. Row rr = ((g - kv0) * (q1-q0) + i - q0) * G + gh.
// Each row's arithmetic is the same whatever the item's shape (batch invariance).
template <class T, class QT, class OT>
void attend(const Args& a, const WorkItem& w, const QT* q, OT* out, const T* kc, const T* vc, Scratch& sc,
            const WorkItem* after = nullptr) {
  const int64_t D = a.D, G = a.groups, bs = a.block_size;  // bs: cache block size
  const int64_t start = a.seq_lens[w.req] - (a.qsl[w.req + 1] - a.qsl[w.req]);
  const int64_t per_head = (w.q1 - w.q0) * G;
  begin_item(a, w, q, sc);
#ifdef TP_HAVE_INT8_QK
  if constexpr (std::is_same_v<T, int8_t>) {  // scores_int8's queries, each row rounded to int8 once
    if (takes_paired<T>(D))
      for (int64_t rr = 0; rr < w.rows(G); ++rr)
        quantize_int8_row(sc.q8.data() + rr * (64 + kInt8RowExtra), sc.q.data() + rr * 64, 64);
  }
#endif
  // bfloat16 rows are widened in registers where they are read; when more rows than one query's heads read them
  // (a prefill chunk), once per chunk into float32 buffers instead (each row read up to 48 times: 0.69x in
  // registers on a 512-token chunk).
  // (Not where bfloat16 rows take attend_rows_paired: its widening costs a quarter of the AVX2 one, and every row
  // then has one arithmetic whatever its request's query count.)
  const bool prefetch_next = takes_paired<T>(D);
  // used for bfloat16 and int8 caches only; int8 rows off attend_rows_paired always
  const bool widen = (per_head > G || std::is_same_v<T, int8_t>) && !prefetch_next;
  const int64_t last = start + w.q1 - 1;  // furthest key position any row sees
  const int32_t* bt = a.block_tables + w.req * a.max_blocks;
  // a whole-slot item's heads side by side in each slot (contiguous caches): read every chunk's slots in order first
  const bool pull = w.kv1 - w.kv0 > 1 && a.k_s1 == a.row && a.v_s1 == a.row;
  // a chunk's K / V rows of kv head kv0 (head g's are (g - kv0) head strides on), this chunk's and the next's
  const T* krows[2][KEY_CHUNK];
  const T* vrows[2][KEY_CHUNK];
  int cur = 0;
  bool found = false;  // whether this chunk's rows were found as the previous chunk's next
  for (int64_t p0 = 0; p0 <= last;) {
    const int64_t n = std::min(KEY_CHUNK, last + 1 - p0);
    const T** Kslot = krows[cur];
    const T** Vslot = vrows[cur];
    if (!found) {
      kv_rows(kc, a.k_s0, w.kv0 * a.k_s1, bt, bs, p0, n, Kslot);
      kv_rows(vc, a.v_s0, w.kv0 * a.v_s1, bt, bs, p0, n, Vslot);
    }
    // Where rows take attend_rows_paired, the next chunk's rows are fetched into L2 a kv head at a time while this
    // chunk is worked on (NextRows), and a whole-slot item pulls its first chunk only (nothing else to overlap those
    // loads with). 32 requests x 320 keys of decode attention, 30 layers, bfloat16, 2 Zen 4 cores: 13.4 ms against
    // 14.9 with every chunk pulled. The AVX2 kernels keep the pull of every chunk (float32 cache, the same requests:
    // 27.5-29.7 ms pulled, 29.9-33.6 prefetched).
    const T** Knext = krows[cur ^ 1];
    const T** Vnext = vrows[cur ^ 1];
    int64_t n_next = prefetch_next ? std::min(KEY_CHUNK, last + 1 - (p0 + n)) : 0;  // <= 0: none
    if (n_next > 0) {
      kv_rows(kc, a.k_s0, w.kv0 * a.k_s1, bt, bs, p0 + n, n_next, Knext);
      kv_rows(vc, a.v_s0, w.kv0 * a.v_s1, bt, bs, p0 + n, n_next, Vnext);
    } else if (prefetch_next && after && after->kv0 == w.kv0 && after->kv1 == w.kv1) {
      // the last chunk: the first chunk of the item this thread runs next (claim_ahead), over the same kv heads,
      // which then skips its pull. Decode attention over 32 requests x 320 keys x 30 layers, bfloat16, 2 Zen 4 cores,
      // alternating builds, medians of 25: blocks in order 9.00 / 8.75 / 8.63 ms against 11.00 / 9.35 / 9.00,
      // shuffled 10.76 / 11.50 / 10.73 against 10.89 / 11.73 / 11.59 (session 52)
      n_next = std::min<int64_t>(KEY_CHUNK, a.seq_lens[after->req]);
      const int32_t* bt_after = a.block_tables + after->req * a.max_blocks;
      kv_rows(kc, a.k_s0, w.kv0 * a.k_s1, bt_after, bs, 0, n_next, Knext);
      kv_rows(vc, a.v_s0, w.kv0 * a.v_s1, bt_after, bs, 0, n_next, Vnext);
      sc.prefetched = after;
    }
    if (pull && ((p0 == 0 && sc.prefetched != &w) || !prefetch_next))
      pull_slots(Kslot, Vslot, n, static_cast<int64_t>((w.kv1 - w.kv0) * a.row * sizeof(T)));
    for (int64_t g = w.kv0; g < w.kv1; ++g) {
      NextRows<T> next;  // the next chunk's rows of head g, prefetched by this head's first rows (not float32)
      if constexpr (!std::is_same_v<T, float>)
        if (n_next > 0) next = {Knext, Vnext, n_next, (g - w.kv0) * a.k_s1, (g - w.kv0) * a.v_s1};
      // The rows of kv head g over keys p0 .. p0 + n - 1, K and V rows given as the cache's pointers or widened
      // float32 ones (then with nothing to prefetch). Rows come G to a query (rr = ... + (i - q0) * G + gh), taken up
      // to GROUP_ROWS at a time within a query.
      const float* kt = nullptr;  // K transposed for scores_kt: items of more than one query (their rows share it)
      auto attend_head = [&](const auto* const* K, const auto* const* V) {
        using Row = std::decay_t<decltype(**K)>;
        NextRows<Row> head_next;
        if constexpr (std::is_same_v<Row, T>) head_next = next;
#ifdef __AVX2__
        if constexpr (std::is_same_v<Row, float>) {
          if (D == 64 && per_head > G) transpose_chunk(K, n, sc.kt.data()), kt = sc.kt.data();
        }
#endif
        const int64_t begin = (g - w.kv0) * per_head;
        for (int64_t rr = begin; rr < begin + per_head;) {
          const int64_t query_end = rr - (rr - begin) % G + G;
          const int R = static_cast<int>(std::min<int64_t>(GROUP_ROWS, query_end - rr));
          const int64_t nv = std::min(n, sc.pos[rr] - p0 + 1);  // causal: keys p0..pos
          if (nv > 0) attend_rows(K, V, rr, R, nv, D, sc, head_next, kt), head_next.n = 0;
          rr += R;
        }
      };
      const T* K[KEY_CHUNK];
      const T* V[KEY_CHUNK];
      for (int64_t j = 0; j < n; ++j) K[j] = Kslot[j] + (g - w.kv0) * a.k_s1, V[j] = Vslot[j] + (g - w.kv0) * a.v_s1;
      if constexpr (!std::is_same_v<T, float>) {
        if (widen) {
          const float* Kf[KEY_CHUNK];
          const float* Vf[KEY_CHUNK];
          widen_rows(K, n, D, sc.kbuf.data(), Kf);
          widen_rows(V, n, D, sc.vbuf.data(), Vf);
          attend_head(Kf, Vf);
          continue;
        }
      }
      attend_head(K, V);
    }
    p0 += n;
    found = n_next > 0;
    cur ^= found;
  }
  finish_item(a, w, out, sc);
}

#ifdef TP_HAVE_BF16_DOT
static_assert(KEY_CHUNK == kDotCols, "attend_dot scores one key chunk as one panel of 32 columns");

// The chunk's K / V rows of kv head g (keys p0 .. p0 + n - 1) as bfloat16 rows: in place in a bfloat16 cache; from
// an int8 cache, each row's values times its scale rounded into sc.kdeq / sc.vdeq.
inline void chunk_rows_bf16(const Args& a, const uint16_t* kc, const uint16_t* vc, int64_t g, const int32_t* bt,
                            int64_t p0, int64_t n, const uint16_t** K, const uint16_t** V, Scratch&) {
  kv_rows(kc, a.k_s0, g * a.k_s1, bt, a.block_size, p0, n, K);
  kv_rows(vc, a.v_s0, g * a.v_s1, bt, a.block_size, p0, n, V);
}
inline void chunk_rows_bf16(const Args& a, const int8_t* kc, const int8_t* vc, int64_t g, const int32_t* bt,
                            int64_t p0, int64_t n, const uint16_t** K, const uint16_t** V, Scratch& sc) {
  const int8_t* Kq[KEY_CHUNK];
  const int8_t* Vq[KEY_CHUNK];
  kv_rows(kc, a.k_s0, g * a.k_s1, bt, a.block_size, p0, n, Kq);
  kv_rows(vc, a.v_s0, g * a.v_s1, bt, a.block_size, p0, n, Vq);
  float row[64];
  for (int64_t j = 0; j < n; ++j) {
    uint16_t* k = sc.kdeq.data() + j * 64;
    uint16_t* v = sc.vdeq.data() + j * 64;
    dequantize_int8_row(row, Kq[j], 64), convert(k, row, 64), K[j] = k;
    dequantize_int8_row(row, Vq[j], 64), convert(v, row, 64), V[j] = v;
  }
}

// attend() for a prefill item (one kv head, bfloat16 cache, D == 64) on AVX512-BF16 dot products, as flash
// attention runs in bfloat16: the scaled queries and each chunk's probabilities rounded to bfloat16, products summed
// in float32. Per 32-key chunk, a tile of up to 12 rows at a time: S = Q K^T (the chunk's 32 keys as columns, d in
// pairs); as each row's 32 scores leave the tile, the causal mask and the online softmax in float32 (S's unrounded
// values; l sums the unrounded probabilities) in registers, the row's probabilities stored as bfloat16 pairs; then
// O = O * alpha + P V for the tile's rows (keys in pairs, d as two panels of 32). Queries and probabilities lie
// row-major as bfloat16 (the tile broadcasts a row's pair from there), so neither is transposed. Each row's
// arithmetic depends on its own scores alone. Rows as in attend: rr = (i - q0) * G + gh. The softmax's share was a
// third of the time (prefill attention of 8 prompts x 256 tokens x 30 layers, 2 Zen 4 cores: 107 ms, 73 without it);
// exp512_nonpositive, one conversion instruction for 32 probabilities and each row's sum kept as 16 lanes until the
// end, with DOT_Q_TILE's items, took it from 117 to 105 ms (medians of 6 alternating runs). (Scores through a float32
// buffer, softmax row by row on AVX2 and the probabilities transposed pair-major: 1.4x as long, session 29.)
// An int8 cache's rows of each chunk are widened, scaled and rounded to bfloat16 rows first (sc.kdeq, sc.vdeq).
template <class T, class QT, class OT>
void attend_dot(const Args& a, const WorkItem& w, const QT* q, OT* out, const T* kc, const T* vc, Scratch& sc) {
  constexpr int64_t D = 64, DP = D / 2, KP = KEY_CHUNK / 2;
  const int64_t bs = a.block_size, g = w.kv0, rows = w.rows(a.groups);
  const int64_t start = a.seq_lens[w.req] - (a.qsl[w.req + 1] - a.qsl[w.req]);
  const int64_t blocks = (rows + kDotMaxRows - 1) / kDotMaxRows;
  int64_t starts[kMaxDotBlocks + 1];
  for (int64_t b = 0; b <= blocks; ++b) starts[b] = b * rows / blocks;
  begin_item(a, w, q, sc);
  for (int64_t rr = 0; rr < rows; ++rr) {  // row rr rounded to bfloat16: its d pairs at qp + rr * DP, or on FMAs
    const float* qrow = sc.q.data() + rr * D;  // widened again at qf + rr * D
    if (!a.dot_fma) convert(reinterpret_cast<uint16_t*>(sc.qp.data() + rr * DP), qrow, D);
    else round_to_bf16(sc.qf.data() + rr * D, qrow, D);
  }
  float* lv = sc.lv.data();  // row rr's softmax sum as 16 partial sums (lv + 16 rr), added up at the end
  std::fill(lv, lv + rows * 16, 0.f);
  const int32_t* bt = a.block_tables + w.req * a.max_blocks;
  const int64_t last = start + w.q1 - 1;  // furthest key position any row sees
  int32_t* kp32 = reinterpret_cast<int32_t*>(sc.kpanel.data());  // [DP][32 keys]: one int32 = a key's d pair
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p0 = 0; p0 <= last; p0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, last + 1 - p0);
    const uint16_t* K[KEY_CHUNK];
    const uint16_t* V[KEY_CHUNK];
    chunk_rows_bf16(a, kc, vc, g, bt, p0, n, K, V, sc);
    // K^T as a panel (keys past n zero), V with keys in pairs (rows past n zero: their probabilities are 0, and
    // 0 x whatever lies there could be NaN)
    for (int64_t j0 = 0; j0 < KEY_CHUNK; j0 += 16)
      for (int64_t dp0 = 0; dp0 < DP; dp0 += 16)  // keys j0.., pairs dp0.. -> panel rows dp0.., columns j0..
        transpose_pairs16(K + j0, n - j0, dp0, kp32 + dp0 * KEY_CHUNK + j0, KEY_CHUNK, 0xffff);
    // unpack interleaves within 128-bit lanes (lane k of lo: d 8k..8k+3 of both keys, of hi: 8k+4..8k+7): the
    // permutes put a panel row's 32 pairs in d order
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t kp = 0; kp < KP; ++kp) {
      const int64_t j0 = 2 * kp, j1 = 2 * kp + 1;
      for (int64_t c = 0; c < D / kDotCols; ++c) {  // panel c: d 32c .. 32c + 31, each as (key j0, key j1)
        const __m512i v0 = j0 < n ? _mm512_loadu_si512(V[j0] + c * kDotCols) : _mm512_setzero_si512();
        const __m512i v1 = j1 < n ? _mm512_loadu_si512(V[j1] + c * kDotCols) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(v0, v1), hi = _mm512_unpackhi_epi16(v0, v1);
        uint16_t* dst = sc.vpanel.data() + (c * KP + kp) * 2 * kDotCols;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(lo, first, hi));
        _mm512_storeu_si512(dst + kDotCols, _mm512_permutex2var_epi64(lo, second, hi));
      }
    }
    // row rr's online-softmax step from its 32 scores (keys p0..p0+31 in lo, hi); its probabilities to pp + rr * KP
    auto softmax_row = [&](int64_t rr, __m512 lo, __m512 hi) {
      const int64_t nv = std::max<int64_t>(0, std::min(n, sc.pos[rr] - p0 + 1));  // causal: keys p0..pos
      __m512 e_lo = _mm512_setzero_ps(), e_hi = _mm512_setzero_ps();
      if (nv > 0) {
        const uint32_t valid = nv >= 32 ? 0xffffffffu : (1u << nv) - 1;
        const __mmask16 vlo = static_cast<__mmask16>(valid), vhi = static_cast<__mmask16>(valid >> 16);
        const float m_old = sc.m[rr];
        const float mx = std::max(m_old, _mm512_reduce_max_ps(
                                             _mm512_max_ps(_mm512_mask_mov_ps(none, vlo, lo), _mm512_mask_mov_ps(none, vhi, hi))));
        const float alpha = mx == m_old ? 1.f : std::exp(m_old - mx);  // 0 on the first chunk (m = -inf)
        const __m512 mv = _mm512_set1_ps(mx);
        e_lo = _mm512_maskz_mov_ps(vlo, exp512_nonpositive(_mm512_sub_ps(lo, mv)));
        e_hi = _mm512_maskz_mov_ps(vhi, exp512_nonpositive(_mm512_sub_ps(hi, mv)));
        float* l = lv + rr * 16;
        _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha), _mm512_add_ps(e_lo, e_hi)));
        sc.m[rr] = mx;
        if (alpha != 1.f) {
          float* acc = sc.acc.data() + rr * D;
          const __m512 av = _mm512_set1_ps(alpha);
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(av, _mm512_loadu_ps(acc + d)));
        }
      }
      const __m512i p16 = (__m512i)_mm512_cvtne2ps_pbh(e_hi, e_lo);  // keys in order
      if (!a.dot_fma) {
        _mm512_storeu_si512(sc.pp.data() + rr * KP, p16);
      } else {  // the same rounded probabilities as float32 values
        _mm512_storeu_ps(sc.pf.data() + rr * KEY_CHUNK, widen_bf16x16(_mm512_castsi512_si256(p16)));
        _mm512_storeu_ps(sc.pf.data() + rr * KEY_CHUNK + 16, widen_bf16x16(_mm512_extracti64x4_epi64(p16, 1)));
      }
    };
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = starts[b], n_rows = starts[b + 1] - r0;
      if (sc.pos[starts[b + 1] - 1] < p0) continue;  // the block's rows see none of the chunk (causal)
      with_tile_rows(n_rows, [&](auto mr) {
        constexpr int MR = decltype(mr)::value;
        auto to_softmax = [&](int r, __m512 c0, __m512 c1) { softmax_row(r0 + r, c0, c1); };
        if (a.dot_fma) fma_tile<MR>(sc.qf.data() + r0 * D, D, sc.kpanel.data(), DP, to_softmax);
        else dot_tile<MR, DP>(sc.qp.data() + r0 * DP, sc.kpanel.data(), DP, nullptr, 0, to_softmax);
        for (int64_t c = 0; c < 2; ++c) {
          float* o = sc.acc.data() + r0 * D + c * kDotCols;
          const uint16_t* vp = sc.vpanel.data() + c * KP * 2 * kDotCols;
          auto to_acc = [&](int r, __m512 c0, __m512 c1) {
            _mm512_storeu_ps(o + r * D, c0);
            _mm512_storeu_ps(o + r * D + 16, c1);
          };
          if (a.dot_fma) fma_tile<MR>(sc.pf.data() + r0 * KEY_CHUNK, KEY_CHUNK, vp, KP, to_acc, 0, nullptr, o, D);
          else dot_tile<MR, KP>(sc.pp.data() + r0 * KP, vp, KP, o, D, to_acc);
        }
      });
    }
  }
  for (int64_t rr = 0; rr < rows; ++rr) sc.l[rr] = _mm512_reduce_add_ps(_mm512_loadu_ps(lv + rr * 16));
  finish_item(a, w, out, sc);
}
#endif

// Whether a request of q_len queries takes attend_dot: dot_min_queries or more (never over a float32 cache: Args
// holds 0 there), D == 64, where built. Its items do where they are of one kv head and fit one item's tiles
// (takes_dot).
inline bool dot_request(const Args& a, int64_t q_len) {
#ifdef TP_HAVE_BF16_DOT
  return a.dot_min_queries > 0 && a.D == 64 && q_len >= a.dot_min_queries;
#else
  (void)a, (void)q_len;
  return false;
#endif
}

// Whether item w runs on attend_dot.
inline bool takes_dot(const Args& a, const WorkItem& w) {
  return dot_request(a, a.qsl[w.req + 1] - a.qsl[w.req]) && w.kv1 - w.kv0 == 1 &&
         w.rows(a.groups) <= kMaxDotBlocks * kDotMaxRows;
}

// Query positions a work item of a request of q_len queries takes: DOT_Q_TILE on attend_dot (as many as one item's
// tiles hold), else Q_TILE.
inline int32_t query_tile(const Args& a, int64_t q_len) {
  if (!dot_request(a, q_len)) return Q_TILE;
  return static_cast<int32_t>(std::max<int64_t>(Q_TILE, std::min<int64_t>(DOT_Q_TILE, kMaxDotBlocks * kDotMaxRows / a.groups)));
}

// Runs all work items with dynamic scheduling over torch's intra-op threads, each thread claiming its next item
// before it runs one (claim_ahead), so that a decode item's last chunk prefetches the next one's first.
template <class T, class QT, class OT>
void run_items(const Args& a, const std::vector<WorkItem>& items, const QT* q, OT* out, const T* kc, const T* vc) {
  int64_t max_rows = 0;
  bool any_dot = false;
  for (const WorkItem& w : items) max_rows = std::max(max_rows, w.rows(a.groups)), any_dot |= takes_dot(a, w);
  constexpr bool int8 = std::is_same_v<T, int8_t>;
  auto is_dot = [&](const WorkItem& w) {
#ifdef TP_HAVE_BF16_DOT
    if constexpr (!std::is_same_v<T, float>) return takes_dot(a, w);  // attend_dot reads bfloat16 and int8 caches
#endif
    return (void)w, false;
  };
  claim_ahead(static_cast<int64_t>(items.size()), [&] { return Scratch(max_rows, a.D, any_dot, int8, a.dot_fma); },
              [&](int64_t i, int64_t next, Scratch& sc) {
#ifdef TP_HAVE_BF16_DOT
                if constexpr (!std::is_same_v<T, float>) {
                  if (is_dot(items[i])) return attend_dot<T, QT, OT>(a, items[i], q, out, kc, vc, sc);
                }
#endif
                const WorkItem* after = next >= 0 && !is_dot(items[next]) ? &items[next] : nullptr;
                attend<T, QT, OT>(a, items[i], q, out, kc, vc, sc, after);
              });
}

// Request r's rows of out through torch's scaled_dot_product_attention in bfloat16: its context's K / V gathered
// from the cache blocks ([seq, KVH, D]), the queries rounded to bfloat16, causal with the queries at the end of the
// context (lower right). torch's CPU flash attention runs the products on AMX: 1.8-2.6x this file's
// kernel from 64 queries on (2 Xeon cores, 256-1024 keys), even with the gather.
void dense_request(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_table, int64_t seq, int64_t tok0, int64_t q_len, int64_t block_size,
                   double scale) {
  const int64_t KVH = k_cache.size(1), D = k_cache.size(2);
  const at::Tensor blocks = block_table.narrow(0, 0, (seq + block_size - 1) / block_size).to(at::kLong);
  auto context = [&](const at::Tensor& cache) {  // [1, KVH, seq, D]
    at::Tensor rows = cache.view({-1, block_size, KVH, D}).index_select(0, blocks).view({-1, KVH, D});
    return rows.narrow(0, 0, seq).to(at::kBFloat16).transpose(0, 1).unsqueeze(0);
  };
  const at::Tensor query = q.narrow(0, tok0, q_len).to(at::kBFloat16).transpose(0, 1).unsqueeze(0);  // [1, H, q, D]
  const bool whole = q_len == seq;  // a prompt's first chunk: plain causal
  const c10::optional<at::Tensor> mask =
      whole ? c10::optional<at::Tensor>() : at::ones({q_len, seq}, q.options().dtype(at::kBool)).tril(seq - q_len);
  const at::Tensor o = at::scaled_dot_product_attention(query, context(k_cache), context(v_cache), mask, 0.0, whole,
                                                        scale, /*enable_gqa=*/true);  // [1, H, q, D]
  out.narrow(0, tok0, q_len).copy_(o.squeeze(0).transpose(0, 1));
}

}  // namespace

// Whether attention over an int8 cache scores on AVX512-VNNI (queries rounded to int8 rows; see scores16_int8).
bool int8_qk_available() {
#ifdef TP_HAVE_INT8_QK
  return true;
#else
  return false;
#endif
}

// out[T,H,D] = causal varlen attention of q[T,H,D] over the paged cache; see extension.py for the contract. q may be
// a view with rows further apart (the query part of a fused [T, (H + 2 KVH) * D] projection, read in place).
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                     const at::Tensor& seq_lens_in, const at::Tensor& qsl_in, int64_t block_size, double scale,
                     int64_t dense_min_queries, int64_t dot_min_queries, bool dot_fma) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D] of equal shape");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "q's heads must be contiguous within a token (rows may be strided)");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() ||
                  (q.scalar_type() == at::kFloat && out.scalar_type() == at::kBFloat16),
              "out must be q's dtype, or bfloat16 beside float32 queries");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "caches must be [S, KVH, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v caches must share a dtype");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "cache rows must be contiguous in D");
  const auto ct = k_cache.scalar_type(), qt = q.scalar_type();
  const int64_t row = q.size(2) + (ct == at::kChar ? kInt8RowExtra : 0);  // int8: D values, then their scale
  TORCH_CHECK(k_cache.size(2) == row, "head dim mismatch");
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kChar, "cache must be float32, bfloat16 or int8");
  TORCH_CHECK(qt == at::kFloat || qt == ct || (ct == at::kChar && qt == at::kBFloat16),
              "q must be float32 or the cache dtype (float32 or bfloat16 over an int8 cache)");
  const int64_t H = q.size(1), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0, "H must be a multiple of KVH");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  auto bt = block_tables_in.to(at::kInt).contiguous();
  auto sl = seq_lens_in.to(at::kInt).contiguous();
  auto qsl = qsl_in.to(at::kInt).contiguous();
  const int64_t R = sl.size(0);
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) >= R && qsl.size(0) == R + 1, "block_tables [R, B], query_start_loc [R+1]");
  Args a{H, KVH, q.size(2), H / KVH, block_size, bt.size(1), row, q.stride(0), H * q.size(2),
         k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
         static_cast<float>(scale), bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), qsl.data_ptr<int32_t>(),
         ct == at::kFloat ? 0 : dot_min_queries, dot_fma};  // attend_dot reads bfloat16 and int8 caches
  TORCH_CHECK(dot_min_queries >= 0, "dot_min_queries must be >= 0 (0: never)");
  TORCH_CHECK(dense_min_queries >= 0, "dense_min_queries must be >= 0 (0: never)");
  const bool dense_ok = dense_min_queries > 0 && ct != at::kChar && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                        k_cache.size(0) % block_size == 0;  // the cache viewed as [blocks, block_size, KVH, D]
  auto dense = [&](int32_t r) { return dense_ok && a.qsl[r + 1] - a.qsl[r] >= dense_min_queries; };
  int64_t short_requests = 0;
  for (int32_t r = 0; r < R; ++r) short_requests += a.qsl[r + 1] - a.qsl[r] <= WHOLE_SLOT_MAX_QUERIES;
  const bool whole_slots = short_requests >= WHOLE_SLOT_ITEMS_PER_THREAD * at::get_num_threads();
  std::vector<WorkItem> items;
  for (int32_t r = 0; r < R; ++r) {
    const int32_t q_len = a.qsl[r + 1] - a.qsl[r];
    TORCH_CHECK(q_len >= 0 && q_len <= a.seq_lens[r], "request ", r, ": q_len must be in [0, seq_len]");
    const int64_t used = (a.seq_lens[r] + block_size - 1) / block_size;
    TORCH_CHECK(used <= a.max_blocks, "request ", r, ": block table too short");
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = a.block_tables[r * a.max_blocks + b];
      TORCH_CHECK(id >= 0 && (id + 1) * block_size <= k_cache.size(0), "request ", r, ": block id ", id,
                  " outside the cache");
    }
    if (dense(r)) continue;  // below, through torch's SDPA
    if (whole_slots && q_len <= WHOLE_SLOT_MAX_QUERIES) {
      if (q_len > 0) items.push_back({r, 0, static_cast<int32_t>(KVH), 0, q_len});
      continue;
    }
    const int32_t tile = query_tile(a, q_len);
    for (int32_t g = 0; g < KVH; ++g)
      for (int32_t i = 0; i < q_len; i += tile) items.push_back({r, g, g + 1, i, std::min<int32_t>(i + tile, q_len)});
  }
  // Longest contexts first so dynamic scheduling balances the tail.
  std::sort(items.begin(), items.end(), [&](const WorkItem& x, const WorkItem& y) {
    auto cost = [&](const WorkItem& w) {
      return (int64_t)(a.seq_lens[w.req] - (a.qsl[w.req + 1] - a.qsl[w.req]) + w.q1) * w.rows(1);
    };
    return cost(x) > cost(y);
  });
  for (int32_t r = 0; r < R; ++r)
    if (dense(r)) dense_request(out, q, k_cache, v_cache, bt[r], a.seq_lens[r], a.qsl[r], a.qsl[r + 1] - a.qsl[r],
                                block_size, scale);
  if (items.empty()) return;
  auto bf = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  // out in q's dtype, or bfloat16 beside float32 queries (a bfloat16 GEMM's input, rounded here once)
  auto run = [&](const auto* kc, const auto* vc) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    uint16_t* out16 =
        out.scalar_type() == at::kBFloat16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
    if constexpr (!std::is_same_v<T, float>)  // bfloat16 queries: over a bfloat16 or int8 cache (checked above)
      if (qt != at::kFloat) return run_items<T, uint16_t, uint16_t>(a, items, bf(q), out16, kc, vc);
    if (out16 != nullptr) return run_items<T, float, uint16_t>(a, items, q.data_ptr<float>(), out16, kc, vc);
    run_items<T, float, float>(a, items, q.data_ptr<float>(), out.data_ptr<float>(), kc, vc);
  };
  if (ct == at::kChar) run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  else if (ct == at::kBFloat16) run(bf(k_cache), bf(v_cache));
  else run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}

}  // namespace tp
