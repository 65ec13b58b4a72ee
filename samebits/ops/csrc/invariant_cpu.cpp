// Invariant CPU kernels: a linear and a paged split attention whose arithmetic per output element
// is fixed by the element's own inputs and compile-time constants alone -- never by how many rows
// share the call, where a row sits, or how the work is split across threads.
//
// linear: out[m, n] = fma chain over k = 0 .. K-1 in ascending order, starting from +0 (one
//   accumulator per output element). Weights are packed [ceil(N/48), K, 48] so 48 outputs of a
//   row advance together in vector registers; every lane is still its own sequential chain.
// attention: for each (query, head), keys [0, n_keys) in splits of `split` keys, ascending:
//   score = dot(q * scale, k) in 8 lanes (lane l: fma chain over d = l, l+8, ...), lanes summed
//   by the fixed tree ((0+4)+(2+6)) + ((1+5)+(3+7)); p = exp(score - max of the split);
//   l_s = sum of p in key order; acc_s[d] = fma chain of p * v[d] in key order. Splits merge in
//   ascending order: m' = max(m, m_s), a = exp(m - m'), b = exp(m_s - m'),
//   acc = fma(acc_s, b, acc * a), l = fma(l_s, b, l * a); out = acc / l.
// The AVX2 paths and the scalar paths perform the same IEEE operations (true fma), so they give
// the same bits; the AVX2 path is taken when the CPU has it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NB = 48;  // packed output columns per weight block
constexpr int LANES = 8;    // dot-product lanes of the attention scores

bool g_vectorize = true;  // off: the scalar paths run (tests prove both give the same bits)

bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok && g_vectorize;
}

bool set_vectorized(bool on) {
  const bool before = g_vectorize;
  g_vectorize = on;
  return before;
}

// ---------------------------------------------------------------- linear
template <typename T>
void linear_block_scalar(const T* x, int64_t ldx, int64_t rows, const T* wp, int64_t K, T* buf) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < NB; ++j) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], wp[k * NB + j], acc);
      buf[r * NB + j] = acc;
    }
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void linear_block_avx2(const float* x, int64_t ldx,
                                                            const float* wp, int64_t K, float* buf) {
  __m256 acc[R][6];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 6; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = wp + k * NB;
    __m256 b[R];
    for (int r = 0; r < R; ++r) b[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int i = 0; i < 6; ++i) {
      __m256 w = _mm256_loadu_ps(wk + 8 * i);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(b[r], w, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 6; ++i) _mm256_storeu_ps(buf + r * NB + 8 * i, acc[r][i]);
}

template <typename T>
void linear_columns(const T* x, int64_t M, int64_t K, const T* wp, int64_t N, int64_t blk, T* out) {
  T buf[2 * NB];
  const T* wb = wp + blk * K * NB;
  const int64_t n0 = blk * NB, width = std::min(NB, N - n0);
  for (int64_t m = 0; m < M; m += 2) {
    const int64_t rows = std::min<int64_t>(2, M - m);
    if constexpr (std::is_same_v<T, float>) {
      if (has_avx2()) {
        if (rows == 2) linear_block_avx2<2>(x + m * K, K, wb, K, buf);
        else linear_block_avx2<1>(x + m * K, K, wb, K, buf);
      } else {
        linear_block_scalar<T>(x + m * K, K, rows, wb, K, buf);
      }
    } else {
      linear_block_scalar<T>(x + m * K, K, rows, wb, K, buf);
    }
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + (m + r) * N + n0, buf + r * NB, width * sizeof(T));
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && wp.is_contiguous(), "linear: bad layout");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NB && wp.size(1) == x.size(1), "linear: bad packing");
  TORCH_CHECK(x.scalar_type() == wp.scalar_type(), "linear: dtype mismatch");
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0);
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "invariant_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = wp.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) linear_columns<scalar_t>(xp, M, K, w, n, blk, o);
    });
  });
  return out;
}

// ---------------------------------------------------------------- attention
template <typename T>
T dot_scalar(const T* q, const T* k, int64_t D) {
  T lane[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < D; ++d) lane[d % LANES] = std::fma(q[d], k[d], lane[d % LANES]);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* q, const float* k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += LANES)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // l, l+4
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // (0+4)+(2+6), (1+5)+(3+7)
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// acc[d] = fma(p, v[d], acc[d]) / acc[d] = fma(acc_s[d], b, acc[d] * a)
template <typename T>
void axpy_scalar(T p, const T* v, T* acc, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(p, v[d], acc[d]);
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float p, const float* v, float* acc, int64_t D) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t d = 0; d < D; d += LANES)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
}

template <typename T>
struct Attn {
  const T* q; const T* k; const T* v; const int32_t* tables; const int32_t* q_seq;
  const int32_t* q_nkeys; T* out; int64_t hq, hkv, D, bs, max_blocks, split; T scale; bool vec;

  T dot(const T* a, const T* b) const {
    if constexpr (std::is_same_v<T, float>) { if (vec) return dot_avx2(a, b, D); }
    return dot_scalar<T>(a, b, D);
  }
  void axpy(T p, const T* x, T* acc) const {
    if constexpr (std::is_same_v<T, float>) { if (vec) return axpy_avx2(p, x, acc, D); }
    axpy_scalar<T>(p, x, acc, D);
  }
  int64_t slot(int64_t b, int64_t j) const {
    return int64_t(tables[b * max_blocks + j / bs]) * bs + j % bs;
  }

  // one (query row t, query head h)
  void run(int64_t t, int64_t h, T* qs, T* scores, T* acc_s, T* acc) const {
    const int64_t b = q_seq[t], n = q_nkeys[t], kh = h / (hq / hkv);
    for (int64_t d = 0; d < D; ++d) qs[d] = q[(t * hq + h) * D + d] * scale;
    T m = 0, l = 0;
    for (int64_t s0 = 0; s0 < n; s0 += split) {
      const int64_t s1 = std::min(n, s0 + split);
      T m_s = -INFINITY;
      for (int64_t j = s0; j < s1; ++j) {
        scores[j - s0] = dot(qs, k + (slot(b, j) * hkv + kh) * D);
        m_s = std::max(m_s, scores[j - s0]);
      }
      T l_s = 0;
      std::fill(acc_s, acc_s + D, T(0));
      for (int64_t j = s0; j < s1; ++j) {
        const T p = std::exp(scores[j - s0] - m_s);
        l_s = l_s + p;
        axpy(p, v + (slot(b, j) * hkv + kh) * D, acc_s);
      }
      if (s0 == 0) {
        m = m_s, l = l_s;
        std::copy(acc_s, acc_s + D, acc);
        continue;
      }
      const T m_new = std::max(m, m_s), a = std::exp(m - m_new), c = std::exp(m_s - m_new);
      for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(acc_s[d], c, acc[d] * a);
      l = std::fma(l_s, c, l * a);
      m = m_new;
    }
    T* o = out + (t * hq + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = n > 0 ? acc[d] / l : T(0);
  }
};

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_seq,
                     const at::Tensor& q_nkeys, double scale, int64_t split) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous()
              && v_cache.is_contiguous() && block_tables.is_contiguous(), "attention: bad layout");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && q_seq.scalar_type() == at::kInt
              && q_nkeys.scalar_type() == at::kInt, "attention: index tensors must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && split > 0, "attention: bad heads or split");
  const int64_t T_ = q.size(0), hq = q.size(1), D = q.size(2);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "invariant_attention", [&] {
    Attn<scalar_t> a{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                     q_seq.data_ptr<int32_t>(), q_nkeys.data_ptr<int32_t>(),
                     out.data_ptr<scalar_t>(), hq, k_cache.size(2), D, k_cache.size(1),
                     block_tables.size(1), split, scalar_t(scale), has_avx2() && D % LANES == 0};
    at::parallel_for(0, T_ * hq, 1, [&](int64_t i0, int64_t i1) {
      std::vector<scalar_t> buf(3 * D + split);
      for (int64_t i = i0; i < i1; ++i)
        a.run(i / hq, i % hq, buf.data(), buf.data() + 3 * D, buf.data() + D, buf.data() + 2 * D);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(samebits_cpu, m) {
  m.def("linear(Tensor x, Tensor wp, int n) -> Tensor", &linear);
  m.def("set_vectorized(bool on) -> bool", &set_vectorized);
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor q_seq, "
        "Tensor q_nkeys, float scale, int split) -> Tensor", &attention);
}
