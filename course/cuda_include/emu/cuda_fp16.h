// The CPU emulator's __half: IEEE binary16 storage; each operation is computed exactly (in double)
// and rounded to half, to nearest even, as a GPU's half-precision unit does for add, sub and mul.
#pragma once
#include <cmath>
#include <cstring>

namespace mt {
static inline unsigned short d2h(double d) {
    unsigned short sign = std::signbit(d) ? 0x8000 : 0;
    double a = std::fabs(d);
    if (std::isnan(d)) return sign | 0x7e00;
    if (a >= 65520.0) return sign | 0x7c00;  // rounds to infinity
    if (a < 6.103515625e-05) {               // below 2^-14: subnormal (or rounds up to the smallest normal)
        double q = std::nearbyint(std::ldexp(a, 24));
        return sign | (unsigned short)q;
    }
    int e;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    double q = std::nearbyint(std::ldexp(a, 11 - e));  // in [1024, 2048]
    if (q >= 2048) q /= 2, e += 1;
    return sign | (unsigned short)(((e - 1 + 15) << 10) | ((unsigned)q - 1024));
}
static inline float h2f(unsigned short h) {
    unsigned e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : (e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m + 1024), (int)e - 25));
    return (h & 0x8000) ? -v : v;
}
}  // namespace mt

struct __half_raw { unsigned short x; };
struct __half {
    unsigned short __x;
    __half() = default;
    __half(const __half_raw& r) : __x(r.x) {}
    __half(float f) : __x(mt::d2h(f)) {}
    __half(double d) : __x(mt::d2h(d)) {}
    __half(int i) : __x(mt::d2h(i)) {}
    __half(unsigned i) : __x(mt::d2h(i)) {}
    __half(short i) : __x(mt::d2h(i)) {}
    __half(unsigned short i) : __x(mt::d2h(i)) {}
    __half(long long i) : __x(mt::d2h((double)i)) {}
    __half(unsigned long long i) : __x(mt::d2h((double)i)) {}
    operator float() const { return mt::h2f(__x); }
    operator __half_raw() const { return {__x}; }
};
typedef __half half;
struct __attribute__((aligned(4))) __half2 {
    __half x, y;
    __half2() = default;
    __half2(__half a, __half b) : x(a), y(b) {}
};
typedef __half2 half2;
struct __half2_raw { unsigned short x, y; };

static inline __half mt_h(double d) { __half_raw r{mt::d2h(d)}; return __half(r); }
static inline double mt_d(__half h) { return (double)mt::h2f(h.__x); }

static inline __half __float2half(float f) { return mt_h(f); }
static inline __half __float2half_rn(float f) { return mt_h(f); }
static inline __half __float2half_rz(float f) {  // toward zero: one step back if rounding went outward
    __half r = mt_h(f);
    if (std::isfinite(f) && std::fabs(mt_d(r)) > std::fabs((double)f)) r.__x -= 1;
    return r;
}
static inline __half __double2half(double d) { return mt_h(d); }
static inline float __half2float(__half h) { return (float)mt_d(h); }
static inline __half __int2half_rn(int i) { return mt_h(i); }
static inline __half __uint2half_rn(unsigned i) { return mt_h(i); }
static inline __half __short2half_rn(short i) { return mt_h(i); }
static inline int __half2int_rn(__half h) { return (int)std::nearbyint(mt_d(h)); }
static inline int __half2int_rz(__half h) { return (int)mt_d(h); }
static inline short __half_as_short(__half h) { short s; memcpy(&s, &h, 2); return s; }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __short_as_half(short s) { __half h; memcpy(&h, &s, 2); return h; }
static inline __half __ushort_as_half(unsigned short s) { __half_raw r{s}; return __half(r); }

static inline __half __hadd(__half a, __half b) { return mt_h(mt_d(a) + mt_d(b)); }
static inline __half __hsub(__half a, __half b) { return mt_h(mt_d(a) - mt_d(b)); }
static inline __half __hmul(__half a, __half b) { return mt_h(mt_d(a) * mt_d(b)); }
static inline __half __hdiv(__half a, __half b) { return mt_h(mt_d(a) / mt_d(b)); }
static inline __half __hfma(__half a, __half b, __half c) { return mt_h(std::fma(mt_d(a), mt_d(b), mt_d(c))); }
static inline __half __hneg(__half a) { __half_raw r{(unsigned short)(a.__x ^ 0x8000)}; return __half(r); }
static inline __half __habs(__half a) { __half_raw r{(unsigned short)(a.__x & 0x7fff)}; return __half(r); }
static inline __half __hmax(__half a, __half b) { return mt_h(std::fmax(mt_d(a), mt_d(b))); }
static inline __half __hmin(__half a, __half b) { return mt_h(std::fmin(mt_d(a), mt_d(b))); }
static inline __half __hmax_nan(__half a, __half b) { return std::isnan(mt_d(a)) || std::isnan(mt_d(b)) ? mt_h(NAN) : __hmax(a, b); }
static inline __half __hmin_nan(__half a, __half b) { return std::isnan(mt_d(a)) || std::isnan(mt_d(b)) ? mt_h(NAN) : __hmin(a, b); }
static inline bool __heq(__half a, __half b) { return mt_d(a) == mt_d(b); }
static inline bool __hne(__half a, __half b) { return mt_d(a) != mt_d(b) && !std::isnan(mt_d(a)) && !std::isnan(mt_d(b)); }
static inline bool __hlt(__half a, __half b) { return mt_d(a) < mt_d(b); }
static inline bool __hle(__half a, __half b) { return mt_d(a) <= mt_d(b); }
static inline bool __hgt(__half a, __half b) { return mt_d(a) > mt_d(b); }
static inline bool __hge(__half a, __half b) { return mt_d(a) >= mt_d(b); }
static inline bool __hisnan(__half a) { return std::isnan(mt_d(a)); }
static inline int __hisinf(__half a) { double d = mt_d(a); return std::isinf(d) ? (d > 0 ? 1 : -1) : 0; }
static inline __half hexp(__half a) { return mt_h(std::exp(mt_d(a))); }
static inline __half hexp2(__half a) { return mt_h(std::exp2(mt_d(a))); }
static inline __half hlog(__half a) { return mt_h(std::log(mt_d(a))); }
static inline __half hlog2(__half a) { return mt_h(std::log2(mt_d(a))); }
static inline __half hsqrt(__half a) { return mt_h(std::sqrt(mt_d(a))); }
static inline __half hrsqrt(__half a) { return mt_h(1.0 / std::sqrt(mt_d(a))); }
static inline __half hrcp(__half a) { return mt_h(1.0 / mt_d(a)); }
static inline __half hsin(__half a) { return mt_h(std::sin(mt_d(a))); }
static inline __half hcos(__half a) { return mt_h(std::cos(mt_d(a))); }
static inline __half htanh(__half a) { return mt_h(std::tanh(mt_d(a))); }
static inline __half hfloor(__half a) { return mt_h(std::floor(mt_d(a))); }
static inline __half hceil(__half a) { return mt_h(std::ceil(mt_d(a))); }
static inline __half htrunc(__half a) { return mt_h(std::trunc(mt_d(a))); }
static inline __half hrint(__half a) { return mt_h(std::nearbyint(mt_d(a))); }

static inline __half operator+(const __half& a, const __half& b) { return __hadd(a, b); }
static inline __half operator-(const __half& a, const __half& b) { return __hsub(a, b); }
static inline __half operator*(const __half& a, const __half& b) { return __hmul(a, b); }
static inline __half operator/(const __half& a, const __half& b) { return __hdiv(a, b); }
static inline __half operator-(const __half& a) { return __hneg(a); }
static inline __half operator+(const __half& a) { return a; }
static inline __half& operator+=(__half& a, const __half& b) { return a = __hadd(a, b); }
static inline __half& operator-=(__half& a, const __half& b) { return a = __hsub(a, b); }
static inline __half& operator*=(__half& a, const __half& b) { return a = __hmul(a, b); }
static inline __half& operator/=(__half& a, const __half& b) { return a = __hdiv(a, b); }
static inline bool operator==(const __half& a, const __half& b) { return __heq(a, b); }
static inline bool operator!=(const __half& a, const __half& b) { return !__heq(a, b); }
static inline bool operator<(const __half& a, const __half& b) { return __hlt(a, b); }
static inline bool operator<=(const __half& a, const __half& b) { return __hle(a, b); }
static inline bool operator>(const __half& a, const __half& b) { return __hgt(a, b); }
static inline bool operator>=(const __half& a, const __half& b) { return __hge(a, b); }

static inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
static inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
static inline __half2 __half2half2(__half a) { return __half2(a, a); }
static inline __half2 __floats2half2_rn(float a, float b) { return __half2(mt_h(a), mt_h(b)); }
static inline __half2 __float2half2_rn(float a) { return __half2(mt_h(a), mt_h(a)); }
static inline __half2 __float22half2_rn(float2 v) { return __half2(mt_h(v.x), mt_h(v.y)); }
static inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
static inline float __low2float(__half2 h) { return __half2float(h.x); }
static inline float __high2float(__half2 h) { return __half2float(h.y); }
static inline __half __low2half(__half2 h) { return h.x; }
static inline __half __high2half(__half2 h) { return h.y; }
static inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
static inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
static inline __half2 __hadd2(__half2 a, __half2 b) { return __half2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }
static inline __half2 __hsub2(__half2 a, __half2 b) { return __half2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }
static inline __half2 __hmul2(__half2 a, __half2 b) { return __half2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }
static inline __half2 __h2div(__half2 a, __half2 b) { return __half2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
static inline __half2 __hneg2(__half2 a) { return __half2(__hneg(a.x), __hneg(a.y)); }
static inline __half2 __habs2(__half2 a) { return __half2(__habs(a.x), __habs(a.y)); }
static inline __half2 __hmax2(__half2 a, __half2 b) { return __half2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }
static inline __half2 __hmin2(__half2 a, __half2 b) { return __half2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }
static inline __half2 operator+(const __half2& a, const __half2& b) { return __hadd2(a, b); }
static inline __half2 operator-(const __half2& a, const __half2& b) { return __hsub2(a, b); }
static inline __half2 operator*(const __half2& a, const __half2& b) { return __hmul2(a, b); }
static inline __half2 operator/(const __half2& a, const __half2& b) { return __h2div(a, b); }
static inline __half2& operator+=(__half2& a, const __half2& b) { return a = __hadd2(a, b); }
static inline __half2& operator*=(__half2& a, const __half2& b) { return a = __hmul2(a, b); }
MT_ATOMIC_VARIANTS(atomicAdd, __half, old + v)
MT_ATOMIC_VARIANTS(atomicAdd, __half2, old + v)
