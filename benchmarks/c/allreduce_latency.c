/* MPI_Allreduce latency in C: the baseline for benchmarks/mpi4py_vs_c.py.
 *
 *   mpicc -O2 -o allreduce_latency allreduce_latency.c
 *   mpiexec -n 2 ./allreduce_latency SMALLEST LARGEST [ITERS_SMALL ITERS_LARGE [single|multiple]]
 *
 * For each size (bytes, doubling from SMALLEST to LARGEST) it sums float32 arrays with
 * MPI_Allreduce, timed the way hpdl.bench.timeit times the mpi4py call, so the two are
 * comparable: warm-up calls, then per iteration a barrier, the clock, the call, the clock;
 * the median iteration on each rank, and the slowest rank's median. Rank 0 prints one line
 * per size: "bytes median_seconds".
 *
 * MPI starts the way mpi4py starts it by default: MPI_Init_thread with MPI_THREAD_MULTIPLE
 * (the fifth argument, "single", asks for MPI_THREAD_SINGLE instead, as mpi4py does with
 * MPI4PY_RC_THREAD_LEVEL=single). This matters: with MPICH 5 on 2 ranks here, the single
 * level made an 8-byte allreduce about 1 µs faster and medium and large ones (128 KiB to
 * 2 MiB) about 1.6x slower, in C and in mpi4py alike; compare like with like.
 *
 * Buffers are allocated the way numpy allocates large arrays on Linux (64-byte aligned; from
 * 4 MiB up, 2 MiB aligned and advised for transparent huge pages), so both sides hand MPI
 * the same kind of memory.
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void *buffer(size_t bytes) {
    size_t align = bytes >= (4u << 20) ? (2u << 20) : 64;
    size_t rounded = (bytes + align - 1) / align * align;
    void *p = NULL;
    if (posix_memalign(&p, align, rounded ? rounded : align) != 0) {
        fprintf(stderr, "out of memory for %zu bytes\n", bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
#ifdef MADV_HUGEPAGE
    if (bytes >= (4u << 20)) madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

int main(int argc, char **argv) {
    int provided, rank;
    int level = (argc > 5 && strcmp(argv[5], "single") == 0) ? MPI_THREAD_SINGLE : MPI_THREAD_MULTIPLE;
    MPI_Init_thread(&argc, &argv, level, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc < 3) {
        if (rank == 0) fprintf(stderr, "usage: %s SMALLEST LARGEST [ITERS_SMALL ITERS_LARGE [single|multiple]]\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    size_t smallest = strtoull(argv[1], NULL, 10), largest = strtoull(argv[2], NULL, 10);
    int iters_small = argc > 3 ? atoi(argv[3]) : 1000, iters_large = argc > 4 ? atoi(argv[4]) : 100;

    for (size_t bytes = smallest; bytes <= largest; bytes *= 2) {
        int count = (int)(bytes / sizeof(float));
        if (count < 1) count = 1;
        float *x = buffer(count * sizeof(float)), *out = buffer(count * sizeof(float));
        for (int i = 0; i < count; i++) x[i] = (float)(rank + 1), out[i] = 0.0f;

        int iters = bytes < (64u << 10) ? iters_small : iters_large;
        if (bytes >= (8u << 20) && iters > 30) iters = 30;
        int warmup = iters / 10 > 2 ? iters / 10 : 2;
        double *times = malloc(iters * sizeof(double));
        for (int i = 0; i < warmup; i++) MPI_Allreduce(x, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (int i = 0; i < iters; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(x, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            times[i] = MPI_Wtime() - t0;
        }
        qsort(times, iters, sizeof(double), compare);
        double median = iters % 2 ? times[iters / 2] : 0.5 * (times[iters / 2 - 1] + times[iters / 2]);
        double slowest;
        MPI_Reduce(&median, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) printf("%zu %.9e\n", (size_t)count * sizeof(float), slowest);
        fflush(stdout);
        free(times);
        free(x);
        free(out);
    }
    MPI_Finalize();
    return 0;
}
