// CPU emulation of CUDA C: the header every emulated kernel is compiled against (g++).
//
// The runtime (cuda_emu_runtime.cpp, compiled once and cached) runs each CUDA thread as a fiber.
// A block runs warp by warp: each warp runs its lanes, one after another, until every lane waits
// at a warp operation (shuffle, vote, __syncwarp), at __syncthreads() or has exited; warp
// operations then complete for the lanes named in their masks; when every thread waits at the
// barrier, the block passes it. The order of warps, lanes and blocks is a *schedule*: emulate()
// runs each kernel under two (forward and reverse) and reports any difference as a race.
//
// The kernel is compiled with g++'s ThreadSanitizer instrumentation, but without its runtime:
// every load and store calls a hook (__tsan_read4, ...) in the emulator's runtime, which checks
// it against the argument arrays (any byte outside is reported, with the argument, index, thread
// and source line) and, for shared memory, runs a happens-before race check (a word written by
// one thread and read or written by another in the same barrier interval, with no __syncthreads()
// or warp operation ordering them). This header itself is not instrumented where it touches
// memory on the kernel's behalf (atomics): those accesses are reported to the runtime explicitly.
#pragma once
#include <cassert>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__clang__)
#define MT_NOSAN __attribute__((no_sanitize("thread")))
#else
#define MT_NOSAN __attribute__((no_sanitize_thread))
#endif
#define MT_SITE int mt_line = __builtin_LINE(), const char* mt_file = __builtin_FILE()
#define MT_SITE_ARGS mt_line, mt_file

typedef unsigned int uint;
typedef unsigned short ushort;
template <class T> using mt_id = T;  // lets a rewritten __shared__ declaration name an array type

// --- built-in variables and vector types ---------------------------------------------------
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    operator uint3() const { return {x, y, z}; }
};
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
static const int warpSize = 32;

#define MT_VEC1(T, N, A) struct __attribute__((aligned(A))) N##1 { T x; }; \
    static inline N##1 make_##N##1(T x) { N##1 v; v.x = x; return v; }
#define MT_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    static inline N##2 make_##N##2(T x, T y) { N##2 v; v.x = x; v.y = y; return v; }
#define MT_VEC3(T, N) struct N##3 { T x, y, z; }; \
    static inline N##3 make_##N##3(T x, T y, T z) { N##3 v; v.x = x; v.y = y; v.z = z; return v; }
#define MT_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    static inline N##4 make_##N##4(T x, T y, T z, T w) { N##4 v; v.x = x; v.y = y; v.z = z; v.w = w; return v; }
#define MT_VECS(T, N, A1, A2, A4) MT_VEC1(T, N, A1) MT_VEC2(T, N, A2) MT_VEC3(T, N) MT_VEC4(T, N, A4)
MT_VECS(signed char, char, 1, 2, 4)
MT_VECS(unsigned char, uchar, 1, 2, 4)
MT_VECS(short, short, 2, 4, 8)
MT_VECS(unsigned short, ushort, 2, 4, 8)
MT_VECS(int, int, 4, 8, 16)
MT_VEC1(unsigned int, uint, 4) MT_VEC2(unsigned int, uint, 8) MT_VEC4(unsigned int, uint, 16)
static inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
MT_VECS(long long, longlong, 8, 16, 16)
MT_VECS(unsigned long long, ulonglong, 8, 16, 16)
MT_VECS(float, float, 4, 8, 16)
MT_VECS(double, double, 8, 16, 16)
static inline dim3 make_dim3(unsigned x, unsigned y, unsigned z) { return dim3(x, y, z); }

// --- qualifiers ------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
// libstdc++ writes __attribute__((__noinline__)) in its own headers (GCC 12's <memory>; with
// GCC 13.3 also headers the runtime includes), which the macro below turns into
// __attribute__((__attribute__((__noinline__)))): an unknown attribute, ignored, whose argument
// must still name something. This constant is that something; a kernel's `__noinline__` expands
// to GCC's attribute of the same name.
static constexpr int __noinline__ = 0;
#define __noinline__ __attribute__((__noinline__))
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static
#define __managed__ static
#define __grid_constant__
// __shared__ declarations are rewritten by course/cuda_c.py into references to the emulator's
// shared-memory arena (with names, bounds and a red zone after each). A form it cannot read falls
// back to this: a static variable in a section the runtime resets (and race-checks) per block.
#define __shared__ __attribute__((section("mt_shared"))) static

// --- the runtime's interface (implemented in cuda_emu_runtime.cpp, not instrumented) ---------
extern "C" char mt_arena[];
#define MT_DYN_BASE (mt_arena + 64)
namespace mt {
enum Op {
    SYNCWARP = 1, SHFL, BALLOT, ANY, ALL, RED_ADD, RED_MIN, RED_MAX, RED_UMIN, RED_UMAX, RED_AND,
    RED_OR, RED_XOR, MATCH_ANY, MATCH_ALL, ACTIVEMASK
};
enum BarrierOp { BAR_SYNC = 0, BAR_COUNT, BAR_AND, BAR_OR };
unsigned long long collective(int op, unsigned mask, unsigned long long value, int src_lane, int line,
                              const char* file);
int barrier(int op, int pred, int line, const char* file);
char* shared_alloc(unsigned long long size, unsigned long long align, const char* name, const char* decl,
                   unsigned long long elem_size, int rank, const unsigned long long* dims);
void atomic_access(const volatile void* p, int size, int is_float, int line, const char* file);
void check_vector_access(const volatile void* p, unsigned align, const char* type, int line, const char* file);
void async_access(const volatile void* p, int size, unsigned align, int is_write, int line, const char* file);
[[noreturn]] void kernel_trap(const char* what, int line, const char* file);
int lane();
unsigned long long block_serial();  // which block run this is: a new one in every block of every schedule
long long clock_tick();
// A rewritten `__shared__ float tile[16][17];` calls shared_alloc_t<float[16][17]>("tile", ...) once.
template <class A> static inline char* shared_alloc_t(const char* name, const char* decl, unsigned long long align) {
    const unsigned long long dims[4] = {std::extent<A, 0>::value, std::extent<A, 1>::value, std::extent<A, 2>::value,
                                        std::extent<A, 3>::value};
    return shared_alloc(sizeof(A), align > alignof(A) ? align : alignof(A), name, decl,
                        sizeof(typename std::remove_all_extents<A>::type), (int)std::rank<A>::value, dims);
}
}  // namespace mt

// --- math --------------------------------------------------------------------------------------
// CUDA overloads the math functions for float in the global namespace (exp(float) is float).
using std::abs; using std::acos; using std::asin; using std::atan; using std::atan2; using std::cbrt;
using std::ceil; using std::copysign; using std::cos; using std::cosh; using std::erf; using std::erfc;
using std::exp; using std::exp2; using std::expm1; using std::fabs; using std::floor; using std::fma;
using std::fmax; using std::fmin; using std::fmod; using std::hypot; using std::isfinite; using std::isinf;
using std::isnan; using std::log; using std::log10; using std::log1p; using std::log2; using std::pow;
using std::round; using std::sin; using std::sinh; using std::sqrt; using std::tan; using std::tanh;
using std::trunc; using std::signbit; using std::nearbyint; using std::rint; using std::lround;
#define __expf expf  // glibc declares its own __expf/__logf: the fast CUDA intrinsics map to precise ones
#define __logf logf
#define __sinf sinf
#define __cosf cosf
#define __tanf tanf
#define __exp10f exp10f
#define __log2f log2f
#define __log10f log10f
#define __powf powf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
#define __sincosf sincosf
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fmaf_rz(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frsqrt_rn(float a) { return 1.0f / sqrtf(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
static inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
static inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
static inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
static inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
static inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
static inline double __longlong_as_double(long long i) { double x; memcpy(&x, &i, 8); return x; }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __float2int_rd(float x) { return (int)floorf(x); }
static inline int __float2int_ru(float x) { return (int)ceilf(x); }
static inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
static inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
static inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __double2float_rn(double x) { return (float)x; }
static inline int __double2int_rn(double x) { return (int)nearbyint(x); }

// CUDA's min/max: overloads for every integer width, mixed signedness (unsigned wins), float/double.
#define MT_MINMAX(R, A, B) static inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
                           static inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
MT_MINMAX(int, int, int)
MT_MINMAX(unsigned int, unsigned int, unsigned int)
MT_MINMAX(unsigned int, int, unsigned int)
MT_MINMAX(unsigned int, unsigned int, int)
MT_MINMAX(long, long, long)
MT_MINMAX(unsigned long, unsigned long, unsigned long)
MT_MINMAX(unsigned long, long, unsigned long)
MT_MINMAX(unsigned long, unsigned long, long)
MT_MINMAX(long long, long long, long long)
MT_MINMAX(unsigned long long, unsigned long long, unsigned long long)
MT_MINMAX(unsigned long long, long long, unsigned long long)
MT_MINMAX(unsigned long long, unsigned long long, long long)
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(float a, double b) { return fmin((double)a, b); }
static inline double max(float a, double b) { return fmax((double)a, b); }
static inline double min(double a, float b) { return fmin(a, (double)b); }
static inline double max(double a, float b) { return fmax(a, (double)b); }

// --- integer intrinsics ------------------------------------------------------------------------
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
    return (x >> 16) | (x << 16);
}
static inline unsigned long long __brevll(unsigned long long x) {
    return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
static inline int __mul24(int a, int b) { return (int)((long long)((a << 8) >> 8) * ((b << 8) >> 8)); }
static inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline unsigned __sad(int a, int b, unsigned c) { return c + (unsigned)(a > b ? a - b : b - a); }
static inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return c + (a > b ? a - b : b - a); }
static inline int __hadd(int a, int b) { return (int)(((long long)a + b) >> 1); }
static inline int __rhadd(int a, int b) { return (int)(((long long)a + b + 1) >> 1); }
static inline unsigned __uhadd(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a + b) >> 1); }
static inline unsigned __urhadd(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a + b + 1) >> 1); }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)((v << (s & 31)) >> 32);
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> (s & 31));
}
// __dp4a: four 8-bit products summed into a 32-bit accumulator (sm_61+), the int8 GEMM primitive.
static inline int __dp4a(int a, int b, int c) {
    int r = c;
    for (int i = 0; i < 4; ++i) r += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return r;
}
static inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    unsigned r = c;
    for (int i = 0; i < 4; ++i) r += ((a >> (8 * i)) & 0xFFu) * ((b >> (8 * i)) & 0xFFu);
    return r;
}
static inline int __dp4a(char4 a, char4 b, int c) {
    return c + a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
static inline unsigned __dp4a(uchar4 a, uchar4 b, unsigned c) {
    return c + a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
// __dp2a: two 16-bit values of a times two 8-bit values of b (the low or high half of b).
static inline int __dp2a_lo(int a, int b, int c) {
    return c + (short)(a & 0xFFFF) * (signed char)(b & 0xFF) + (short)(a >> 16) * (signed char)((b >> 8) & 0xFF);
}
static inline int __dp2a_hi(int a, int b, int c) {
    return c + (short)(a & 0xFFFF) * (signed char)((b >> 16) & 0xFF) + (short)(a >> 16) * (signed char)(b >> 24);
}

// --- loads and stores with cache hints: plain accesses here --------------------------------------
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline T __ldcv(const T* p) { return *p; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stwb(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }

// --- vector pointer casts: a misaligned float4 (etc.) access faults on a GPU -------------------
// course/cuda_c.py rewrites reinterpret_cast<float4*>(p) and (float4*)p into mt::vec_ptr<float4>(p),
// which checks the alignment where the cast is made and then behaves like the pointer.
namespace mt {
template <class V> struct vec_ptr {
    V* p;
    template <class Q>
    vec_ptr(Q* q, MT_SITE) : p((V*)q) { check_vector_access((const volatile void*)q, alignof(V), nullptr, MT_SITE_ARGS); }
    vec_ptr(decltype(nullptr)) : p(nullptr) {}
    operator V*() const { return p; }
    V* operator->() const { return p; }
    V& operator*() const { return *p; }
    V& operator[](long long i) const { return p[i]; }
    V* operator+(long long i) const { return p + i; }
    V* operator-(long long i) const { return p - i; }
};
// reinterpret_cast<float4*>(p) becomes vec_cast<float4>(p): a call, so `vec_cast<float4>(y)[i] = v;`
// cannot be read as a declaration.
template <class V, class Q> static inline vec_ptr<V> vec_cast(Q* q, MT_SITE) { return vec_ptr<V>(q, MT_SITE_ARGS); }
template <class V> static inline vec_ptr<V> vec_cast(decltype(nullptr)) { return vec_ptr<V>(nullptr); }
}  // namespace mt

// --- atomics: one fiber runs at a time, so a read-modify-write is atomic; the access is reported
// to the runtime (bounds, and the race check treats atomics as not racing with each other) -------
#define MT_ATOMIC(NAME, T, EXPR)                                                   \
    MT_NOSAN static inline T NAME(T* p, T v, MT_SITE) {                            \
        mt::atomic_access(p, sizeof(T), std::is_floating_point<T>::value, MT_SITE_ARGS);                             \
        T old = *p;                                                                \
        *p = (EXPR);                                                               \
        return old;                                                                \
    }
#define MT_ATOMIC_VARIANTS(NAME, T, EXPR) MT_ATOMIC(NAME, T, EXPR) MT_ATOMIC(NAME##_block, T, EXPR) \
    MT_ATOMIC(NAME##_system, T, EXPR)
#define MT_ATOMIC_ARITH(T) MT_ATOMIC_VARIANTS(atomicAdd, T, old + v) MT_ATOMIC_VARIANTS(atomicExch, T, v)
MT_ATOMIC_ARITH(int)
MT_ATOMIC_ARITH(unsigned int)
MT_ATOMIC_ARITH(unsigned long long)
MT_ATOMIC_ARITH(float)
MT_ATOMIC_ARITH(double)
MT_ATOMIC_VARIANTS(atomicAdd, long long, old + v)
#define MT_ATOMIC_INT(T) MT_ATOMIC_VARIANTS(atomicMin, T, old < v ? old : v) \
    MT_ATOMIC_VARIANTS(atomicMax, T, old > v ? old : v) MT_ATOMIC_VARIANTS(atomicAnd, T, old & v) \
    MT_ATOMIC_VARIANTS(atomicOr, T, old | v) MT_ATOMIC_VARIANTS(atomicXor, T, old ^ v)
MT_ATOMIC_INT(int)
MT_ATOMIC_INT(unsigned int)
MT_ATOMIC_INT(long long)
MT_ATOMIC_INT(unsigned long long)
MT_ATOMIC_VARIANTS(atomicSub, int, old - v)
MT_ATOMIC_VARIANTS(atomicSub, unsigned int, old - v)
MT_ATOMIC_VARIANTS(atomicInc, unsigned int, old >= v ? 0u : old + 1u)
MT_ATOMIC_VARIANTS(atomicDec, unsigned int, (old == 0u || old > v) ? v : old - 1u)
MT_ATOMIC(atomicMax, float, old > v ? old : v)
MT_ATOMIC(atomicMin, float, old < v ? old : v)
#define MT_ATOMIC_CAS(NAME, T)                                                      \
    MT_NOSAN static inline T NAME(T* p, T cmp, T v, MT_SITE) {                     \
        mt::atomic_access(p, sizeof(T), std::is_floating_point<T>::value, MT_SITE_ARGS);                             \
        T old = *p;                                                                \
        if (old == cmp) *p = v;                                                    \
        return old;                                                                \
    }
MT_ATOMIC_CAS(atomicCAS, int)
MT_ATOMIC_CAS(atomicCAS, unsigned int)
MT_ATOMIC_CAS(atomicCAS, unsigned long long)
MT_ATOMIC_CAS(atomicCAS, unsigned short)
MT_ATOMIC_CAS(atomicCAS_block, int)
MT_ATOMIC_CAS(atomicCAS_block, unsigned int)
MT_ATOMIC_CAS(atomicCAS_block, unsigned long long)

// --- barriers, fences, clocks --------------------------------------------------------------------
static inline void __syncthreads(MT_SITE) { mt::barrier(mt::BAR_SYNC, 1, MT_SITE_ARGS); }
static inline int __syncthreads_count(int pred, MT_SITE) { return mt::barrier(mt::BAR_COUNT, pred, MT_SITE_ARGS); }
static inline int __syncthreads_and(int pred, MT_SITE) { return mt::barrier(mt::BAR_AND, pred, MT_SITE_ARGS); }
static inline int __syncthreads_or(int pred, MT_SITE) { return mt::barrier(mt::BAR_OR, pred, MT_SITE_ARGS); }
static inline void __threadfence() {}
static inline void __threadfence_block() {}
static inline void __threadfence_system() {}
static inline long long clock64() { return mt::clock_tick(); }
static inline long long __clock64() { return mt::clock_tick(); }
static inline void __nanosleep(unsigned) {}
[[noreturn]] static inline void __trap(MT_SITE) { mt::kernel_trap("__trap()", MT_SITE_ARGS); }
[[noreturn]] static inline void __brkpt(MT_SITE) { mt::kernel_trap("__brkpt()", MT_SITE_ARGS); }
#define __builtin_assume(x) ((void)0)
#define __assume(x) ((void)0)

// --- warp-level primitives -------------------------------------------------------------------------
// Each is a collective of the lanes named in `mask` (the calling lane must be among them); lanes
// outside the mask may be anywhere (at a barrier, exited). Reading a lane outside the mask (or one
// that has exited) is reported: on a GPU its value is undefined.
namespace mt {
template <class T> static inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes per lane");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> static inline T from_bits(unsigned long long b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
static inline int seg_lane(int l, int width, int s) { return l / width * width + s; }
}  // namespace mt

template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32, MT_SITE) {
    int l = mt::lane();
    int s = mt::seg_lane(l, width, ((src % width) + width) % width);
    return mt::from_bits<T>(mt::collective(mt::SHFL, mask, mt::to_bits(v), s, MT_SITE_ARGS));
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, MT_SITE) {
    int l = mt::lane(), s = l ^ lane_mask;
    return mt::from_bits<T>(mt::collective(mt::SHFL, mask, mt::to_bits(v), s / width == l / width ? s : l, MT_SITE_ARGS));
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, MT_SITE) {
    int l = mt::lane(), s = l + (int)delta;
    return mt::from_bits<T>(mt::collective(mt::SHFL, mask, mt::to_bits(v), s / width == l / width ? s : l, MT_SITE_ARGS));
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, MT_SITE) {
    int l = mt::lane(), s = l - (int)delta;
    return mt::from_bits<T>(mt::collective(mt::SHFL, mask, mt::to_bits(v), s >= 0 && s / width == l / width ? s : l,
                                           MT_SITE_ARGS));
}
static inline void __syncwarp(unsigned mask = 0xffffffffu, MT_SITE) { mt::collective(mt::SYNCWARP, mask, 0, -1, MT_SITE_ARGS); }
static inline unsigned __ballot_sync(unsigned mask, int pred, MT_SITE) {
    return (unsigned)mt::collective(mt::BALLOT, mask, pred != 0, -1, MT_SITE_ARGS);
}
static inline int __any_sync(unsigned mask, int pred, MT_SITE) { return (int)mt::collective(mt::ANY, mask, pred != 0, -1, MT_SITE_ARGS); }
static inline int __all_sync(unsigned mask, int pred, MT_SITE) { return (int)mt::collective(mt::ALL, mask, pred != 0, -1, MT_SITE_ARGS); }
static inline unsigned __activemask(MT_SITE) { return (unsigned)mt::collective(mt::ACTIVEMASK, 0, 0, -1, MT_SITE_ARGS); }
static inline unsigned __reduce_add_sync(unsigned mask, unsigned v, MT_SITE) { return (unsigned)mt::collective(mt::RED_ADD, mask, v, -1, MT_SITE_ARGS); }
static inline int __reduce_add_sync(unsigned mask, int v, MT_SITE) { return (int)mt::collective(mt::RED_ADD, mask, (unsigned)v, -1, MT_SITE_ARGS); }
static inline unsigned __reduce_min_sync(unsigned mask, unsigned v, MT_SITE) { return (unsigned)mt::collective(mt::RED_UMIN, mask, v, -1, MT_SITE_ARGS); }
static inline int __reduce_min_sync(unsigned mask, int v, MT_SITE) { return (int)mt::collective(mt::RED_MIN, mask, (unsigned)v, -1, MT_SITE_ARGS); }
static inline unsigned __reduce_max_sync(unsigned mask, unsigned v, MT_SITE) { return (unsigned)mt::collective(mt::RED_UMAX, mask, v, -1, MT_SITE_ARGS); }
static inline int __reduce_max_sync(unsigned mask, int v, MT_SITE) { return (int)mt::collective(mt::RED_MAX, mask, (unsigned)v, -1, MT_SITE_ARGS); }
static inline unsigned __reduce_and_sync(unsigned mask, unsigned v, MT_SITE) { return (unsigned)mt::collective(mt::RED_AND, mask, v, -1, MT_SITE_ARGS); }
static inline unsigned __reduce_or_sync(unsigned mask, unsigned v, MT_SITE) { return (unsigned)mt::collective(mt::RED_OR, mask, v, -1, MT_SITE_ARGS); }
static inline unsigned __reduce_xor_sync(unsigned mask, unsigned v, MT_SITE) { return (unsigned)mt::collective(mt::RED_XOR, mask, v, -1, MT_SITE_ARGS); }
template <class T> static inline unsigned __match_any_sync(unsigned mask, T v, MT_SITE) {
    return (unsigned)mt::collective(mt::MATCH_ANY, mask, mt::to_bits(v), -1, MT_SITE_ARGS);
}
template <class T> static inline unsigned __match_all_sync(unsigned mask, T v, int* pred, MT_SITE) {
    unsigned r = (unsigned)mt::collective(mt::MATCH_ALL, mask, mt::to_bits(v), -1, MT_SITE_ARGS);
    *pred = r != 0;
    return r;
}
