// The CUDA emulator's runtime: fibers, the schedules, warp collectives, barriers, argument arrays,
// shared memory, and the memory-access hooks (bounds, alignment, shared-memory race check).
// Compiled once per compiler (course/cuda_c.py caches the object) WITHOUT instrumentation, and
// linked with each kernel, which is compiled with -fsanitize=thread so that its loads and stores
// call the __tsan_* hooks below. See cuda_prelude.h for the model.
#include "cuda_prelude.h"

#include <algorithm>
#include <csignal>
#include <cstdarg>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

// Shared memory: [red 64][dynamic shared memory, up to DYN_MAX][red 64][static __shared__ variables,
// each followed by a red zone at least its own size]. Accesses to a red zone are out of bounds.
static const unsigned long long RED = 64;
static const unsigned long long DYN_MAX = 227 * 1024;  // H100/H200: up to 227 KB per block (opt-in)
static const unsigned long long STATIC_LO = RED + DYN_MAX + RED;
static const unsigned long long STATIC_MAX = 48 * 1024;  // CUDA's limit for static __shared__ data
static const unsigned long long ARENA_SIZE = STATIC_LO + 4 * STATIC_MAX + 64 * 1024;
extern "C" {
alignas(4096) char mt_arena[ARENA_SIZE];
extern char __executable_start[], _end[];
extern char __start_mt_shared[] __attribute__((weak)), __stop_mt_shared[] __attribute__((weak));
void mt_launch_kernel(void** args);  // generated with the kernel: calls it with the arguments
int mt_nargs = 0;                    // how many arguments the launch gives (trailing defaults omitted)
}

namespace mt {
// ------------------------------------------------------------------------------------------------
// Errors
static char msgbuf[4096];
static void describe_thread(char* out, size_t n);
static std::string site(unsigned long long s);

static std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char* f, ...) {
    va_list ap;
    va_start(ap, f);
    vsnprintf(msgbuf, sizeof msgbuf, f, ap);
    va_end(ap);
    return msgbuf;
}

// Report an error on one "MT-ERROR: ..." line (Python shows it) and end the process.
[[noreturn]] static void fail_str(const std::string& m) {
    fflush(stdout);
    fprintf(stderr, "MT-ERROR: %s\n", m.c_str());
    fflush(stderr);
    _exit(3);
}
#define FAIL(...) fail_str(fmt(__VA_ARGS__))

// ------------------------------------------------------------------------------------------------
// Fibers and the schedule
enum State { RUNNING, AT_BARRIER, AT_WARP, DONE };
struct Req {
    int op;
    unsigned mask;
    unsigned long long value;
    int src;
    int line;
    const char* file;
    unsigned long long result;
};
struct Fiber {
    ucontext_t ctx;
    State state;
    uint3 tid;
    Req req;
};
static std::vector<Fiber> fibers;
static std::vector<char*> stacks;
static const size_t STACK = 256 * 1024, GUARD = 4096;
static ucontext_t scheduler;
static int current = -1;
static char *stack_lo = nullptr, *stack_hi = nullptr;
static void** kernel_args;
static int nthreads = 0, nwarps = 0;
static unsigned long long block_linear = 0;

enum Schedule { FORWARD = 0, REVERSE = 1, SHUFFLE = 2 };
static const char* SCHEDULE_NAMES[] = {"forward", "reverse", "shuffle"};
static int schedule = FORWARD;
static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;
static unsigned rnd(unsigned n) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (unsigned)(rng_state % n);
}
static void order(std::vector<int>& v, int n) {
    v.resize(n);
    for (int i = 0; i < n; ++i) v[i] = schedule == REVERSE ? n - 1 - i : i;
    if (schedule == SHUFFLE)
        for (int i = n - 1; i > 0; --i) std::swap(v[i], v[rnd(i + 1)]);
}

// Race-check clocks: B counts barrier intervals (a new one at every block start and barrier);
// G[w] counts completed warp collectives of warp w. An access recorded as (thread u, B', G') is
// ordered before an access by thread t iff u == t, or B' < B, or u and t share a warp and a warp
// collective completed since (G' < G[w]).
static unsigned B = 1;
static unsigned G[32];
static unsigned block_gen = 0;
static bool racecheck = true, profile = false;

static void fiber_main() {
    mt_launch_kernel(kernel_args);
    fibers[current].state = DONE;  // returning switches to uc_link (the scheduler)
}

static void switch_to(int i) {
    current = i;
    threadIdx = fibers[i].tid;
    stack_lo = stacks[i] + GUARD;
    stack_hi = stacks[i] + GUARD + STACK;
    swapcontext(&scheduler, &fibers[i].ctx);
    current = -1;
}

static void wait(State s) {
    fibers[current].state = s;
    swapcontext(&fibers[current].ctx, &scheduler);
}

int lane() { return current % 32; }
static unsigned long long blocks_run = 0;  // blocks started in this process (every schedule's)
unsigned long long block_serial() { return blocks_run; }
static long long clock_counter = 0;
long long clock_tick() { return clock_counter += 16; }

static void describe_thread(char* out, size_t n) {
    if (current < 0) {
        snprintf(out, n, "block (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z);
        return;
    }
    uint3 t = fibers[current].tid;
    snprintf(out, n, "thread (%u,%u,%u) of block (%u,%u,%u)", t.x, t.y, t.z, blockIdx.x, blockIdx.y, blockIdx.z);
}
static std::string thread_name(int i) {
    uint3 t = fibers[i].tid;
    return fmt("thread (%u,%u,%u)", t.x, t.y, t.z);
}
static std::string me() {
    char b[128];
    describe_thread(b, sizeof b);
    return b;
}

// Sites: a program counter (resolved to kernel.cu:LINE by course/cuda_c.py) or a file:line pair.
static std::vector<const char*> files;
static unsigned long long line_site(int line, const char* file) {
    unsigned i = 0;
    while (i < files.size() && files[i] != file) ++i;
    if (i == files.size()) files.push_back(file);
    return (1ull << 63) | ((unsigned long long)i << 32) | (unsigned)line;
}
static unsigned long long pc_site(void* pc) { return (unsigned long long)(uintptr_t)pc; }
static std::string site(unsigned long long s) {
    if (s >> 63) {
        const char* f = files[(s >> 32) & 0x7fffffff];
        const char* base = strrchr(f, '/');
        return fmt("%s:%u", base ? base + 1 : f, (unsigned)s);
    }
    return fmt("@pc:%llx@", s - 1);  // the return address points after the call: look up the call
}
static std::string site_of(const Req& r) { return site(line_site(r.line, r.file)); }

[[noreturn]] void kernel_trap(const char* what, int line, const char* file) {
    FAIL("%s called %s at %s", me().c_str(), what, site(line_site(line, file)).c_str());
}

// ------------------------------------------------------------------------------------------------
// Argument arrays: data at the end of a mapping, 4 KiB of 0xFF before it, an inaccessible page after.
struct Array {
    std::string name, type;
    char *data, *map, *map_end;
    size_t nbytes, elem;
    char* pristine;
    unsigned long long reads = 0, writes = 0;
    bool float_atomics = false;
    std::vector<unsigned> thread_reads, thread_writes;
    std::vector<int> writer;  // profile: the global thread id that last wrote each element, -1 if none
};
static std::vector<Array> arrays;
static const size_t PAGE = 4096, HEAD = 4096;

static std::string element(const Array& a, long long off) {
    if (off % (long long)a.elem == 0) return fmt("%s[%lld]", a.name.c_str(), off / (long long)a.elem);
    return fmt("byte %lld of %s", off, a.name.c_str());
}

static char* alloc_array(const std::string& name, const std::string& type, size_t nbytes, size_t elem) {
    size_t data_pages = (HEAD + nbytes + PAGE - 1) / PAGE;
    size_t maplen = (data_pages + 1) * PAGE;
    char* map = (char*)mmap(nullptr, maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) FAIL("out of memory allocating argument %s", name.c_str());
    mprotect(map + data_pages * PAGE, PAGE, PROT_NONE);
    char* data = map + data_pages * PAGE - nbytes;
    memset(map, 0xFF, data_pages * PAGE);
    Array a;
    a.name = name, a.type = type, a.data = data, a.map = map, a.map_end = map + maplen, a.nbytes = nbytes;
    a.elem = elem ? elem : 1, a.pristine = nullptr;
    arrays.push_back(a);
    return data;
}

// ------------------------------------------------------------------------------------------------
// Shared memory: the variables in the arena, and a shadow entry per byte for the race check.
struct SharedVar {
    unsigned long long lo, size, elem;
    std::string name, decl;
    int rank;
    unsigned long long dims[4];
};
static std::vector<SharedVar> shared_vars;
static unsigned long long static_top = STATIC_LO, static_bytes = 0, dyn_bytes = 0;
static bool dyn_used = false;

char* shared_alloc(unsigned long long size, unsigned long long align, const char* name, const char* decl,
                   unsigned long long elem, int rank, const unsigned long long* dims) {
    if (align < 16) align = 16;
    unsigned long long lo = (static_top + align - 1) / align * align;
    static_bytes += size;
    if (static_bytes > STATIC_MAX)
        FAIL("the kernel declares %llu bytes of static __shared__ memory (the last: %s); CUDA allows at most "
             "48 KB of static shared memory per block (use extern __shared__ and a launch size for more)",
             static_bytes, decl);
    SharedVar v{lo, size, elem ? elem : 1, name, decl, rank, {dims[0], dims[1], dims[2], dims[3]}};
    shared_vars.push_back(v);
    unsigned long long red = size < RED ? RED : (size + 15) / 16 * 16;
    static_top = lo + size + red;
    memset(mt_arena + lo, 0xFF, size);  // allocated inside a running block: NaN like the rest
    return mt_arena + lo;
}

static std::string shared_element(unsigned long long off, bool* oob) {
    *oob = false;
    if (off >= RED && off < RED + DYN_MAX) {
        unsigned long long o = off - RED;
        if (o >= dyn_bytes) {
            *oob = true;
            if (dyn_bytes == 0)
                return fmt("dynamic shared memory (extern __shared__) byte %llu, but the launch gave 0 bytes of dynamic "
                           "shared memory (pass shared_bytes=... to emulate())", o);
            return fmt("dynamic shared memory byte %llu, past the end of the %llu bytes given at launch", o, dyn_bytes);
        }
        return fmt("dynamic shared memory (extern __shared__) byte %llu", o);
    }
    const SharedVar* best = nullptr;
    for (auto& v : shared_vars)
        if (v.lo <= off && (!best || v.lo > best->lo)) best = &v;
    if (!best) {
        *oob = true;
        return fmt("shared memory before the first __shared__ variable (arena offset %llu)", off);
    }
    unsigned long long o = off - best->lo;
    unsigned long long idx = o / best->elem;
    std::string where;
    if (best->rank >= 2 && o < best->size) {
        unsigned long long rest = idx, stride = 1;
        for (int d = 1; d < best->rank; ++d) stride *= best->dims[d];
        where = best->name;
        for (int d = 0; d < best->rank; ++d) {
            where += fmt("[%llu]", rest / stride);
            rest %= stride;
            if (d + 1 < best->rank) stride /= best->dims[d + 1];
        }
    } else if (best->rank == 0 && o < best->elem) {
        where = best->name;
    } else {
        where = fmt("%s[%llu]", best->name.c_str(), idx);
    }
    if (o % best->elem) where += fmt(" (byte %llu)", o);
    if (o >= best->size) {
        *oob = true;
        return fmt("%s[%llu] (flat index), past the end of __shared__ %s (%llu elements)", best->name.c_str(), idx,
                   best->decl.c_str(), best->size / best->elem);
    }
    return where;
}

struct Shadow {
    unsigned gen;        // block generation of the last write (uninitialised-read detection)
    unsigned wB, wG;     // last write: interval, warp generation
    unsigned short wT;   // last writer
    unsigned char wAtomic;
    unsigned char multi; // readers in this interval come from more than one warp
    unsigned rB, rG, oG; // reads in interval rB: the latest reader's G, the max G of earlier readers
    unsigned short rT, oT, rWarp, mT, fT;  // latest reader, earlier reader, reader warp, other-warp reader, first
    unsigned long long wSite, rSite, oSite, mSite, fSite;
};
static Shadow* shadow_arena = nullptr;
static Shadow* shadow_section = nullptr;
static size_t section_size = 0;
static bool uninit_reported = false;
static std::string uninit_note;

static Shadow* make_shadow(size_t n) {
    void* p = mmap(nullptr, n * sizeof(Shadow), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) FAIL("out of memory for the shared-memory shadow");
    return (Shadow*)p;
}

static std::string shared_name(Shadow* base, size_t i, bool* oob) {
    if (base == shadow_arena) return shared_element(i, oob);
    *oob = false;
    return fmt("a __shared__ variable (byte %zu of the kernel's static shared memory)", i);
}

[[noreturn]] static void race(const char* what, Shadow* base, size_t i, int other, unsigned long long other_site,
                              const char* other_did, unsigned long long my_site) {
    bool oob;
    std::string var = shared_name(base, i, &oob);
    std::string other_name = thread_name(other);
    if (other / 32 == current / 32)
        other_name += " (same warp)";
    FAIL("race on shared memory in block (%u,%u,%u): %s %s %s at %s, which %s %s at %s in the same barrier "
         "interval; nothing orders the two accesses (a __syncthreads() between them is missing, or a __syncwarp() "
         "for threads of one warp)",
         blockIdx.x, blockIdx.y, blockIdx.z, thread_name(current).c_str(), what, var.c_str(), site(my_site).c_str(),
         other_name.c_str(), other_did, site(other_site).c_str());
}

static inline bool unordered(int u, unsigned uB, unsigned uG) {
    if (u == current || uB != B) return false;
    int w = current / 32;
    return u / 32 != w || uG == G[w];
}

enum Kind { READ, WRITE, ATOMIC };
static unsigned long long shared_reads = 0, shared_writes = 0;
static std::vector<unsigned> thread_shared_reads, thread_shared_writes;

static void shadow_access(Shadow* base, size_t i, Kind kind, unsigned long long st) {
    Shadow& s = base[i];
    const int t = current, w = t / 32;
    if (kind == READ && s.gen != block_gen && !uninit_reported) {
        uninit_reported = true;
        bool oob;
        uninit_note = fmt("%s read %s at %s before any thread of its block wrote it (shared memory starts as NaN "
                          "bytes in the emulator)", me().c_str(), shared_name(base, i, &oob).c_str(), site(st).c_str());
    }
    if (!racecheck) {
        if (kind != READ) s.gen = block_gen;
        return;
    }
    if (s.wB == B && unordered(s.wT, s.wB, s.wG) && !(kind == ATOMIC && s.wAtomic))
        race(kind == READ ? "reads" : "writes", base, i, s.wT, s.wSite, s.wAtomic ? "updated atomically" : "wrote", st);
    if (kind == READ) {
        if (s.rB != B) {
            s.rB = B, s.rT = t, s.rG = G[w], s.rSite = st, s.oG = 0, s.rWarp = w, s.multi = 0;
            s.fT = t, s.fSite = st, s.mT = t, s.mSite = st;
        } else {
            if (w != s.rWarp && !s.multi) s.multi = 1, s.mT = t, s.mSite = st;
            if (s.rT != t) {
                if (s.rG >= s.oG) s.oG = s.rG, s.oT = s.rT, s.oSite = s.rSite;
                s.rT = t;
            }
            s.rG = G[w], s.rSite = st;
        }
        return;
    }
    if (s.rB == B) {  // write after read
        const char* verb = kind == ATOMIC ? "updates" : "writes";
        if (s.multi || s.rWarp != w) {  // some reader is in another warp: nothing orders it before this write
            int cand[3] = {s.rT, s.mT, s.fT};
            unsigned long long sites[3] = {s.rSite, s.mSite, s.fSite};
            for (int k = 0; k < 3; ++k)
                if (cand[k] / 32 != w) race(verb, base, i, cand[k], sites[k], "read", st);
        }
        if (s.rT != t && s.rG == G[w]) race(verb, base, i, s.rT, s.rSite, "read", st);
        if (s.oG && s.oG == G[w] && s.oT != t) race(verb, base, i, s.oT, s.oSite, "read", st);
    }
    s.gen = block_gen, s.wB = B, s.wG = G[w], s.wT = (unsigned short)t, s.wAtomic = kind == ATOMIC, s.wSite = st;
    s.rB = 0;
}

// Is [off, off + size) inside one shared variable (or the dynamic shared memory given at launch)?
static size_t last_var = 0;
static inline bool shared_in_bounds(unsigned long long off, int size) {
    if (off >= RED && off < RED + DYN_MAX) return off - RED + size <= dyn_bytes;
    if (last_var < shared_vars.size()) {
        const SharedVar& v = shared_vars[last_var];
        if (off >= v.lo && off + size <= v.lo + v.size) return true;
    }
    for (size_t k = 0; k < shared_vars.size(); ++k) {
        const SharedVar& v = shared_vars[k];
        if (off >= v.lo && off + size <= v.lo + v.size) {
            last_var = k;
            return true;
        }
    }
    return false;
}

static void shared_access(Shadow* base, size_t off, int size, Kind kind, unsigned long long st) {
    if (base == shadow_arena && !shared_in_bounds(off, size)) {
        bool oob;
        std::string where = shared_element(off, &oob);
        if (!oob) {
            std::string where2 = shared_element(off + size - 1, &oob);
            FAIL("out-of-bounds shared memory access: %s %s %d bytes at %s, running into %s, at %s", me().c_str(),
                 kind == READ ? "reads" : "writes", size, where.c_str(), where2.c_str(), site(st).c_str());
        }
        FAIL("out-of-bounds shared memory access: %s %s %s at %s", me().c_str(), kind == READ ? "reads" : "writes",
             where.c_str(), site(st).c_str());
    }
    if (kind == READ) ++shared_reads; else ++shared_writes;
    if (profile) {
        size_t g = block_linear * nthreads + current;
        if (kind == READ) ++thread_shared_reads[g]; else ++thread_shared_writes[g];
    }
    for (int b = 0; b < size; ++b) shadow_access(base, off + b, kind, st);
}

// ------------------------------------------------------------------------------------------------
// The access hooks (called by the instrumented kernel before each load and store)
static char *exe_lo, *exe_hi;
static char *sec_lo, *sec_hi;

[[noreturn]] static void array_error(Array& a, char* p, int size, Kind kind, unsigned long long st) {
    long long off = p - a.data, n = (long long)(a.nbytes / a.elem);
    const char* verb = kind == READ ? "reads" : (kind == WRITE ? "writes" : "updates");
    std::string where = element(a, off);
    if (off % (long long)a.elem == 0 && size > (int)a.elem) where += fmt(" (%d bytes)", size);
    FAIL("out-of-bounds access: %s %s %s at %s, %s argument '%s' (%lld element%s of %s: %s[0] to %s[%lld])",
         me().c_str(), verb, where.c_str(), site(st).c_str(), off < 0 ? "before the start of" : "past the end of",
         a.name.c_str(), n, n == 1 ? "" : "s", a.type.c_str(), a.name.c_str(), a.name.c_str(), n - 1);
}

static inline void access(char* p, int size, Kind kind, bool aligned, unsigned long long st) {
    if (current < 0) return;
    unsigned long long off = (unsigned long long)(p - mt_arena);
    if (aligned && size > 1 && ((uintptr_t)p & (size - 1))) {
        for (auto& a : arrays)
            if (p >= a.map && p < a.map_end)
                FAIL("misaligned access: %s %s %d bytes at %s, byte offset %lld of argument '%s': a %d-byte access "
                     "must be %d-byte aligned on a GPU", me().c_str(), kind == READ ? "reads" : "writes", size,
                     site(st).c_str(), (long long)(p - a.data), a.name.c_str(), size, size);
        if (off < ARENA_SIZE) {
            bool oob;
            FAIL("misaligned access: %s %s %d bytes at %s, at %s: a %d-byte access must be %d-byte aligned on a GPU",
                 me().c_str(), kind == READ ? "reads" : "writes", size, site(st).c_str(),
                 shared_element(off, &oob).c_str(), size, size);
        }
    }
    if (off < ARENA_SIZE) {
        shared_access(shadow_arena, off, size, kind, st);
        return;
    }
    if (p >= sec_lo && p < sec_hi) {
        shared_access(shadow_section, p - sec_lo, size, kind, st);
        return;
    }
    if (p >= exe_lo && p < exe_hi) return;
    if (p >= stack_lo && p < stack_hi) return;
    for (auto& a : arrays) {
        if (p >= a.map && p < a.map_end) {
            if (p < a.data || p + size > a.data + a.nbytes) array_error(a, p, size, kind, st);
            if (kind == READ) {
                ++a.reads;
                if (profile) ++a.thread_reads[block_linear * nthreads + current];
            } else {
                ++a.writes;
                if (profile) {
                    ++a.thread_writes[block_linear * nthreads + current];
                    a.writer[(p - a.data) / a.elem] = (int)(block_linear * nthreads + current);
                }
            }
            return;
        }
    }
    if ((uintptr_t)p < 65536)
        FAIL("null pointer access: %s %s address %p at %s (an argument passed as None, or a pointer never set?)",
             me().c_str(), kind == READ ? "reads" : "writes", (void*)p, site(st).c_str());
    // Far outside every array: name the nearest one if it is plausibly the one meant.
    Array* near = nullptr;
    long long dist = 0;
    for (auto& a : arrays) {
        long long d = p >= a.data ? p - (a.data + a.nbytes) : a.data - p;
        if (!near || d < dist) near = &a, dist = d;
    }
    if (near && dist < (64ll << 20)) array_error(*near, p, size, kind, st);
    // Anything else (libc data, the heap) is not kernel memory we track.
}

static void check_vector(const volatile void* vp, unsigned align, unsigned long long st) {
    char* p = (char*)vp;
    if (current < 0 || p == nullptr || ((uintptr_t)p % align) == 0) return;
    for (auto& a : arrays)
        if (p >= a.map && p < a.map_end)
            FAIL("misaligned vector access: %s makes a %u-byte vector pointer (float4, int4, ...) at byte offset %lld of "
                 "argument '%s' (%s) at %s; a %u-byte vector load or store must be %u-byte aligned on a GPU, so its "
                 "offset must be a multiple of %u", me().c_str(), align, (long long)(p - a.data), a.name.c_str(), element(a, p - a.data).c_str(), site(st).c_str(), align,
                 align, align);
    unsigned long long off = (unsigned long long)(p - mt_arena);
    if (off < ARENA_SIZE) {
        bool oob;
        FAIL("misaligned vector access: %s makes a %u-byte vector pointer at %s (shared memory) at %s; it must be "
             "%u-byte aligned on a GPU", me().c_str(), align, shared_element(off, &oob).c_str(), site(st).c_str(), align);
    }
    FAIL("misaligned vector access: %s makes a %u-byte vector pointer at address %p at %s; it must be %u-byte aligned",
         me().c_str(), align, (void*)p, site(st).c_str(), align);
}

void check_vector_access(const volatile void* p, unsigned align, const char*, int line, const char* file) {
    check_vector(p, align, line_site(line, file));
}

// An asynchronous copy's two halves (cuda_pipeline.h): its read of global memory when issued, its write
// to shared memory when its thread waits for it; `size` bytes at p, p aligned to `align`.
void async_access(const volatile void* vp, int size, unsigned align, int is_write, int line, const char* file) {
    char* p = (char*)vp;
    unsigned long long st = line_site(line, file);
    if (current < 0) return;
    if (is_write && (unsigned long long)(p - mt_arena) >= ARENA_SIZE && !(p >= sec_lo && p < sec_hi))
        FAIL("__pipeline_memcpy_async: %s copies to address %p at %s, which is not shared memory: the destination "
             "of an asynchronous copy must be a __shared__ array", me().c_str(), (void*)p, site(st).c_str());
    if ((uintptr_t)p % align)
        FAIL("misaligned asynchronous copy: %s %s %u bytes at %p at %s; __pipeline_memcpy_async's addresses must be "
             "aligned to its size (4, 8 or 16 bytes)", me().c_str(), is_write ? "writes" : "reads", align, (void*)p,
             site(st).c_str());
    if (size > 0) access(p, size, is_write ? WRITE : READ, false, st);
}

void atomic_access(const volatile void* vp, int size, int is_float, int line, const char* file) {
    char* p = (char*)vp;
    access(p, size, ATOMIC, true, line_site(line, file));
    if (is_float)
        for (auto& a : arrays)
            if (p >= a.data && p < a.data + a.nbytes) a.float_atomics = true;
}

// ------------------------------------------------------------------------------------------------
// Warp collectives
static const char* op_name(int op) {
    switch (op) {
        case SYNCWARP: return "__syncwarp";
        case SHFL: return "__shfl_*_sync";
        case BALLOT: return "__ballot_sync";
        case ANY: return "__any_sync";
        case ALL: return "__all_sync";
        case RED_ADD: return "__reduce_add_sync";
        case RED_MIN: case RED_UMIN: return "__reduce_min_sync";
        case RED_MAX: case RED_UMAX: return "__reduce_max_sync";
        case RED_AND: return "__reduce_and_sync";
        case RED_OR: return "__reduce_or_sync";
        case RED_XOR: return "__reduce_xor_sync";
        case MATCH_ANY: return "__match_any_sync";
        case MATCH_ALL: return "__match_all_sync";
        case ACTIVEMASK: return "__activemask";
    }
    return "a warp operation";
}

static unsigned long long collectives = 0;

unsigned long long collective(int op, unsigned mask, unsigned long long value, int src, int line, const char* file) {
    if (current < 0) FAIL("%s called outside a kernel", op_name(op));
    Req& r = fibers[current].req;
    r.op = op, r.mask = mask, r.value = value, r.src = src, r.line = line, r.file = file, r.result = 0;
    wait(AT_WARP);
    return fibers[current].req.result;
}

static std::string state_of(int i) {
    const Fiber& f = fibers[i];
    if (f.state == DONE) return "has exited";
    if (f.state == AT_BARRIER) return "waits at " + std::string("__syncthreads() at ") + site_of(f.req);
    if (f.state == AT_WARP) return fmt("waits at %s(mask 0x%08x) at %s", op_name(f.req.op), f.req.mask, site_of(f.req).c_str());
    return "is running";
}

// Complete the warp operation the lanes in `group` (bit mask) all wait at.
static void complete(int w, unsigned group) {
    const int base = w * 32;
    int first = __builtin_ctz(group);
    const Req& r0 = fibers[base + first].req;
    unsigned long long acc = 0;
    unsigned bits = 0;
    bool all = true, any = false;
    switch (r0.op) {
        case RED_AND: acc = ~0ull; break;
        case RED_MIN: acc = (unsigned long long)(long long)INT_MAX; break;
        case RED_UMIN: acc = UINT_MAX; break;
        case RED_MAX: acc = (unsigned long long)(long long)INT_MIN; break;
        default: break;
    }
    for (unsigned m = group; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        const Req& r = fibers[base + l].req;
        unsigned v = (unsigned)r.value;
        if (r.value) bits |= 1u << l, any = true; else all = false;
        switch (r0.op) {
            case RED_ADD: acc = (unsigned)(acc + v); break;
            case RED_MIN: acc = (unsigned long long)(long long)std::min((int)(long long)acc, (int)v); break;
            case RED_MAX: acc = (unsigned long long)(long long)std::max((int)(long long)acc, (int)v); break;
            case RED_UMIN: acc = std::min((unsigned)acc, v); break;
            case RED_UMAX: acc = std::max((unsigned)acc, v); break;
            case RED_AND: acc &= v; break;
            case RED_OR: acc |= v; break;
            case RED_XOR: acc ^= v; break;
        }
    }
    for (unsigned m = group; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        Req& r = fibers[base + l].req;
        switch (r0.op) {
            case SHFL:
                if (r.src != l) {
                    if (r.src < 0 || r.src >= 32 || !((group >> r.src) & 1)) {
                        int s = base + r.src;
                        std::string why = r.src < 0 || r.src >= 32 || s >= nthreads
                                              ? "does not exist"
                                              : ((r.mask >> r.src) & 1 ? state_of(s) : fmt("is not in the mask 0x%08x", r.mask));
                        FAIL("warp shuffle reads an inactive lane: %s (lane %d) reads lane %d in %s at %s, but lane %d "
                             "%s; on a GPU the value it gets is undefined", thread_name(base + l).c_str(), l, r.src,
                             op_name(r.op), site_of(r).c_str(), r.src, why.c_str());
                    }
                    r.result = fibers[base + r.src].req.value;
                } else {
                    r.result = r.value;
                }
                break;
            case BALLOT: r.result = bits; break;
            case ANY: r.result = any; break;
            case ALL: r.result = all; break;
            case ACTIVEMASK: r.result = group; break;
            case MATCH_ANY: {
                unsigned same = 0;
                for (unsigned m2 = group; m2; m2 &= m2 - 1) {
                    int l2 = __builtin_ctz(m2);
                    if (fibers[base + l2].req.value == r.value) same |= 1u << l2;
                }
                r.result = same;
                break;
            }
            case MATCH_ALL: {
                bool eq = true;
                for (unsigned m2 = group; m2; m2 &= m2 - 1)
                    eq = eq && fibers[base + __builtin_ctz(m2)].req.value == r.value;
                r.result = eq ? group : 0;
                break;
            }
            case SYNCWARP: break;
            default: r.result = acc; break;
        }
    }
    for (unsigned m = group; m; m &= m - 1) fibers[base + __builtin_ctz(m)].state = RUNNING;
    ++G[w];
    ++collectives;
}

static unsigned lanes_of(int w) {
    int n = std::min(32, nthreads - w * 32);
    return n == 32 ? 0xffffffffu : ((1u << n) - 1);
}

// Complete one warp operation whose lanes have all arrived. Returns false if none can complete.
static bool resolve(int w) {
    const int base = w * 32;
    const unsigned exists = lanes_of(w);
    unsigned waiting = 0, live = 0;
    for (unsigned m = exists; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        if (fibers[base + l].state != DONE) live |= 1u << l;
        if (fibers[base + l].state == AT_WARP) waiting |= 1u << l;
    }
    for (unsigned m = waiting; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        const Req& r = fibers[base + l].req;
        if (r.op == ACTIVEMASK) continue;
        if (!((r.mask >> l) & 1))
            FAIL("%s (lane %d) calls %s at %s with mask 0x%08x, which does not include its own lane", thread_name(base + l).c_str(),
                 l, op_name(r.op), site_of(r).c_str(), r.mask);
        unsigned group = r.mask & live;
        bool ok = true;
        for (unsigned g = group; g && ok; g &= g - 1) {
            const Fiber& f = fibers[base + __builtin_ctz(g)];
            ok = f.state == AT_WARP && f.req.op == r.op && f.req.mask == r.mask;
        }
        if (ok) {
            complete(w, group);
            return true;
        }
    }
    // __activemask(): the lanes that reached the same call together (they are converged).
    for (unsigned m = waiting; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        const Req& r = fibers[base + l].req;
        if (r.op != ACTIVEMASK) continue;
        unsigned group = 0;
        for (unsigned g = waiting; g; g &= g - 1) {
            const Req& q = fibers[base + __builtin_ctz(g)].req;
            if (q.op == ACTIVEMASK && q.line == r.line && q.file == r.file) group |= 1u << __builtin_ctz(g);
        }
        complete(w, group);
        return true;
    }
    return false;
}

static std::vector<int> lane_order, warp_order;

static void run_warp(int w) {
    const int base = w * 32, n = std::min(32, nthreads - base);
    for (;;) {
        order(lane_order, n);
        for (int l : lane_order)
            if (fibers[base + l].state == RUNNING) switch_to(base + l);
        if (!resolve(w)) return;
    }
}

[[noreturn]] static void warp_deadlock() {
    for (int i = 0; i < nthreads; ++i) {
        const Fiber& f = fibers[i];
        if (f.state != AT_WARP) continue;
        const int base = i / 32 * 32;
        unsigned group = f.req.mask & lanes_of(i / 32);
        for (unsigned g = group; g; g &= g - 1) {
            int j = base + __builtin_ctz(g);
            const Fiber& o = fibers[j];
            if (o.state == AT_WARP && o.req.op == f.req.op && o.req.mask == f.req.mask) continue;
            if (o.state == DONE) continue;
            FAIL("deadlock in block (%u,%u,%u): %s waits at %s(mask 0x%08x) at %s for lane %d, which %s. The lanes "
                 "named in a warp operation's mask must all reach the same operation; a lane outside the mask may be "
                 "elsewhere", blockIdx.x, blockIdx.y, blockIdx.z, thread_name(i).c_str(), op_name(f.req.op),
                 f.req.mask, site_of(f.req).c_str(), j % 32, state_of(j).c_str());
        }
    }
    FAIL("deadlock in block (%u,%u,%u) at a warp operation", blockIdx.x, blockIdx.y, blockIdx.z);
}

// ------------------------------------------------------------------------------------------------
// Block barriers
static unsigned long long barriers_passed = 0;

int barrier(int op, int pred, int line, const char* file) {
    if (current < 0) FAIL("__syncthreads() called outside a kernel");
    Req& r = fibers[current].req;
    r.op = op, r.mask = 0, r.value = pred != 0, r.src = -1, r.line = line, r.file = file, r.result = 0;
    wait(AT_BARRIER);
    return (int)fibers[current].req.result;
}

static void pass_barrier() {
    int first = -1, count = 0, live = 0;
    for (int i = 0; i < nthreads; ++i) {
        const Fiber& f = fibers[i];
        if (f.state == DONE) continue;
        ++live;
        if (first < 0) first = i;
        const Req& a = fibers[first].req;
        if (f.req.op != a.op || f.req.line != a.line || f.req.file != a.file) {
            static const char* names[] = {"__syncthreads()", "__syncthreads_count()", "__syncthreads_and()", "__syncthreads_or()"};
            FAIL("threads of block (%u,%u,%u) wait at different barriers: %s at %s (%s), %s at %s (%s). Every thread "
                 "of a block must reach the same __syncthreads(); one inside a branch that only some threads take is "
                 "undefined behaviour", blockIdx.x, blockIdx.y, blockIdx.z, thread_name(first).c_str(),
                 site_of(a).c_str(), names[a.op], thread_name(i).c_str(), site_of(f.req).c_str(), names[f.req.op]);
        }
        count += (int)f.req.value;
    }
    const int op = fibers[first].req.op;
    int result = op == BAR_COUNT ? count : (op == BAR_AND ? count == live : (op == BAR_OR ? count > 0 : 0));
    for (auto& f : fibers)
        if (f.state == AT_BARRIER) f.state = RUNNING, f.req.result = result;
    ++B;
    ++barriers_passed;
}

// ------------------------------------------------------------------------------------------------
// The launch
static void reset_shared() {
    memset(mt_arena + RED, 0xFF, dyn_bytes);
    for (auto& v : shared_vars) memset(mt_arena + v.lo, 0xFF, v.size);
    if (sec_hi > sec_lo) memset(sec_lo, 0xFF, sec_hi - sec_lo);
}

static void run_block(dim3 block) {
    ++blocks_run;
    ++B;
    ++block_gen;
    reset_shared();
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fibers[i];
        f.tid = {unsigned(i % block.x), unsigned(i / block.x % block.y), unsigned(i / (block.x * block.y))};
        f.state = RUNNING;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks[i] + GUARD;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = &scheduler;
        makecontext(&f.ctx, fiber_main, 0);
    }
    for (;;) {
        order(warp_order, nwarps);
        for (int w : warp_order) run_warp(w);
        int done = 0, at_warp = 0;
        for (auto& f : fibers) done += f.state == DONE, at_warp += f.state == AT_WARP;
        if (done == nthreads) return;
        if (at_warp) warp_deadlock();
        pass_barrier();
    }
}

static void on_segv(int, siginfo_t* info, void*) {
    char* addr = (char*)info->si_addr;
    char who[128];
    describe_thread(who, sizeof who);
    for (size_t i = 0; i < stacks.size(); ++i)
        if (addr >= stacks[i] && addr < stacks[i] + GUARD) {
            fprintf(stderr, "MT-ERROR: stack overflow in %s: the emulator gives each thread %zu KB of stack (large "
                    "local arrays or deep recursion?)\n", who, STACK / 1024);
            _exit(4);
        }
    for (auto& a : arrays)
        if (addr >= a.map && addr < a.map_end) {
            long long off = addr - a.data;
            fprintf(stderr, "MT-ERROR: out-of-bounds access by %s: byte %lld %s argument '%s'\n", who,
                    off < 0 ? -off : off - (long long)a.nbytes, off < 0 ? "before the start of" : "past the end of",
                    a.name.c_str());
            _exit(4);
        }
    if ((uintptr_t)addr < 65536)
        fprintf(stderr, "MT-ERROR: null pointer access by %s (address %p)\n", who, (void*)addr);
    else
        fprintf(stderr, "MT-ERROR: invalid memory access by %s at address %p, not inside any argument array\n", who,
                (void*)addr);
    _exit(4);
}

static void launch(dim3 grid, dim3 block) {
    nthreads = (int)(block.x * block.y * block.z);
    nwarps = (nthreads + 31) / 32;
    gridDim = grid, blockDim = block;
    fibers.assign(nthreads, Fiber{});
    while ((int)stacks.size() < nthreads) {
        char* s = (char*)mmap(nullptr, STACK + GUARD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (s == MAP_FAILED) FAIL("out of memory for thread stacks");
        mprotect(s, GUARD, PROT_NONE);
        stacks.push_back(s);
    }
    const unsigned long long nblocks = (unsigned long long)grid.x * grid.y * grid.z;
    std::vector<int> border;
    if (schedule == FORWARD || nblocks > (1ull << 24)) {
        for (unsigned long long b = 0; b < nblocks; ++b) {
            unsigned long long bb = schedule == REVERSE ? nblocks - 1 - b : b;
            block_linear = bb;
            blockIdx = {unsigned(bb % grid.x), unsigned(bb / grid.x % grid.y), unsigned(bb / ((unsigned long long)grid.x * grid.y))};
            run_block(block);
        }
        return;
    }
    order(border, (int)nblocks);
    for (int bb : border) {
        block_linear = (unsigned long long)bb;
        blockIdx = {unsigned(bb % grid.x), unsigned(bb / grid.x % grid.y), unsigned(bb / ((unsigned long long)grid.x * grid.y))};
        run_block(block);
    }
}

static void check_guards() {
    for (auto& a : arrays)
        for (char* p = a.map; p < a.data; ++p)
            if ((unsigned char)*p != 0xFF)
                FAIL("the kernel wrote %lld bytes before the start of argument '%s'", (long long)(a.data - p), a.name.c_str());
}

// ------------------------------------------------------------------------------------------------
// Arguments in, results out
static FILE* in;
static void read_exact(void* p, size_t n) {
    if (fread(p, 1, n, in) != n) FAIL("truncated argument file (wanted %zu more bytes)", n);
}
template <class T> static T rd() {
    T v;
    read_exact(&v, sizeof v);
    return v;
}
static std::string rd_str() {
    unsigned n = rd<unsigned>();
    std::string s(n, '\0');
    read_exact(&s[0], n);
    return s;
}
}  // namespace mt

// ------------------------------------------------------------------------------------------------
// ThreadSanitizer's instrumentation calls (no TSan runtime is linked: these are the whole of it)
extern "C" {
#define MT_HOOK(N)                                                                                          \
    void __tsan_read##N(void* p) { mt::access((char*)p, N, mt::READ, true, mt::pc_site(__builtin_return_address(0))); } \
    void __tsan_write##N(void* p) { mt::access((char*)p, N, mt::WRITE, true, mt::pc_site(__builtin_return_address(0))); } \
    void __tsan_unaligned_read##N(void* p) { mt::access((char*)p, N, mt::READ, false, mt::pc_site(__builtin_return_address(0))); } \
    void __tsan_unaligned_write##N(void* p) { mt::access((char*)p, N, mt::WRITE, false, mt::pc_site(__builtin_return_address(0))); } \
    void __tsan_volatile_read##N(void* p) { mt::access((char*)p, N, mt::READ, true, mt::pc_site(__builtin_return_address(0))); } \
    void __tsan_volatile_write##N(void* p) { mt::access((char*)p, N, mt::WRITE, true, mt::pc_site(__builtin_return_address(0))); }
MT_HOOK(1)
MT_HOOK(2)
MT_HOOK(4)
MT_HOOK(8)
MT_HOOK(16)
void __tsan_read_range(void* p, unsigned long n) {
    if (n) mt::access((char*)p, (int)std::min(n, 1ul << 20), mt::READ, false, mt::pc_site(__builtin_return_address(0)));
}
void __tsan_write_range(void* p, unsigned long n) {
    if (n) mt::access((char*)p, (int)std::min(n, 1ul << 20), mt::WRITE, false, mt::pc_site(__builtin_return_address(0)));
}
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
}

// ------------------------------------------------------------------------------------------------
// main: emulator in.bin out.bin stats.txt [profile.bin]
int main(int argc, char** argv) {
    using namespace mt;
    if (argc < 4) return 2;
    in = fopen(argv[1], "rb");
    if (!in) FAIL("cannot open the argument file");
    if (rd<unsigned>() != 0x3145544Du) FAIL("not an emulator argument file");
    unsigned g[3], b[3];
    read_exact(g, sizeof g);
    read_exact(b, sizeof b);
    dim3 grid(g[0], g[1], g[2]), block(b[0], b[1], b[2]);
    dyn_bytes = rd<unsigned>();
    unsigned flags = rd<unsigned>();
    racecheck = flags & 1, profile = flags & 2;
    unsigned nsched = rd<unsigned>();
    std::vector<unsigned> schedules(nsched);
    for (auto& s : schedules) s = rd<unsigned>();
    rng_state ^= rd<unsigned>();
    if (dyn_bytes > DYN_MAX)
        FAIL("%llu bytes of dynamic shared memory requested; the emulator (like an H100) allows at most %llu per block",
             dyn_bytes, DYN_MAX);
    size_t n = (size_t)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || block.z > 64)
        FAIL("invalid block size: %zu threads, z = %u (CUDA allows 1..1024 threads, z <= 64)", n, block.z);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
        FAIL("invalid grid (%u, %u, %u): each dimension must be >= 1, y and z <= 65535", grid.x, grid.y, grid.z);

    unsigned nparams = rd<unsigned>();
    mt_nargs = (int)nparams;
    static void* argv_slots[64];
    static unsigned long long scalar_slots[64][4];
    static char* pointer_slots[64];
    std::vector<int> array_of_param(nparams, -1);
    if (nparams > 64) FAIL("too many kernel parameters (%u)", nparams);
    for (unsigned i = 0; i < nparams; ++i) {
        unsigned kind = rd<unsigned>();
        std::string name = rd_str(), type = rd_str();
        unsigned long long size = rd<unsigned long long>();
        unsigned elem = rd<unsigned>();
        if (kind == 0) {  // scalar
            if (size > sizeof scalar_slots[i]) FAIL("scalar argument %s too large", name.c_str());
            read_exact(scalar_slots[i], size);
            argv_slots[i] = scalar_slots[i];
        } else if (kind == 1) {  // array
            array_of_param[i] = (int)arrays.size();
            char* p = alloc_array(name, type, size, elem);
            read_exact(p, size);
            pointer_slots[i] = p;
            argv_slots[i] = &pointer_slots[i];
        } else {  // null pointer
            pointer_slots[i] = nullptr;
            argv_slots[i] = &pointer_slots[i];
        }
    }
    fclose(in);
    for (auto& a : arrays) {
        a.pristine = (char*)malloc(a.nbytes ? a.nbytes : 1);
        memcpy(a.pristine, a.data, a.nbytes);
    }
    kernel_args = argv_slots;
    exe_lo = __executable_start, exe_hi = _end;
    sec_lo = __start_mt_shared, sec_hi = __stop_mt_shared;
    shadow_arena = make_shadow(ARENA_SIZE);
    section_size = sec_hi - sec_lo;
    shadow_section = make_shadow(section_size ? section_size : 1);

    static char altstack[1 << 16];
    stack_t ss{};
    ss.ss_sp = altstack, ss.ss_size = sizeof altstack;
    sigaltstack(&ss, nullptr);
    struct sigaction sa {};
    sa.sa_sigaction = on_segv, sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);

    const unsigned long long total_threads = (unsigned long long)grid.x * grid.y * grid.z * n;
    if (profile) {
        if (total_threads > (1ull << 26)) FAIL("profile=True needs at most 2^26 threads");
        for (auto& a : arrays)
            a.thread_reads.assign(total_threads, 0), a.thread_writes.assign(total_threads, 0),
                a.writer.assign(a.nbytes / a.elem, -1);
        thread_shared_reads.assign(total_threads, 0), thread_shared_writes.assign(total_threads, 0);
    }
    FILE* out = fopen(argv[2], "wb");
    FILE* stats = fopen(argv[3], "w");
    if (!out || !stats) FAIL("cannot write the results");
    int saved_stdout = dup(1);
    for (unsigned s = 0; s < nsched; ++s) {
        schedule = (int)schedules[s];
        if (s > 0) {
            for (auto& a : arrays) memcpy(a.data, a.pristine, a.nbytes);
            fflush(stdout);
            int devnull = open("/dev/null", O_WRONLY);
            dup2(devnull, 1);
            close(devnull);
            if (profile) profile = false;
        }
        for (auto& a : arrays) a.reads = a.writes = 0;
        shared_reads = shared_writes = barriers_passed = collectives = 0;
        launch(grid, block);
        check_guards();
        for (auto& a : arrays) fwrite(a.data, 1, a.nbytes, out);
        fprintf(stats, "schedule %s\n", SCHEDULE_NAMES[schedule]);
        for (size_t i = 0; i < arrays.size(); ++i)
            fprintf(stats, "array %zu reads %llu writes %llu float_atomics %d\n", i, arrays[i].reads, arrays[i].writes,
                    (int)arrays[i].float_atomics);
        fprintf(stats, "shared reads %llu writes %llu barriers %llu collectives %llu\n", shared_reads, shared_writes,
                barriers_passed, collectives);
        if (s == 0 && profile && argc > 4) {
            FILE* pf = fopen(argv[4], "wb");
            for (auto& a : arrays) {
                fwrite(a.thread_reads.data(), sizeof(unsigned), total_threads, pf);
                fwrite(a.thread_writes.data(), sizeof(unsigned), total_threads, pf);
            }
            fwrite(thread_shared_reads.data(), sizeof(unsigned), total_threads, pf);
            fwrite(thread_shared_writes.data(), sizeof(unsigned), total_threads, pf);
            for (auto& a : arrays) fwrite(a.writer.data(), sizeof(int), a.writer.size(), pf);
            fclose(pf);
        }
    }
    fflush(stdout);
    dup2(saved_stdout, 1);
    if (!uninit_note.empty()) fprintf(stats, "note %s\n", uninit_note.c_str());
    fclose(stats);
    fclose(out);
    fflush(stdout);
    return 0;
}
