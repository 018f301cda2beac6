// The thread pool of the native kernels: a pool of our own. Each parallel phase is cut into chunks that threads take
// from one atomic ticket, so a thread the OS has taken away (a busy machine, the GUI's thread) delays a phase by at
// most one chunk instead of its fixed share; the calling thread works too, and waiting threads spin briefly, then
// sleep on a futex. CALLS lets one call at a time into the pool (and into decode_scratch.h's scratch).
#pragma once
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "decode_types.h"

typedef void (*task_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    task_fn fn;
    void *ctx;
    int64_t total, grain;
    _Atomic int64_t done;
} job;

// The ticket is (generation << 32 | next item): a thread takes items with one compare-and-swap, and one of an
// older generation can never take any (its swap fails). Jobs alternate between two slots, so the one being
// filled is never the one a late thread still reads.
static struct {
    _Atomic uint64_t ticket;
    job jobs[2];
    _Atomic uint32_t wake;
    _Atomic int sleeping, stop, started;
    int num_threads;  // the calling thread included
    pthread_t threads[MAX_THREADS];
    int64_t spin_ns;
} pool = {.num_threads = 1, .spin_ns = 100000};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void work(uint32_t generation) {
    job *j = &pool.jobs[generation & 1];
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if ((uint32_t)(t >> 32) != generation) return;
        int64_t begin = (int64_t)(t & 0xffffffffu);
        if (begin >= j->total) return;
        int64_t end = begin + j->grain < j->total ? begin + j->grain : j->total;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + (uint64_t)(end - begin),
                                                   memory_order_acq_rel, memory_order_relaxed))
            continue;
        j->fn(j->ctx, begin, end);  // the slot stays as it is until `done` reaches `total`, which needs us
        atomic_fetch_add_explicit(&j->done, end - begin, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&pool.ticket) >> 32);
    int64_t idle_since = now_ns();
    for (int spins = 0;; spins++) {
        if (atomic_load_explicit(&pool.stop, memory_order_acquire)) return NULL;
        uint32_t g = (uint32_t)(atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32);
        if (g != seen) {
            work(g);
            seen = g;
            idle_since = now_ns();
            spins = 0;
            continue;
        }
        if (spins < 64) {  // the next phase of a layer is usually microseconds away
            cpu_relax();
            continue;
        }
        if ((spins & 15) != 15 || now_ns() - idle_since < pool.spin_ns) {
            sched_yield();  // idle, but let a thread that has work on this core (torch's, the GUI's) run first
            continue;
        }
        // Sleep until the next job: announce it first, then look once more, so a job published meanwhile is
        // either seen here or finds us counted and wakes us.
        atomic_fetch_add(&pool.sleeping, 1);
        uint32_t w = atomic_load(&pool.wake);
        if ((uint32_t)(atomic_load(&pool.ticket) >> 32) == seen && !atomic_load(&pool.stop))
            syscall(SYS_futex, &pool.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
        atomic_fetch_sub(&pool.sleeping, 1);
        idle_since = now_ns();
        spins = 0;
    }
}

static void wake_all(void) {
    atomic_fetch_add(&pool.wake, 1);
    syscall(SYS_futex, &pool.wake, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

static void stop_pool(void) {
    if (!atomic_load(&pool.started)) return;
    atomic_store(&pool.stop, 1);
    wake_all();
    for (int i = 0; i < pool.num_threads - 1; i++) pthread_join(pool.threads[i], NULL);
    atomic_store(&pool.stop, 0);
    atomic_store(&pool.started, 0);
}

// Run fn over [0, total) in chunks of `grain`, on every thread of the pool; returns when all are done.
static void parallel(task_fn fn, void *ctx, int64_t total, int64_t grain) {
    if (pool.num_threads == 1 || total <= grain) {
        fn(ctx, 0, total);
        return;
    }
    uint32_t g = (uint32_t)(atomic_load(&pool.ticket) >> 32) + 1;
    job *j = &pool.jobs[g & 1];
    j->fn = fn, j->ctx = ctx, j->total = total, j->grain = grain;
    atomic_store(&j->done, 0);
    atomic_store(&pool.ticket, (uint64_t)g << 32);
    if (atomic_load(&pool.sleeping) > 0) wake_all();
    work(g);
    for (int spins = 1; atomic_load_explicit(&j->done, memory_order_acquire) < total; spins++) {
        cpu_relax();
        if ((spins & 63) == 0) sched_yield();  // the thread holding the last chunk may be waiting for this core
    }
}

// One call at a time into the pool and the lanes' scratch, which are the process's: two engines decoding on two
// threads (or a prefill beside a decode) would otherwise share the pool's job slots and each other's scratch.
static pthread_mutex_t CALLS = PTHREAD_MUTEX_INITIALIZER;

// Use `n` threads (the caller included) from now on; 1: everything on the calling thread.
int decode_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&CALLS);
    stop_pool();
    pool.num_threads = n;
    for (int i = 0; i < n - 1; i++)
        if (pthread_create(&pool.threads[i], NULL, worker_main, NULL) != 0) {
            pool.num_threads = i + 1;
            break;
        }
    atomic_store(&pool.started, 1);
    pthread_mutex_unlock(&CALLS);
    return pool.num_threads;
}

int decode_num_threads(void) { return pool.num_threads; }

// How long an idle worker spins before it sleeps (nanoseconds).
void decode_set_spin(int64_t ns) { pool.spin_ns = ns; }
