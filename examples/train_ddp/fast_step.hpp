#pragma once
// The fused host training step of `--gemm fast` (CPU build only): forward, loss and backward of
// Linear(in, hidden) - ReLU - Linear(hidden, out) for a batch, in blocks of 8 rows, without ever
// writing a [batch x hidden] matrix to memory.
//
// The operation-by-operation step of the compute-bound job (in = 10, hidden = 1024, out = 2,
// batch 256) makes about ten passes over three 1 MB activation matrices (z1, h1, dh), and GEMMs
// whose small side (k = 10 or n = 2) makes a general GEMM's packing pure overhead. Here every
// row block does
//   h  = relu(x W1^T + b1)          4 x 16 register tiles, bias as the accumulators' start, ReLU on the store
//   z2 = h W2^T + b2                dot products over the block's h (L1-resident scratch)
//   dz2                             the same log_softmax / cross-entropy-backward row kernels as the exact path
//   dW2 += dz2^T h,  db2 += dz2
//   dh = (dz2 W2) * (h > 0)         kept in registers, one 8-column chunk of 8 rows at a time
//   db1 += dh (row-wise: contiguous), dW1^T += x^T dh
// with W1^T, W2, dW1^T, db1 and dW2 as small zero-padded panels (L1/L2-resident).
//
// Bits: the forward adds the bias first, the logits are dot products summed 4 x 8 lanes wide,
// and the gradients are batch sums grouped differently from PyTorch's cascades (dW1 in row
// order, dW2 and db1 even and odd rows apart, db2 in double), so results differ from `exact` in
// the last bits (train_ddp_test compares the losses).

#if !defined(__CUDACC__)

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace train::fast {

// One SIMD vector of floats: 8 lanes with AVX + FMA, else one float (the loops stay the same).
#if defined(__AVX__) && defined(__FMA__)
using vf = __m256;
inline constexpr std::size_t lanes = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vrelu(vf a) { return _mm256_max_ps(a, _mm256_setzero_ps()); }
inline vf vmask_pos(vf h, vf g) { return _mm256_and_ps(g, _mm256_cmp_ps(h, _mm256_setzero_ps(), _CMP_GT_OQ)); }
inline float vsum(vf v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
using vf = float;
inline constexpr std::size_t lanes = 1;
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf v) { *p = v; }
inline vf vset1(float x) { return x; }
inline vf vzero() { return 0.0f; }
inline vf vfma(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vrelu(vf a) { return a > 0.0f ? a : 0.0f; }
inline vf vmask_pos(vf h, vf g) { return h > 0.0f ? g : 0.0f; }
inline float vsum(vf v) { return v; }
#endif

inline constexpr std::size_t block_rows = 8;  // rows per block: dh of one chunk stays in 8 registers
inline constexpr std::size_t chunk = 8;       // columns per chunk of the chunk-major panels

/// The step's shapes and buffers. Parameters and gradients in named_parameters() layout:
/// w1 [hidden x in], b1 [hidden], w2 [out x hidden], b2 [out].
struct step_args {
  long batch;
  int in, hidden, out;
  const float* x;  // [batch x in], the gathered rows
  const float *w1, *b1, *w2, *b2;
  float *g_w1, *g_b1, *g_w2, *g_b2;
  float* z2;         // [batch x out]: logits, for the row loss
  const float* dz2;  // [batch x out]: what row_loss(r) wrote for row r
};

// Zero-padded panels, rebuilt every step (a few tens of KB; one per thread, so replicas in one
// process share them safely: a step runs start to end on one thread). W1^T and its gradient are
// chunk-major, element (p, j) at ((j / 8) * in + p) * 8 + j % 8, so that a column tile reads
// one contiguous run instead of `in` rows 4 KB apart (which share an L1 set); the row-major ones
// have a row stride of hidden8 + 16 floats for the same reason.
struct panels {
  std::vector<float> w1c, b1, w2;     // [hp/8][in][8], [hp], [out x hs]
  std::vector<float> dw1c, db1, dw2;  // accumulators, same shapes
  std::vector<float> h;               // [block_rows x hs]: the block's activations
  std::vector<float> dz;              // [block_rows x out]: the block's dz2, zero past the batch
  std::vector<double> db2;
};

// 4 rows x V vectors of h = relu(b1 + x W1^T) at columns [c, c + V * lanes); xr: the rows of x.
template <std::size_t V>
inline void forward_tile(const float* const* xr, std::size_t in, const float* __restrict w1c, const float* __restrict b1,
                         std::size_t c, float* __restrict h, std::size_t hs) {
  vf acc[4][V];
  for (auto& row : acc)
    for (std::size_t v = 0; v < V; ++v) row[v] = vload(b1 + c + lanes * v);
  const float* w[V];
  for (std::size_t v = 0; v < V; ++v) {
    const std::size_t col = c + lanes * v;
    w[v] = w1c + (col / chunk) * in * chunk + col % chunk;
  }
  for (std::size_t p = 0; p < in; ++p) {
    vf y[V];
    for (std::size_t v = 0; v < V; ++v) y[v] = vload(w[v] + p * chunk);
    for (std::size_t r = 0; r < 4; ++r) {
      const vf xv = vset1(xr[r][p]);
      for (std::size_t v = 0; v < V; ++v) acc[r][v] = vfma(xv, y[v], acc[r][v]);
    }
  }
  for (std::size_t r = 0; r < 4; ++r)
    for (std::size_t v = 0; v < V; ++v) vstore(h + r * hs + c + lanes * v, vrelu(acc[r][v]));
}

// dW1^T[p0 .. p0+P) at one column vector += x[r][p] * dh[r] over the block's rows: P independent
// accumulators in registers, the rows in order.
template <std::size_t P>
inline void dw1_group(const float* const* xr, std::size_t p0, const vf* dh, float* __restrict dw) {
  vf acc[P];
  for (std::size_t q = 0; q < P; ++q) acc[q] = vload(dw + q * chunk);
  for (std::size_t r = 0; r < block_rows; ++r)
    for (std::size_t q = 0; q < P; ++q) acc[q] = vfma(vset1(xr[r][p0 + q]), dh[r], acc[q]);
  for (std::size_t q = 0; q < P; ++q) vstore(dw + q * chunk, acc[q]);
}

template <std::size_t P = 12>
inline void dw1_columns(const float* const* xr, std::size_t p0, std::size_t n, const vf* dh, float* dw) {
  for (; n >= P; n -= P, p0 += P) dw1_group<P>(xr, p0, dh, dw + p0 * chunk);
  if constexpr (P > 1) {
    if (n > 0) dw1_columns<P - 1>(xr, p0, n, dh, dw);
  }
}

struct layout {
  std::size_t in, hidden, out, hp, hs;  // hp: hidden rounded up to 8; hs: row stride of the row-major panels
  explicit layout(const step_args& a)
      : in(std::size_t(a.in)), hidden(std::size_t(a.hidden)), out(std::size_t(a.out)),
        hp((hidden + chunk - 1) / chunk * chunk), hs(hp + 16) {}
};

inline panels& scratch() {
  thread_local panels s;
  return s;
}

inline void pack_weights(const step_args& a, const layout& l, panels& s) {
  s.w1c.assign(l.in * l.hp, 0.0f);
  s.b1.assign(l.hp, 0.0f);
  s.w2.assign(l.out * l.hs, 0.0f);
  s.h.assign(block_rows * l.hs, 0.0f);
  for (std::size_t j = 0; j < l.hidden; ++j)
    for (std::size_t p = 0; p < l.in; ++p) s.w1c[((j / chunk) * l.in + p) * chunk + j % chunk] = a.w1[j * l.in + p];
  std::copy(a.b1, a.b1 + l.hidden, s.b1.begin());
  for (std::size_t o = 0; o < l.out; ++o)
    std::copy(a.w2 + o * l.hidden, a.w2 + (o + 1) * l.hidden, s.w2.begin() + long(o * l.hs));
}

// The block of rows r0 .. r0 + 7: x's row pointers (rows past the batch read its last row:
// computed, never used), h into s.h, and the logits of the rows inside the batch into a.z2.
inline std::size_t forward_block(const step_args& a, const layout& l, panels& s, long r0, const float** xr) {
  const std::size_t rn = std::size_t(std::min<long>(long(block_rows), a.batch - r0));
  for (std::size_t r = 0; r < block_rows; ++r) xr[r] = a.x + std::min(r0 + long(r), a.batch - 1) * a.in;
  const std::size_t hp = l.hp, hs = l.hs;
  float* __restrict hb = s.h.data();
  for (std::size_t t = 0; t < block_rows; t += 4) {
    std::size_t c = 0;
    for (; c + 2 * lanes <= hp; c += 2 * lanes) forward_tile<2>(xr + t, l.in, s.w1c.data(), s.b1.data(), c, hb + t * hs, hs);
    for (; c < hp; c += lanes) forward_tile<1>(xr + t, l.in, s.w1c.data(), s.b1.data(), c, hb + t * hs, hs);
  }
  for (std::size_t r = 0; r < rn; ++r) {
    const float* h = hb + r * hs;
    for (std::size_t o = 0; o < l.out; ++o) {
      const float* w = s.w2.data() + o * hs;
      vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
      std::size_t c = 0;
      for (; c + 4 * lanes <= hp; c += 4 * lanes)
        for (std::size_t v = 0; v < 4; ++v) acc[v] = vfma(vload(h + c + v * lanes), vload(w + c + v * lanes), acc[v]);
      for (; c < hp; c += lanes) acc[0] = vfma(vload(h + c), vload(w + c), acc[0]);
      a.z2[(std::size_t(r0) + r) * l.out + o] = a.b2[o] + vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
    }
  }
  return rn;
}

/// The logits alone (evaluation): a.z2 for every row of the batch; the gradients are not touched.
inline void logits(const step_args& a) {
  panels& s = scratch();
  const layout l(a);
  pack_weights(a, l, s);
  const float* xr[block_rows];
  for (long r0 = 0; r0 < a.batch; r0 += long(block_rows)) forward_block(a, l, s, r0, xr);
}

/// One training step. row_loss(r) turns the logits of batch row r (a.z2) into its dz2 row (a.dz2);
/// it is called once per row, in order, after that row's logits are written.
template <class RowLoss>
void step(const step_args& a, RowLoss&& row_loss) {
  panels& s = scratch();
  const layout l(a);
  const std::size_t in = l.in, hidden = l.hidden, out = l.out, hp = l.hp, hs = l.hs;
  pack_weights(a, l, s);
  s.dw1c.assign(in * hp, 0.0f);
  s.db1.assign(hp, 0.0f);
  s.dw2.assign(out * hs, 0.0f);
  s.dz.assign(block_rows * out, 0.0f);
  s.db2.assign(out, 0.0);

  const float* __restrict w2 = s.w2.data();
  float* __restrict dw1c = s.dw1c.data();
  float* __restrict db1 = s.db1.data();
  float* __restrict dw2 = s.dw2.data();
  const float* __restrict hb = s.h.data();
  float* __restrict dzb = s.dz.data();
  for (long r0 = 0; r0 < a.batch; r0 += long(block_rows)) {
    const float* xr[block_rows];
    const std::size_t rn = forward_block(a, l, s, r0, xr);
    for (std::size_t r = 0; r < rn; ++r) {
      row_loss(r0 + long(r));
      for (std::size_t o = 0; o < out; ++o) {
        const float d = a.dz2[(std::size_t(r0) + r) * out + o];
        dzb[r * out + o] = d;
        s.db2[o] += double(d);
      }
    }
    for (std::size_t r = rn; r < block_rows; ++r)
      for (std::size_t o = 0; o < out; ++o) dzb[r * out + o] = 0.0f;  // rows past the batch add nothing

    // Backward, one column vector at a time over the block's rows.
    for (std::size_t c = 0; c < hp; c += lanes) {
      vf dh[block_rows];
      for (auto& v : dh) v = vzero();
      for (std::size_t o = 0; o < out; ++o) {
        const vf w = vload(w2 + o * hs + c);
        vf d0 = vload(dw2 + o * hs + c), d1 = vzero();
        for (std::size_t r = 0; r < block_rows; r += 2) {
          const vf z0 = vset1(dzb[r * out + o]), z1 = vset1(dzb[(r + 1) * out + o]);
          d0 = vfma(z0, vload(hb + r * hs + c), d0);  // dW2 += dz2^T h
          d1 = vfma(z1, vload(hb + (r + 1) * hs + c), d1);
          dh[r] = vfma(z0, w, dh[r]);  // dz2 W2
          dh[r + 1] = vfma(z1, w, dh[r + 1]);
        }
        vstore(dw2 + o * hs + c, vadd(d0, d1));
      }
      vf db0 = vzero(), db1v = vzero();
      for (std::size_t r = 0; r < block_rows; r += 2) {
        dh[r] = vmask_pos(vload(hb + r * hs + c), dh[r]);  // relu backward
        dh[r + 1] = vmask_pos(vload(hb + (r + 1) * hs + c), dh[r + 1]);
        db0 = vadd(db0, dh[r]);
        db1v = vadd(db1v, dh[r + 1]);
      }
      vstore(db1 + c, vadd(vload(db1 + c), vadd(db0, db1v)));
      dw1_columns(xr, 0, in, dh, dw1c + (c / chunk) * in * chunk + c % chunk);
    }
  }

  for (std::size_t j = 0; j < hidden; ++j)
    for (std::size_t p = 0; p < in; ++p) a.g_w1[j * in + p] = dw1c[((j / chunk) * in + p) * chunk + j % chunk];
  std::copy(db1, db1 + hidden, a.g_b1);
  for (std::size_t o = 0; o < out; ++o) std::copy(dw2 + o * hs, dw2 + o * hs + hidden, a.g_w2 + o * hidden);
  for (std::size_t o = 0; o < out; ++o) a.g_b2[o] = float(s.db2[o]);
}

}  // namespace train::fast

#endif
