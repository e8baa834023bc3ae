/* Live tensor storage, counted where c10's CPU allocator takes it from the C library.
 *
 * Preloaded (LD_PRELOAD) into a process, it wraps posix_memalign, which c10::alloc_cpu calls for every CPU
 * tensor storage, and free. A block counts from its allocation to its free, on whichever thread either happens
 * (gloo's worker threads included); only blocks posix_memalign hands to libc10 itself count, so other libraries'
 * aligned buffers (oneDNN's scratchpads) do not. Read with ctypes: live_storage_current(), live_storage_peak(),
 * live_storage_reset_peak() (the peak becomes the current count). tests/extras/observe/allocator_counter.py
 * builds and loads it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SLOTS (1u << 20) /* open addressing; far more than the live storages of a test */

static int (*real_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *keys[SLOTS];
static size_t sizes[SLOTS];
static int64_t current, peak;
static const void *c10_base; /* load address of libc10.so, found on its first call */
static __thread int resolving;

/* 0 while dlsym itself frees (it may): that block is not ours, and is left alone */
static int resolve(void) {
    if (real_memalign && real_free) return 1;
    if (resolving) return 0;
    resolving = 1;
    real_memalign = (int (*)(void **, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
    real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
    resolving = 0;
    return real_memalign && real_free;
}

static size_t slot_of(const void *p) { return (size_t)(((uintptr_t)p >> 6) * 0x9E3779B97F4A7C15ull) & (SLOTS - 1); }

static int from_c10(const void *caller) {
    Dl_info info;
    if (c10_base) {
        return dladdr(caller, &info) && info.dli_fbase == c10_base;
    }
    if (dladdr(caller, &info) && info.dli_fname && strstr(info.dli_fname, "libc10.so")) {
        c10_base = info.dli_fbase;
        return 1;
    }
    return 0;
}

int posix_memalign(void **out, size_t alignment, size_t size) {
    if (!resolve()) return 12; /* ENOMEM: only reached from inside dlsym */
    int result = real_memalign(out, alignment, size);
    if (result == 0 && size > 0 && from_c10(__builtin_return_address(0))) {
        pthread_mutex_lock(&lock);
        size_t i = slot_of(*out);
        while (keys[i]) i = (i + 1) & (SLOTS - 1);
        keys[i] = *out;
        sizes[i] = size;
        current += (int64_t)size;
        if (current > peak) peak = current;
        pthread_mutex_unlock(&lock);
    }
    return result;
}

void free(void *p) {
    if (!resolve()) return;
    if (p) {
        pthread_mutex_lock(&lock);
        size_t i = slot_of(p);
        while (keys[i] && keys[i] != p) i = (i + 1) & (SLOTS - 1);
        if (keys[i] == p) {
            current -= (int64_t)sizes[i];
            /* backward-shift deletion keeps every probe chain unbroken */
            size_t hole = i, j = i;
            keys[hole] = NULL;
            for (;;) {
                j = (j + 1) & (SLOTS - 1);
                if (!keys[j]) break;
                size_t home = slot_of(keys[j]);
                if (((j - home) & (SLOTS - 1)) >= ((j - hole) & (SLOTS - 1))) {
                    keys[hole] = keys[j];
                    sizes[hole] = sizes[j];
                    keys[j] = NULL;
                    hole = j;
                }
            }
        }
        pthread_mutex_unlock(&lock);
    }
    real_free(p);
}

int64_t live_storage_current(void) { return current; }
int64_t live_storage_peak(void) { return peak; }

void live_storage_reset_peak(void) {
    pthread_mutex_lock(&lock);
    peak = current;
    pthread_mutex_unlock(&lock);
}
