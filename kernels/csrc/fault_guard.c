/* A process that maps weight files survives one of them being truncated under it.

   Reading a page of a mapping past its file's new end raises SIGBUS (si_code BUS_ADRERR), which kills the
   process: Python, torch's threads and our kernels all read the weights in place. This handler turns such a fault
   inside a registered range into zeros: it maps anonymous zero pages over the rest of that range (every page past
   the faulting one is past the file's new end too) and marks the range faulted; the faulting instruction then
   reads zeros and the step finishes. The engine checks `fault_guard_faulted` (and the files' sizes) after every
   step and discards that step's results with a typed error (kernels/fault_guard.py, engine/runtime/engine.py).

   Any other SIGBUS, or one outside the ranges, goes to the handler that was there before (Python's faulthandler,
   or the default, which ends the process): ours restores it and returns, and the faulting access raises again.
   mmap is a plain system call on Linux, safe to make in a signal handler. */

#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 4096

typedef struct {
    uintptr_t start, end; /* 0, 0: a free slot */
    int faulted;
} range_t;

static range_t ranges[MAX_RANGES];
static struct sigaction previous;
static volatile sig_atomic_t passing; /* a foreign SIGBUS is on its way to the previous handler */

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)context;
    uintptr_t addr = (uintptr_t)info->si_addr;
    if (info->si_code == BUS_ADRERR) {
        for (int i = 0; i < MAX_RANGES; i++) {
            uintptr_t start = __atomic_load_n(&ranges[i].start, __ATOMIC_ACQUIRE);
            uintptr_t end = __atomic_load_n(&ranges[i].end, __ATOMIC_ACQUIRE);
            if (start == 0 || addr < start || addr >= end) continue;
            uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
            uintptr_t from = addr & ~(page - 1), to = (end + page - 1) & ~(page - 1);
            void *p = mmap((void *)from, to - from, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) break;
            __atomic_store_n(&ranges[i].faulted, 1, __ATOMIC_RELEASE);
            return;
        }
    }
    /* Not ours (a fault elsewhere, or kill -BUS): to the handler that was there. If that one hands it back to us
       (faulthandler, enabled after us, keeps us as its previous one), end as the default does. */
    if (passing) {
        signal(SIGBUS, SIG_DFL);
    } else {
        sigaction(SIGBUS, &previous, NULL);
    }
    passing = 1;
    raise(sig); /* SA_NODEFER: delivered (and passed back, if it is) before raise returns */
    passing = 0;
}

/* Install the handler unless it is the current one (faulthandler, enabled later, would have replaced it). */
static int ensure_installed(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    return sigaction(SIGBUS, &ours, &previous);
}

/* Watch [addr, addr + len): returns the slot (for faulted/unregister), or -1 when the table is full. */
int fault_guard_register(void *addr, size_t len) {
    if (ensure_installed() != 0 || addr == NULL || len == 0) return -1;
    for (int i = 0; i < MAX_RANGES; i++) {
        uintptr_t expected = 0;
        if (__atomic_load_n(&ranges[i].start, __ATOMIC_ACQUIRE) != 0) continue;
        ranges[i].faulted = 0;
        __atomic_store_n(&ranges[i].end, (uintptr_t)addr + len, __ATOMIC_RELEASE);
        if (__atomic_compare_exchange_n(&ranges[i].start, &expected, (uintptr_t)addr, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return i;
    }
    return -1;
}

int fault_guard_faulted(int slot) {
    return slot >= 0 && slot < MAX_RANGES ? __atomic_load_n(&ranges[slot].faulted, __ATOMIC_ACQUIRE) : 0;
}

void fault_guard_unregister(int slot) {
    if (slot < 0 || slot >= MAX_RANGES) return;
    __atomic_store_n(&ranges[slot].start, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&ranges[slot].end, 0, __ATOMIC_RELEASE);
}
