// Invariant CPU kernels: a linear and a paged split attention whose arithmetic per output element
// is fixed by the element's own inputs and compile-time constants alone -- never by how many rows
// share the call, where a row sits, or how the work is split across threads.
//
// linear: out[m, n] = fma chain over k = 0 .. K-1 in ascending order, starting from +0 (one
//   accumulator per output element). Weights are packed [ceil(N/48), K, 48] so 48 outputs of a
//   row advance together in vector registers; every lane is still its own sequential chain.
//   With k_bounds [0, k1, ..., K]: one such chain per K segment, each from +0, and the S segment
//   partials added in the balanced tree order (samebits.ops.backend.tree_sum): tree(lo, hi) =
//   tree(lo, h) + tree(h, hi), h = lo + (hi - lo + 1) / 2, a single segment its own partial.
// attention: for each (query, head), keys [0, n_keys) in splits of `split` keys, ascending:
//   score = dot(q * scale, k) in 8 lanes (lane l: fma chain over d = l, l+8, ...), lanes summed
//   by the fixed tree ((0+4)+(2+6)) + ((1+5)+(3+7)); p = exp(score - max of the split), exp the
//   kernel's own polynomial for float (see exp_), std::exp for double;
//   l_s = sum of p in key order; acc_s[d] = fma chain of p * v[d] in key order. Splits merge in
//   ascending order: m' = max(m, m_s), a = exp(m - m'), b = exp(m_s - m'),
//   acc = fma(acc_s, b, acc * a), l = fma(l_s, b, l * a); out = acc / l.
// The AVX-512, AVX2 and scalar paths perform the same IEEE operations (true fma), so they give
// the same bits; the widest the CPU has is taken (AVX-512: the linear only).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t NB = 48;  // packed output columns per weight block
constexpr int LANES = 8;    // dot-product lanes of the attention scores

// A call with less work than this (flops) runs on the calling thread: waking the other threads
// costs more, and on an oversubscribed machine a parallel region can wait a whole time slice.
constexpr int64_t PARALLEL_MIN_FLOP = int64_t(1) << 18;

// at::parallel_for's grain (items per thread at least) for items of flop_per_item each
int64_t grain(int64_t flop_per_item) {
  return std::max<int64_t>(1, PARALLEL_MIN_FLOP / std::max<int64_t>(1, flop_per_item));
}

// off: the scalar paths run; g_avx512 off: the linear's AVX2 path runs where AVX-512 would
// (tests prove all give the same bits; set between calls, read by the calls' threads)
std::atomic<bool> g_vectorize{true}, g_avx512{true};

bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok && g_vectorize.load(std::memory_order_relaxed);
}

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok && g_avx512.load(std::memory_order_relaxed) && has_avx2();
}

bool set_vectorized(bool on) { return g_vectorize.exchange(on); }

bool set_avx512(bool on) { return g_avx512.exchange(on); }

// the lanes of the linear's registers on this CPU under the current settings (16, 8, 1: scalar)
int64_t linear_lanes() { return has_avx512() ? 16 : has_avx2() ? 8 : 1; }

// ---------------------------------------------------------------- linear
// Work items: (block of 48 output columns, block of up to ROWS_PER_ITEM rows). An item walks K in
// blocks of K_BLOCK (that much of its packed weight block stays in L1 while all its rows use it),
// keeping each output's accumulator in a buffer between K blocks: storing and reloading an fp32
// accumulator leaves its fma chain unchanged. With k_bounds, each K segment runs its own chain
// from +0 and the segment partials are added in the tree order (one buffer per tree level).
constexpr int64_t K_BLOCK = 128;
constexpr int64_t ROWS_PER_ITEM = 32;

// acc[r * NB + j] = fma(x[r * ldx + k], wp[k * NB + j], acc[r * NB + j]) for k0 <= k < k1 ascending
template <typename T>
void linear_tile_scalar(const T* x, int64_t ldx, int64_t rows, const T* wp, int64_t k0, int64_t k1,
                        T* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < NB; ++j) {
      T a = acc[r * NB + j];
      for (int64_t k = k0; k < k1; ++k) a = std::fma(x[r * ldx + k], wp[k * NB + j], a);
      acc[r * NB + j] = a;
    }
}

template <int R>
__attribute__((target("avx2,fma"))) void linear_tile_avx2(const float* x, int64_t ldx,
                                                          const float* wp, int64_t k0, int64_t k1,
                                                          float* acc) {
  __m256 a[R][6];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 6; ++i) a[r][i] = _mm256_loadu_ps(acc + r * NB + 8 * i);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = wp + k * NB;
    __m256 b[R];
    for (int r = 0; r < R; ++r) b[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int i = 0; i < 6; ++i) {
      const __m256 w = _mm256_loadu_ps(wk + 8 * i);
      for (int r = 0; r < R; ++r) a[r][i] = _mm256_fmadd_ps(b[r], w, a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 6; ++i) _mm256_storeu_ps(acc + r * NB + 8 * i, a[r][i]);
}

// linear_tile_avx2's chains in 16 lanes: a row's 48 columns in 3 registers
template <int R>
__attribute__((target("avx512f"))) void linear_tile_avx512(const float* x, int64_t ldx,
                                                           const float* wp, int64_t k0,
                                                           int64_t k1, float* acc) {
  __m512 a[R][3];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 3; ++i) a[r][i] = _mm512_loadu_ps(acc + r * NB + 16 * i);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = wp + k * NB;
    __m512 b[R];
    for (int r = 0; r < R; ++r) b[r] = _mm512_set1_ps(x[r * ldx + k]);
    for (int i = 0; i < 3; ++i) {
      const __m512 w = _mm512_loadu_ps(wk + 16 * i);
      for (int r = 0; r < R; ++r) a[r][i] = _mm512_fmadd_ps(b[r], w, a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 3; ++i) _mm512_storeu_ps(acc + r * NB + 16 * i, a[r][i]);
}

// rows in tiles of 4, the last 1-3 rows in one smaller tile
void linear_rows_avx512(const float* x, int64_t ldx, int64_t rows, const float* wp, int64_t k0,
                        int64_t k1, float* acc) {
  int64_t r = 0;
  for (; rows - r >= 4; r += 4) linear_tile_avx512<4>(x + r * ldx, ldx, wp, k0, k1, acc + r * NB);
  const float* xr = x + r * ldx;
  float* ar = acc + r * NB;
  switch (rows - r) {
    case 3: linear_tile_avx512<3>(xr, ldx, wp, k0, k1, ar); break;
    case 2: linear_tile_avx512<2>(xr, ldx, wp, k0, k1, ar); break;
    case 1: linear_tile_avx512<1>(xr, ldx, wp, k0, k1, ar); break;
    default: break;
  }
}

// the tile step over k0 <= k < k1 for `rows` rows of x (ldx apart) and their acc rows
template <typename T>
void linear_tile(const T* x, int64_t ldx, int64_t rows, const T* wp, int64_t k0, int64_t k1,
                 T* acc) {
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx512()) {
      linear_rows_avx512(x, ldx, rows, wp, k0, k1, acc);
      return;
    }
    if (has_avx2()) {
      for (int64_t r = 0; r < rows; r += 2) {
        if (rows - r >= 2) linear_tile_avx2<2>(x + r * ldx, ldx, wp, k0, k1, acc + r * NB);
        else linear_tile_avx2<1>(x + r * ldx, ldx, wp, k0, k1, acc + r * NB);
      }
      return;
    }
  }
  linear_tile_scalar<T>(x, ldx, rows, wp, k0, k1, acc);
}

// acc = the fma chains over k0 <= k < k1 from +0, K-blocked
template <typename T>
void linear_segment(const T* x, int64_t ldx, int64_t rows, const T* wb, int64_t k0, int64_t k1,
                    T* acc) {
  std::fill(acc, acc + rows * NB, T(0));
  for (int64_t kb = k0; kb < k1; kb += K_BLOCK)
    linear_tile<T>(x, ldx, rows, wb, kb, std::min(k1, kb + K_BLOCK), acc);
}

// levels of the tree over n segments (0 for one segment)
int64_t tree_height(int64_t n) { return n <= 1 ? 0 : 1 + tree_height((n + 1) / 2); }

// buf[0 .. rows * NB) = the tree sum of segments [lo, hi)'s chains; each deeper level of the
// tree works in the next ROWS_PER_ITEM * NB block of buf (tree_height(S) + 1 blocks in all)
template <typename T>
void linear_tree(const T* xm, int64_t K, int64_t rows, const T* wb,
                 const std::vector<int64_t>& bounds, size_t lo, size_t hi, T* buf) {
  if (hi - lo == 1) {
    linear_segment<T>(xm, K, rows, wb, bounds[lo], bounds[lo + 1], buf);
    return;
  }
  const size_t h = lo + (hi - lo + 1) / 2;
  T* right = buf + ROWS_PER_ITEM * NB;
  linear_tree<T>(xm, K, rows, wb, bounds, lo, h, buf);
  linear_tree<T>(xm, K, rows, wb, bounds, h, hi, right);
  for (int64_t i = 0; i < rows * NB; ++i) buf[i] = buf[i] + right[i];
}

// rows m0 .. m0 + rows - 1 of the output columns of weight block blk; buf: the tree's scratch
template <typename T>
void linear_item(const T* x, int64_t K, int64_t m0, int64_t rows, const T* wp, int64_t N,
                 int64_t blk, const std::vector<int64_t>& bounds, T* buf, T* out) {
  linear_tree<T>(x + m0 * K, K, rows, wp + blk * K * NB, bounds, 0, bounds.size() - 1, buf);
  const int64_t n0 = blk * NB, width = std::min(NB, N - n0);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + (m0 + r) * N + n0, buf + r * NB, width * sizeof(T));
}

// [0, K] or the caller's k_bounds, checked: starts at 0, ends at K, never decreases
std::vector<int64_t> segment_bounds(std::optional<at::IntArrayRef> k_bounds, int64_t K) {
  if (!k_bounds.has_value()) return {0, K};
  std::vector<int64_t> b(k_bounds->begin(), k_bounds->end());
  TORCH_CHECK(b.size() >= 2 && b.front() == 0 && b.back() == K
              && std::is_sorted(b.begin(), b.end()),
              "linear: k_bounds must run from 0 to K, sorted");
  return b;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t n,
                  std::optional<at::IntArrayRef> k_bounds) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && wp.is_contiguous(), "linear: bad layout");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NB && wp.size(1) == x.size(1), "linear: bad packing");
  TORCH_CHECK(x.scalar_type() == wp.scalar_type(), "linear: dtype mismatch");
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0);
  const auto bounds = segment_bounds(k_bounds, K);
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  const int64_t row_blocks = (M + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "invariant_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = wp.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t flop = 2 * std::min(ROWS_PER_ITEM, M) * NB * K;
    const int64_t levels = tree_height(int64_t(bounds.size()) - 1) + 1;
    at::parallel_for(0, blocks * row_blocks, grain(flop), [&](int64_t i0, int64_t i1) {
      std::vector<scalar_t> buf(levels * ROWS_PER_ITEM * NB);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m0 = (i % row_blocks) * ROWS_PER_ITEM;
        linear_item<scalar_t>(xp, K, m0, std::min(ROWS_PER_ITEM, M - m0), w, n, i / row_blocks,
                              bounds, buf.data(), o);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------- attention
// The scalar path runs one (query, head) at a time. The AVX2 path runs a work item -- up to QROWS
// query rows of one sequence with every query head of one kv head -- so each key is loaded once for
// all the item's queries; each (query, head) still performs exactly the scalar path's operations.
constexpr int64_t QROWS = 16;  // query rows per AVX2 work item
constexpr int PV_ROWS = 6;     // queries per tile of the AVX2 p @ V product

// exp, float: n = round(x log2 e) (by the 1.5 * 2^23 shift), r = x - n ln2 (two fma),
// p = Cephes' degree-5 polynomial in Horner fma steps, y = fma(p, r * r, r) + 1, exp = y * 2^n;
// x < -87 -> +0, x > 88 -> +inf, NaN -> x. exp8 performs the same IEEE operations lane-wise.
// double (scalar only): std::exp.
constexpr float EXP_LO = -87.f, EXP_HI = 88.f, EXP_SHIFT = 12582912.f, LOG2E = 1.44269504088896341f;
constexpr float LN2_A = 0.693359375f, LN2_B = -2.12194440e-4f;  // ln2 = LN2_A + LN2_B
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float exp_(float x) {
  if (!(x >= EXP_LO)) return x < EXP_LO ? 0.f : x;
  if (x > EXP_HI) return INFINITY;
  const float t = x * LOG2E, kb = t + EXP_SHIFT, n = kb - EXP_SHIFT;
  float r = std::fma(n, -LN2_A, x);
  r = std::fma(n, -LN2_B, r);
  float p = EXP_P[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, EXP_P[i]);
  const float y = std::fma(p, r * r, r) + 1.f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

double exp_(double x) { return std::exp(x); }

template <typename T>
T dot_scalar(const T* q, const T* k, int64_t D) {
  T lane[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < D; ++d) lane[d % LANES] = std::fma(q[d], k[d], lane[d % LANES]);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

// Folds split s (max m_s, sum l_s, acc_s) into a query's running (m, l, acc);
// `first`: s is split 0.
template <typename T>
void merge_split(bool first, T m_s, T l_s, const T* acc_s, T& m, T& l, T* acc, int64_t D) {
  if (first) {
    m = m_s, l = l_s;
    std::copy(acc_s, acc_s + D, acc);
    return;
  }
  const T m_new = std::max(m, m_s), a = exp_(m - m_new), c = exp_(m_s - m_new);
  for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(acc_s[d], c, acc[d] * a);
  l = std::fma(l_s, c, l * a);
  m = m_new;
}

template <typename T>
struct Attn {
  const T* q; const T* k; const T* v; const int32_t* tables; const int32_t* q_seq;
  const int32_t* q_nkeys; T* out; int64_t hq, hkv, D, bs, max_blocks, split; T scale;

  int64_t slot(int64_t b, int64_t j) const {
    return int64_t(tables[b * max_blocks + j / bs]) * bs + j % bs;
  }
  const T* key(int64_t b, int64_t j, int64_t kh) const { return k + (slot(b, j) * hkv + kh) * D; }
  const T* val(int64_t b, int64_t j, int64_t kh) const { return v + (slot(b, j) * hkv + kh) * D; }

  // one (query row t, query head h), scalar
  void run(int64_t t, int64_t h, T* qs, T* scores, T* acc_s, T* acc) const {
    const int64_t b = q_seq[t], n = q_nkeys[t], kh = h / (hq / hkv);
    for (int64_t d = 0; d < D; ++d) qs[d] = q[(t * hq + h) * D + d] * scale;
    T m = 0, l = 0;
    for (int64_t s0 = 0; s0 < n; s0 += split) {
      const int64_t s1 = std::min(n, s0 + split);
      T m_s = -INFINITY;
      for (int64_t j = s0; j < s1; ++j) {
        scores[j - s0] = dot_scalar<T>(qs, key(b, j, kh), D);
        m_s = std::max(m_s, scores[j - s0]);
      }
      T l_s = 0;
      std::fill(acc_s, acc_s + D, T(0));
      for (int64_t j = s0; j < s1; ++j) {
        const T p = exp_(scores[j - s0] - m_s);
        l_s = l_s + p;
        const T* vj = val(b, j, kh);
        for (int64_t d = 0; d < D; ++d) acc_s[d] = std::fma(p, vj[d], acc_s[d]);
      }
      merge_split<T>(s0 == 0, m_s, l_s, acc_s, m, l, acc, D);
    }
    T* o = out + (t * hq + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = n > 0 ? acc[d] / l : T(0);
  }
};

// [x_l + x_{l+4} | y_l + y_{l+4}], l = 0..3
__attribute__((target("avx2,fma"))) inline __m256 halves(__m256 x, __m256 y) {
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

// lane i of the result:
//   ((a_i[0] + a_i[4]) + (a_i[2] + a_i[6])) + ((a_i[1] + a_i[5]) + (a_i[3] + a_i[7]))
__attribute__((target("avx2,fma"))) inline __m256 lane_trees(const __m256* a) {
  const __m256 s04 = halves(a[0], a[4]), s15 = halves(a[1], a[5]);
  const __m256 s26 = halves(a[2], a[6]), s37 = halves(a[3], a[7]);
  // per 128-bit half: [x: c0 + c2, x: c1 + c3, y: c0 + c2, y: c1 + c3]
  const __m256 x =
      _mm256_add_ps(_mm256_shuffle_ps(s04, s15, 0x44), _mm256_shuffle_ps(s04, s15, 0xEE));
  const __m256 y =
      _mm256_add_ps(_mm256_shuffle_ps(s26, s37, 0x44), _mm256_shuffle_ps(s26, s37, 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x88), _mm256_shuffle_ps(x, y, 0xDD));
}

// lane i < NQ: dot_scalar(qs + i * D, k, D), for NQ queries stored D apart (lanes >= NQ: 0)
template <int NQ>
__attribute__((target("avx2,fma"))) __m256 dot_lanes(const float* qs, const float* k, int64_t D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += LANES) {
    const __m256 kv = _mm256_loadu_ps(k + d);
    for (int i = 0; i < NQ; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + i * D + d), kv, acc[i]);
  }
  return lane_trees(acc);
}

// s[j * lds + i] = dot_scalar(qs + i * D, k[j], D) for keys j0 <= j < j1, queries i < nq <= 8
template <int NQ>
__attribute__((target("avx2,fma"))) void dot_keys(const float* qs, const float* const* k,
                                                  int64_t j0, int64_t j1, float* s, int64_t lds,
                                                  int64_t D) {
  for (int64_t j = j0; j < j1; ++j) _mm256_storeu_ps(s + j * lds, dot_lanes<NQ>(qs, k[j], D));
}

void dot_tile(int nq, const float* qs, const float* const* k, int64_t j0, int64_t j1, float* s,
              int64_t lds, int64_t D) {
  using Fn =
      void (*)(const float*, const float* const*, int64_t, int64_t, float*, int64_t, int64_t);
  static constexpr Fn fns[8] = {dot_keys<1>, dot_keys<2>, dot_keys<3>, dot_keys<4>,
                                dot_keys<5>, dot_keys<6>, dot_keys<7>, dot_keys<8>};
  fns[nq - 1](qs, k, j0, j1, s, lds, D);
}

// lane-wise exp_(float)
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 shift = _mm256_set1_ps(EXP_SHIFT);
  const __m256 n =
      _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), shift), shift);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_A), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_B), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
  const __m256 high = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ);
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), low);
  e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), high);
  return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// 8 queries' split softmax over s[j * lds + i], j < n, i < 8 (query i has cnt[i] keys): writes
// p = exp(s - m_s) over s, m_s and l_s (the scalar path's max and in-order sum, per lane)
__attribute__((target("avx2,fma"))) void softmax8(float* s, int64_t lds, const int32_t* cnt,
                                                  int64_t n, float* m_out, float* l_out) {
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cnt));
  __m256 m = _mm256_set1_ps(-INFINITY), l = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(int(j))));
    const __m256 x = _mm256_loadu_ps(s + j * lds);
    m = _mm256_blendv_ps(m, x, _mm256_and_ps(valid, _mm256_cmp_ps(m, x, _CMP_LT_OQ)));
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(int(j))));
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j * lds), m));
    _mm256_storeu_ps(s + j * lds, p);
    l = _mm256_blendv_ps(l, _mm256_add_ps(l, p), valid);
  }
  _mm256_storeu_ps(m_out, m);
  _mm256_storeu_ps(l_out, l);
}

// acc[r * D + d] = fma(p[j * ldp + r], v[j][d], acc[r * D + d]) for keys j0 <= j < j1 ascending
template <int R>
__attribute__((target("avx2,fma"))) void pv_rows(const float* p, int64_t ldp,
                                                 const float* const* v, int64_t j0, int64_t j1,
                                                 float* acc, int64_t D) {
  for (int64_t d = 0; d < D; d += 2 * LANES) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) a[r][h] = _mm256_loadu_ps(acc + r * D + d + h * LANES);
    for (int64_t j = j0; j < j1; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v[j] + d), v1 = _mm256_loadu_ps(v[j] + d + LANES);
      for (int r = 0; r < R; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + j * ldp + r);
        a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * D + d + h * LANES, a[r][h]);
  }
}

void pv_tile(int rows, const float* p, int64_t ldp, const float* const* v, int64_t j0, int64_t j1,
             float* acc, int64_t D) {
  switch (rows) {
    case 1: return pv_rows<1>(p, ldp, v, j0, j1, acc, D);
    case 2: return pv_rows<2>(p, ldp, v, j0, j1, acc, D);
    case 3: return pv_rows<3>(p, ldp, v, j0, j1, acc, D);
    case 4: return pv_rows<4>(p, ldp, v, j0, j1, acc, D);
    case 5: return pv_rows<5>(p, ldp, v, j0, j1, acc, D);
    default: return pv_rows<6>(p, ldp, v, j0, j1, acc, D);
  }
}

// merge_split<float> with the d loop in AVX2 (the same operations)
__attribute__((target("avx2,fma"))) void merge_split_avx2(bool first, float m_s, float l_s,
                                                          const float* acc_s, float& m, float& l,
                                                          float* acc, int64_t D) {
  if (first) return merge_split<float>(true, m_s, l_s, acc_s, m, l, acc, D);
  const float m_new = std::max(m, m_s), a = exp_(m - m_new), c = exp_(m_s - m_new);
  const __m256 av = _mm256_set1_ps(a), cv = _mm256_set1_ps(c);
  for (int64_t d = 0; d < D; d += LANES)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(_mm256_loadu_ps(acc_s + d), cv,
                                              _mm256_mul_ps(_mm256_loadu_ps(acc + d), av)));
  l = std::fma(l_s, c, l * a);
  m = m_new;
}

// Per-thread scratch of an AVX2 work item: Q queries (q = r * G + g: row t0 + r, head kh * G + g),
// padded to Qp (a multiple of 8); s [split, Qp] holds a split's scores, then its p.
struct ItemBuf {
  int64_t Q = 0, Qp = 0;
  std::vector<float> qs, s, acc_s, acc, m, l, m_s, l_s;
  std::vector<int32_t> n, cnt;
  std::vector<const float*> kp, vp;
};

constexpr int64_t KEY_CHUNK = 32;  // keys whose K (then V) rows stay in L1 across all the queries

// s, m_s, l_s of the split whose keys are w.kp[0 .. cnt[q])
__attribute__((target("avx2,fma"))) void item_softmax(ItemBuf& w, int64_t c_max, int64_t D) {
  for (int64_t j0 = 0; j0 < c_max; j0 += KEY_CHUNK)
    for (int64_t g0 = 0; g0 < w.Q; g0 += 8) {
      const int64_t c = *std::max_element(w.cnt.begin() + g0, w.cnt.begin() + g0 + 8);
      dot_tile(int(std::min<int64_t>(8, w.Q - g0)), &w.qs[g0 * D], w.kp.data(), j0,
               std::min(j0 + KEY_CHUNK, c), &w.s[g0], w.Qp, D);
    }
  for (int64_t g0 = 0; g0 < w.Q; g0 += 8) {
    const int64_t c = *std::max_element(w.cnt.begin() + g0, w.cnt.begin() + g0 + 8);
    softmax8(&w.s[g0], w.Qp, &w.cnt[g0], c, &w.m_s[g0], &w.l_s[g0]);
  }
}

// acc_s[q] = the fma chain of p[j][q] * v[j] over j < cnt[q], ascending
void item_pv(ItemBuf& w, int64_t c_max, int64_t D) {
  w.acc_s.assign(w.Q * D, 0.f);
  for (int64_t j0 = 0; j0 < c_max; j0 += KEY_CHUNK) {
    const int64_t j1 = j0 + KEY_CHUNK;
    for (int64_t q0 = 0; q0 < w.Q; q0 += PV_ROWS) {
      const int rows = int(std::min<int64_t>(PV_ROWS, w.Q - q0));
      const int64_t c_min = *std::min_element(w.cnt.begin() + q0, w.cnt.begin() + q0 + rows);
      if (j0 < c_min)
        pv_tile(rows, &w.s[q0], w.Qp, w.vp.data(), j0, std::min(j1, c_min), &w.acc_s[q0 * D], D);
      for (int64_t q = q0; q < q0 + rows; ++q) {  // the keys of q beyond the tile's common ones
        const int64_t a = std::max(j0, c_min), b = std::min<int64_t>(j1, w.cnt[q]);
        if (a < b) pv_tile(1, &w.s[q], w.Qp, w.vp.data(), a, b, &w.acc_s[q * D], D);
      }
    }
  }
}

// scaled queries, key counts; returns the largest key count
int64_t item_queries(const Attn<float>& a, int64_t t0, int64_t rows, int64_t kh, ItemBuf& w) {
  const int64_t G = a.hq / a.hkv, D = a.D;
  w.Q = rows * G, w.Qp = (w.Q + 7) / 8 * 8;
  w.qs.assign(w.Qp * D, 0.f), w.n.assign(w.Qp, 0), w.cnt.assign(w.Qp, 0);
  w.m.resize(w.Qp), w.l.resize(w.Qp), w.m_s.resize(w.Qp), w.l_s.resize(w.Qp);
  w.acc.resize(w.Q * D);
  int64_t n_max = 0;
  for (int64_t q = 0; q < w.Q; ++q) {
    const float* src = a.q + ((t0 + q / G) * a.hq + kh * G + q % G) * D;
    for (int64_t d = 0; d < D; ++d) w.qs[q * D + d] = src[d] * a.scale;
    w.n[q] = a.q_nkeys[t0 + q / G];
    n_max = std::max<int64_t>(n_max, w.n[q]);
  }
  const int64_t keys = std::min(a.split, n_max);  // the most keys of one split
  w.s.resize(keys * w.Qp), w.kp.resize(keys), w.vp.resize(keys);
  return n_max;
}

// Rows t0 .. t0 + rows - 1 (one sequence) with all query heads of kv head kh, AVX2.
void attention_item(const Attn<float>& a, int64_t t0, int64_t rows, int64_t kh, ItemBuf& w) {
  const int64_t G = a.hq / a.hkv, D = a.D, b = a.q_seq[t0];
  const int64_t n_max = item_queries(a, t0, rows, kh, w);
  for (int64_t s0 = 0; s0 < n_max; s0 += a.split) {
    int64_t c_max = 0;
    for (int64_t q = 0; q < w.Q; ++q) {
      w.cnt[q] = int32_t(std::clamp<int64_t>(w.n[q] - s0, 0, a.split));
      c_max = std::max<int64_t>(c_max, w.cnt[q]);
    }
    for (int64_t j = 0; j < c_max; ++j)
      w.kp[j] = a.key(b, s0 + j, kh), w.vp[j] = a.val(b, s0 + j, kh);
    item_softmax(w, c_max, D);
    item_pv(w, c_max, D);
    for (int64_t q = 0; q < w.Q; ++q)
      if (w.cnt[q] > 0)
        merge_split_avx2(s0 == 0, w.m_s[q], w.l_s[q], &w.acc_s[q * D], w.m[q], w.l[q],
                         &w.acc[q * D], D);
  }
  for (int64_t q = 0; q < w.Q; ++q) {
    float* o = a.out + ((t0 + q / G) * a.hq + kh * G + q % G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = w.n[q] > 0 ? w.acc[q * D + d] / w.l[q] : 0.f;
  }
}

// work items of the AVX2 path: (first row, rows) blocks of at most QROWS rows of one sequence
std::vector<std::pair<int64_t, int64_t>> row_blocks(const int32_t* q_seq, int64_t T_) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t t = 0; t < T_;) {
    int64_t e = t + 1;
    while (e < T_ && e - t < QROWS && q_seq[e] == q_seq[t]) ++e;
    blocks.emplace_back(t, e - t);
    t = e;
  }
  return blocks;
}

int64_t max_keys(const int32_t* q_nkeys, int64_t T_) {
  return T_ > 0 ? *std::max_element(q_nkeys, q_nkeys + T_) : 0;
}

template <typename T>
bool attention_avx2(const Attn<T>&, int64_t) { return false; }

// runs the AVX2 path if it applies (float, AVX2, D a multiple of 16)
bool attention_avx2(const Attn<float>& a, int64_t T_) {
  if (!has_avx2() || a.D % (2 * LANES) != 0) return false;
  const auto blocks = row_blocks(a.q_seq, T_);
  const int64_t flop = 4 * QROWS * (a.hq / a.hkv) * a.D * max_keys(a.q_nkeys, T_);
  at::parallel_for(0, int64_t(blocks.size()) * a.hkv, grain(flop), [&](int64_t i0, int64_t i1) {
    ItemBuf w;
    for (int64_t i = i0; i < i1; ++i)
      attention_item(a, blocks[i / a.hkv].first, blocks[i / a.hkv].second, i % a.hkv, w);
  });
  return true;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_seq,
                     const at::Tensor& q_nkeys, double scale, int64_t split) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous()
              && v_cache.is_contiguous() && block_tables.is_contiguous(), "attention: bad layout");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && q_seq.scalar_type() == at::kInt
              && q_nkeys.scalar_type() == at::kInt, "attention: index tensors must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && split > 0, "attention: bad heads or split");
  const int64_t T_ = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(2);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "invariant_attention", [&] {
    Attn<scalar_t> a{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                     q_seq.data_ptr<int32_t>(), q_nkeys.data_ptr<int32_t>(),
                     out.data_ptr<scalar_t>(), hq, hkv, D, k_cache.size(1),
                     block_tables.size(1), split, scalar_t(scale)};
    if (attention_avx2(a, T_)) return;
    const int64_t flop = 4 * D * max_keys(a.q_nkeys, T_);
    at::parallel_for(0, T_ * hq, grain(flop), [&](int64_t i0, int64_t i1) {
      std::vector<scalar_t> buf(3 * D + split);
      for (int64_t i = i0; i < i1; ++i)
        a.run(i / hq, i % hq, buf.data(), buf.data() + 3 * D, buf.data() + D, buf.data() + 2 * D);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(samebits_cpu, m) {
  m.def("linear(Tensor x, Tensor wp, int n, int[]? k_bounds=None) -> Tensor", &linear);
  m.def("set_vectorized(bool on) -> bool", &set_vectorized);
  m.def("set_avx512(bool on) -> bool", &set_avx512);
  m.def("linear_lanes() -> int", &linear_lanes);
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor q_seq, "
        "Tensor q_nkeys, float scale, int split) -> Tensor", &attention);
}
