/* page-lock-probe.c - how fast the page cache of one file page-locks, and why.
 *
 *   cc -O2 -o /tmp/page-lock-probe scripts/page-lock-probe.c && /tmp/page-lock-probe FILE...
 *
 * For each FILE: mmap it, mlock it twice (the first faults in what is not cached; the second
 * is the page-locking alone, the part that cuMemHostRegister shares with mlock: walking the
 * page tables and taking every page), and read /proc/self/smaps for how much of the mapping the
 * kernel maps with PMD entries (FilePmdMapped: folios of 2 MiB, one entry each, locked at once).
 * A file whose page cache was made by small writes (a pull's 1 MiB pwrites, 4 KiB writes) is
 * held in small folios and mapped page by page. No GPU needed; root only for files not yours.
 * Session 15 (docs/benchmarks/NOTES.md) used it to explain why weights by reference loaded at
 * half the rate of the image's weights file. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* FilePmdMapped of the mapping that starts at addr, in KiB (-1 if not found) */
static long pmd_mapped_kib(void *addr) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int in = 0;
    long kib = -1;
    unsigned long start = (unsigned long)addr;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') == line + strspn(line, "0123456789abcdef")) {
            in = lo == start;
            continue;
        }
        if (in && sscanf(line, "FilePmdMapped: %ld kB", &kib) == 1)
            break;
    }
    if (f)
        fclose(f);
    return kib;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        int fd = open(argv[i], O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC); /* a FIFO must not block */
        struct stat st;
        if (fd < 0 || fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size == 0) {
            fprintf(stderr, "%s: not a readable, non-empty regular file\n", argv[i]);
            return 2;
        }
        size_t n = (size_t)st.st_size;
        char *p = mmap(NULL, n, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        double t0 = now();
        if (mlock(p, n)) {
            perror("mlock (raise ulimit -l)");
            return 1;
        }
        double t1 = now();
        long pmd = pmd_mapped_kib(p);
        munlock(p, n);
        double t2 = now();
        if (mlock(p, n)) {
            perror("mlock (second)");
            return 1;
        }
        double t3 = now();
        munlock(p, n);
        printf("%s: %.2f GiB, first mlock %.3f s, second %.3f s (%.1f GB/s), PMD-mapped %.0f %%\n", argv[i],
               n / 1073741824.0, t1 - t0, t3 - t2, n / (t3 - t2) / 1e9, pmd < 0 ? -1.0 : 100.0 * pmd * 1024 / n);
        munmap(p, n);
        close(fd);
    }
    return 0;
}
