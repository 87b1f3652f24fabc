/*
 * A probe of how fast this machine runs right now, to read beside the shared perf harness
 * (benches/round_costs.py `probe`; BENCHMARKS.md, "Why one round is slower than another").
 *
 *     cc -O2 -o target/cache_probe benches/cache_probe.c
 *     target/cache_probe > probe.txt &
 *
 * Every half second it times, in its own thread's CPU time (so time it spent preempted does
 * not count), two fixed pieces of work and prints one line: the time in seconds since the
 * epoch, then nanoseconds for each.
 *   - alu: 400,000 rounds of a multiply and shift (no memory): the core's speed.
 *   - chase: 10,000 dependent loads along a random cycle through 1 MiB: the latency of the
 *     caches and memory it shares with everything else on the machine.
 * It keeps a core about 0.4% busy.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SLOTS (1u << 18) /* 1 MiB of uint32_t */

static uint32_t next_slot[SLOTS];

static uint64_t now_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(void) {
    /* Sattolo's shuffle: one cycle through every slot, in random order. */
    for (uint32_t i = 0; i < SLOTS; i++) next_slot[i] = i;
    srand(1);
    for (uint32_t i = SLOTS - 1; i > 0; i--) {
        uint32_t j = (uint32_t)rand() % i, t = next_slot[i];
        next_slot[i] = next_slot[j];
        next_slot[j] = t;
    }
    volatile uint64_t sink = 0;
    for (;;) {
        uint64_t t0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
        uint64_t x = 1;
        for (int i = 0; i < 400000; i++) {
            x = x * 6364136223846793005u + 1442695040888963407u;
            x ^= x >> 17;
        }
        uint64_t t1 = now_ns(CLOCK_THREAD_CPUTIME_ID);
        uint32_t p = 0;
        for (int i = 0; i < 10000; i++) p = next_slot[p];
        uint64_t t2 = now_ns(CLOCK_THREAD_CPUTIME_ID);
        sink += x + p;
        printf("%.2f %llu %llu\n", (double)now_ns(CLOCK_REALTIME) / 1e9,
               (unsigned long long)(t1 - t0), (unsigned long long)(t2 - t1));
        fflush(stdout);
        usleep(500000);
    }
}
