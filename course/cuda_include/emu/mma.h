// The CPU emulator's WMMA (nvcuda::wmma): warp-level matrix multiply-accumulate on tiles.
//
// A fragment's layout across the lanes of a warp is unspecified in CUDA; here every lane holds the
// whole tile (num_elements = rows * cols), so element-wise loops over frag.x[i] still work. Each
// operation is warp-synchronous (.sync.aligned): the warp meets at a __syncwarp() first, then every
// lane loads the whole tile, computes the product (in float, or int for 8-bit inputs), or stores
// its share (element i by lane i % 32). Shapes: m16n16k16, m32n8k16, m8n32k16 (half, 8-bit),
// m16n16k8 (precision::tf32), m8n8k4 (double).
#pragma once
#include <cuda_fp16.h>

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
struct u8 {};
struct s8 {};
}  // namespace precision
namespace detail {
template <class T> struct storage { typedef T type; };
template <> struct storage<precision::tf32> { typedef float type; };
template <> struct storage<precision::u8> { typedef unsigned char type; };
template <> struct storage<precision::s8> { typedef signed char type; };
template <class Use, int M, int N, int K> struct dims;
template <int M, int N, int K> struct dims<matrix_a, M, N, K> { enum { R = M, C = K }; };
template <int M, int N, int K> struct dims<matrix_b, M, N, K> { enum { R = K, C = N }; };
template <int M, int N, int K> struct dims<accumulator, M, N, K> { enum { R = M, C = N }; };
template <class T> static inline double value(T v) { return (double)v; }
static inline double value(__half v) { return (double)__half2float(v); }
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void> class fragment {
  public:
    typedef typename detail::storage<T>::type storage_element_type;
    typedef storage_element_type element_type;
    enum { rows = detail::dims<Use, M, N, K>::R, cols = detail::dims<Use, M, N, K>::C, num_elements = rows * cols };
    storage_element_type x[num_elements];
};

static inline float __float_to_tf32(float f) {  // round to 10 mantissa bits, to nearest even
    unsigned u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    memcpy(&f, &u, 4);
    return f;
}

template <class Use, int M, int N, int K, class T, class L, class V>
static inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& v) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = (typename fragment<Use, M, N, K, T, L>::storage_element_type)v;
}

namespace detail {
template <class F, class P> static inline void load(F& f, const P* p, unsigned ldm, bool row_major, int line, const char* file) {
    __syncwarp(0xffffffffu, line, file);
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] = row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class L, class P>
static inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm, MT_SITE) {
    detail::load(f, p, ldm, std::is_same<L, row_major>::value, MT_SITE_ARGS);
}
template <int M, int N, int K, class T, class P>
static inline void load_matrix_sync(fragment<accumulator, M, N, K, T, void>& f, const P* p, unsigned ldm, layout_t l, MT_SITE) {
    detail::load(f, p, ldm, l == mem_row_major, MT_SITE_ARGS);
}
template <int M, int N, int K, class T, class P>
static inline void store_matrix_sync(P* p, const fragment<accumulator, M, N, K, T, void>& f, unsigned ldm, layout_t l, MT_SITE) {
    __syncwarp(0xffffffffu, MT_SITE_ARGS);
    typedef fragment<accumulator, M, N, K, T, void> F;
    for (int i = mt::lane(); i < F::num_elements; i += 32) {
        int r = i / F::cols, c = i % F::cols;
        p[l == mem_row_major ? (size_t)r * ldm + c : (size_t)c * ldm + r] = f.x[i];
    }
}
template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC, class TD>
static inline void mma_sync(fragment<accumulator, M, N, K, TD, void>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                            const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC, void>& c,
                            bool satf = false, MT_SITE) {
    __syncwarp(0xffffffffu, MT_SITE_ARGS);
    typename fragment<accumulator, M, N, K, TD, void>::storage_element_type out[M * N];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            if (std::is_integral<TD>::value) {
                long long acc = (long long)c.x[i * N + j];
                for (int k = 0; k < K; ++k) acc += (long long)a.x[i * K + k] * (long long)b.x[k * N + j];
                out[i * N + j] = (TD)acc;
            } else {
                double acc = detail::value(c.x[i * N + j]);
                for (int k = 0; k < K; ++k) acc += detail::value(a.x[i * K + k]) * detail::value(b.x[k * N + j]);
                out[i * N + j] = (typename fragment<accumulator, M, N, K, TD, void>::storage_element_type)acc;
            }
        }
    for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}
}  // namespace wmma
}  // namespace nvcuda
