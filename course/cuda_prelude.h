// CPU emulation of the CUDA C subset lesson 08 uses. Included before the student's kernel.
//
// Each block runs on the CPU one at a time; each of its threads is a fiber (ucontext) with its
// own stack. Warps run in order, each as far as it can go (its threads in lane order, through
// warp barriers) until it waits at __syncthreads(), so execution is deterministic and early
// threads run ahead of late ones. A missing __syncthreads() then reads shared memory another
// thread has not written yet (shared memory is filled with NaN bytes before each block), or
// overwrites what a later thread still needs, and gives the same wrong answer every run. Warp shuffles exchange values through a buffer between two warp barriers.
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static const int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __noinline__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ __attribute__((section("mt_shared"))) static
#define __constant__ static

#define __expf expf  // glibc declares its own __expf/__logf; the fast CUDA intrinsics map to the precise ones
#define __logf logf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
static inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
static inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
static inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
// Only one fiber runs at a time, so atomics are plain read-modify-writes.
template <class T> static inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> static inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T> static inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T> static inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> static inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }

// The section that every __shared__ variable lands in; filled with 0xFF (NaN) before each block.
__attribute__((section("mt_shared"))) static volatile char mt_shared_anchor[16];
extern "C" char __start_mt_shared[], __stop_mt_shared[];

namespace mt {
enum State { RUNNING, AT_SYNCTHREADS, AT_WARP, DONE };
struct Fiber { ucontext_t ctx; State state; uint3 tid; };
static std::vector<Fiber> fibers;
static std::vector<char*> stacks;
static const size_t STACK = 256 * 1024;
static ucontext_t scheduler;
static int current = -1;
static std::function<void()> body;
static unsigned long long exchange[1024];

// Report an error on one "MT-ERROR: ..." line (Python shows it) and end the process.
__attribute__((format(printf, 1, 2))) static void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "MT-ERROR: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stdout);
    _exit(3);
}

static void fiber_main() {
    body();
    fibers[current].state = DONE;  // returning switches to uc_link (the scheduler)
}

static void wait(State s) {
    fibers[current].state = s;
    swapcontext(&fibers[current].ctx, &scheduler);
}

static int lane() { return current % 32; }

// --- argument arrays, with guard pages after the end --------------------------------------
struct Array { const char* name; char* data; size_t nbytes; char* map; size_t maplen; size_t slack; };
static std::vector<Array> arrays;
static const size_t PAGE = 4096;
static const size_t HEAD = 4096;  // 0xFF bytes before the data (reads there give NaN)

static char* alloc_array(const char* name, size_t nbytes) {
    size_t padded = (nbytes + 15) / 16 * 16;
    size_t data_pages = (HEAD + padded + PAGE - 1) / PAGE;
    size_t maplen = (data_pages + 1) * PAGE;  // + one inaccessible page after the end
    char* map = (char*)mmap(nullptr, maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) fail("out of memory allocating argument %s", name);
    mprotect(map + data_pages * PAGE, PAGE, PROT_NONE);
    char* data = map + data_pages * PAGE - padded;
    memset(map, 0xFF, data_pages * PAGE);
    arrays.push_back({name, data, nbytes, map, maplen, padded - nbytes});
    return data;
}

static void describe_address(const char* what, char* addr) {
    for (auto& a : arrays) {
        if (addr >= a.map && addr < a.map + a.maplen) {
            long long off = addr - a.data;
            if (off >= (long long)a.nbytes)
                fprintf(stderr, "MT-ERROR: %s byte %lld past the end of argument '%s' (%zu bytes)", what,
                        off - (long long)a.nbytes, a.name, a.nbytes);
            else if (off < 0)
                fprintf(stderr, "MT-ERROR: %s byte %lld before the start of argument '%s'", what, -off, a.name);
            else
                fprintf(stderr, "MT-ERROR: %s inside argument '%s' (byte %lld) but the memory was unusable", what,
                        a.name, off);
            return;
        }
    }
    fprintf(stderr, "MT-ERROR: %s address %p, which is not inside any argument array", what, (void*)addr);
}

static void on_segv(int, siginfo_t* info, void*) {
    describe_address("invalid memory access at", (char*)info->si_addr);
    if (current >= 0)
        fprintf(stderr, " by thread (%u,%u,%u) of block (%u,%u,%u)\n", threadIdx.x, threadIdx.y, threadIdx.z,
                blockIdx.x, blockIdx.y, blockIdx.z);
    else
        fprintf(stderr, "\n");
    fflush(stdout);
    _exit(4);
}

static void check_guards() {
    for (auto& a : arrays) {
        for (char* p = a.map; p < a.data; ++p)
            if ((unsigned char)*p != 0xFF) {
                fail("the kernel wrote %lld bytes before the start of argument '%s'", (long long)(a.data - p), a.name);
            }
        for (size_t i = 0; i < a.slack; ++i)
            if ((unsigned char)a.data[a.nbytes + i] != 0xFF) {
                fail("the kernel wrote past the end of argument '%s' (byte %zu after it)", a.name, i);
            }
    }
}

// --- the launch ------------------------------------------------------------------------------
static void launch(dim3 grid, dim3 block, std::function<void()> kernel) {
    size_t n = (size_t)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || block.z > 64)
        fail("invalid block size: %zu threads, z = %u (CUDA allows 1..1024 threads, z <= 64)", n, block.z);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
        fail("invalid grid (%u, %u, %u): each dimension must be >= 1, y and z <= 65535", grid.x, grid.y, grid.z);
    static char altstack[1 << 16];
    stack_t ss{};
    ss.ss_sp = altstack; ss.ss_size = sizeof altstack;
    sigaltstack(&ss, nullptr);
    struct sigaction sa{};
    sa.sa_sigaction = on_segv; sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);

    body = kernel;
    gridDim = grid; blockDim = block;
    fibers.assign(n, Fiber{});
    while (stacks.size() < n) stacks.push_back((char*)malloc(STACK));
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        memset(__start_mt_shared, 0xFF, __stop_mt_shared - __start_mt_shared);
        for (size_t i = 0; i < n; ++i) {
            Fiber& f = fibers[i];
            f.tid = {unsigned(i % block.x), unsigned(i / block.x % block.y), unsigned(i / (block.x * block.y))};
            f.state = RUNNING;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks[i];
            f.ctx.uc_stack.ss_size = STACK;
            f.ctx.uc_link = &scheduler;
            makecontext(&f.ctx, fiber_main, 0);
        }
        for (;;) {
            // Each warp runs as far as it can (through its own warp barriers) before the next
            // warp starts: earlier threads run ahead, which exposes missing __syncthreads().
            for (size_t w = 0; w < n; w += 32) {
                size_t end = w + 32 < n ? w + 32 : n;
                for (;;) {
                    for (size_t i = w; i < end; ++i) {
                        if (fibers[i].state != RUNNING) continue;
                        current = int(i);
                        threadIdx = fibers[i].tid;
                        swapcontext(&scheduler, &fibers[i].ctx);
                        current = -1;
                    }
                    size_t live = 0, waiting = 0;
                    for (size_t i = w; i < end; ++i)
                        live += fibers[i].state != DONE, waiting += fibers[i].state == AT_WARP;
                    if (!live || waiting != live) break;
                    for (size_t i = w; i < end; ++i) fibers[i].state = fibers[i].state == AT_WARP ? RUNNING : fibers[i].state;
                }
            }
            size_t done = 0, at_sync = 0, at_warp = 0;
            for (auto& f : fibers) done += f.state == DONE, at_sync += f.state == AT_SYNCTHREADS, at_warp += f.state == AT_WARP;
            if (done == n) break;
            if (at_sync == n - done) {  // every live thread is at __syncthreads (exited ones count as arrived)
                for (auto& f : fibers)
                    if (f.state == AT_SYNCTHREADS) f.state = RUNNING;
                continue;
            }
            fail("deadlock in block (%u,%u,%u): %zu threads wait at __syncthreads() while %zu wait at a warp "
                 "operation (__shfl_*_sync/__syncwarp) whose warp cannot complete it; every thread of a block must "
                 "reach the same barriers", bx, by, bz, at_sync, at_warp);
        }
    }
    check_guards();
}
}  // namespace mt

static inline void __syncthreads() { mt::wait(mt::AT_SYNCTHREADS); }
static inline void __syncwarp(unsigned = 0xffffffffu) { mt::wait(mt::AT_WARP); }
static inline unsigned __activemask() { return 0xffffffffu; }
static inline void __threadfence() {}
static inline void __threadfence_block() {}

namespace mt {
template <class T> static T shuffle(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    memcpy(&exchange[current], &v, sizeof(T));
    wait(AT_WARP);
    int src = current - lane() + src_lane;
    T r = v;
    if (src >= 0 && src < (int)fibers.size()) memcpy(&r, &exchange[src], sizeof(T));
    wait(AT_WARP);  // nobody overwrites the buffer before everyone has read it
    return r;
}
}  // namespace mt

template <class T> static inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    int l = mt::lane();
    return mt::shuffle(v, l / width * width + ((src % width) + width) % width);
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    int l = mt::lane(), s = l ^ mask;
    return mt::shuffle(v, s / width == l / width ? s : l);
}
template <class T> static inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    int l = mt::lane(), s = l + (int)delta;
    return mt::shuffle(v, s / width == l / width ? s : l);
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    int l = mt::lane(), s = l - (int)delta;
    return mt::shuffle(v, s >= 0 && s / width == l / width ? s : l);
}

// --- reading and writing the arguments --------------------------------------------------------
namespace mt {
static FILE* in;
static void read_exact(void* p, size_t n) {
    if (fread(p, 1, n, in) != n) fail("truncated argument file (wanted %zu more bytes)", n);
}
static dim3 read_dim3() { unsigned v[3]; read_exact(v, sizeof v); return dim3(v[0], v[1], v[2]); }
template <class T> static T read_scalar() { T v; read_exact(&v, sizeof v); return v; }
static void* read_array(const char* name) {
    unsigned long long n; read_exact(&n, sizeof n);
    char* p = alloc_array(name, n);
    read_exact(p, n);
    return p;
}
static void write_arrays(const char* path) {
    FILE* out = fopen(path, "wb");
    for (auto& a : arrays) fwrite(a.data, 1, a.nbytes, out);
    fclose(out);
}
}  // namespace mt
