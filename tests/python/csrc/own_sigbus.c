/* A program's own SIGBUS handler, for tests/python/test_signals.py: it recovers from
 * faults in a region of its own (a file it maps and truncates) by mapping zero pages
 * there, after some work (as a real handler might log or count), or by siglongjmp. */
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static char *region;
static size_t region_len;
static atomic_int recovered;
static int use_longjmp;
static __thread sigjmp_buf *jump;

static void busy_ms(int ms) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < ms * 1000000L);
}

static void handler(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    char *addr = (char *)info->si_addr;
    if (sig != SIGBUS || addr < region || addr >= region + region_len) {
        signal(SIGBUS, SIG_DFL);
        return; /* not ours: the fault repeats and kills */
    }
    busy_ms(2);
    atomic_fetch_add(&recovered, 1);
    if (use_longjmp && jump) siglongjmp(*jump, 1);
    char *page = (char *)((uintptr_t)addr & ~(uintptr_t)(4095));
    mmap(page, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
}

/* Install the handler; map `len` bytes of a new file at `path` and truncate it to 0, so
 * that every touch of the region faults. */
int install_and_prepare(const char *path, size_t len, int longjmp_mode) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0) return -1;
    use_longjmp = longjmp_mode;
    FILE *f = fopen(path, "w+");
    if (!f) return -2;
    if (ftruncate(fileno(f), (off_t)len) != 0) return -3;
    region = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fileno(f), 0);
    region_len = len;
    if (region == MAP_FAILED) return -4;
    if (ftruncate(fileno(f), 0) != 0) return -5;
    fclose(f);
    return 0;
}

static void *touch(void *arg) {
    size_t page = (size_t)(uintptr_t)arg;
    volatile char *p = region + page * 4096;
    (void)*p;
    return NULL;
}

/* Fault in `n` threads at once (each on its own page); returns faults recovered. */
int fault_in_threads(int n) {
    pthread_t t[64];
    for (int i = 0; i < n && i < 64; i++) pthread_create(&t[i], NULL, touch, (void *)(uintptr_t)i);
    for (int i = 0; i < n && i < 64; i++) pthread_join(t[i], NULL);
    return atomic_load(&recovered);
}

/* Fault `k` times on the same page, each recovered by siglongjmp; returns faults. */
int fault_with_longjmp(int k) {
    sigjmp_buf buf;
    for (int i = 0; i < k; i++) {
        jump = &buf;
        if (sigsetjmp(buf, 1) == 0) {
            volatile char *p = region;
            (void)*p;
        }
        jump = NULL;
    }
    return atomic_load(&recovered);
}

/* The SIGBUS handler installed now (its address). */
uintptr_t current_sigbus_handler(void) {
    struct sigaction sa;
    sigaction(SIGBUS, NULL, &sa);
    return (uintptr_t)sa.sa_sigaction;
}

/* Install the handler over whatever is there (a program's handler set after shmq's). */
uintptr_t install_over(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGBUS, &sa, NULL);
    return (uintptr_t)handler;
}
