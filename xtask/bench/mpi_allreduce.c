/* mpi_allreduce: times MPI_Allreduce (sum of float32) for `cargo xtask bench
 * compare`, the way collbench sweep times ours.
 *
 * Usage: mpirun -np N mpi_allreduce WARMUP BYTES:ITERS [BYTES:ITERS ...]
 *
 * For every size: each rank fills its send buffer with rank+1; one checked
 * call (every element must be n(n+1)/2), WARMUP untimed calls, a barrier,
 * then ITERS timed calls (out of place: the send buffer never changes, so
 * the result is checked again after them). Rank 0 prints one line per size,
 *   allreduce bytes=B count=C warmup=W iters=I time_us=T wrong=K
 * where T is rank 0's mean wall time per call and K the wrong elements over
 * every rank (xtask/src/compare.rs parses it). It measures; it never
 * changes what it times.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static long count_wrong(const float *values, long count, float want) {
    long wrong = 0;
    for (long i = 0; i < count; i++) {
        if (values[i] != want) {
            wrong++;
        }
    }
    return wrong;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, ranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    char *end = NULL;
    long warmup = argc > 2 ? strtol(argv[1], &end, 10) : -1;
    if (argc < 3 || warmup < 0 || *end != '\0') {
        if (rank == 0) {
            fprintf(stderr, "usage: mpi_allreduce WARMUP BYTES:ITERS [BYTES:ITERS ...]\n");
        }
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* Exact in float32 for any realistic number of ranks. */
    const float want = (float)ranks * (float)(ranks + 1) / 2.0f;
    for (int arg = 2; arg < argc; arg++) {
        long bytes = 0, iters = 0;
        char tail = 0;
        if (sscanf(argv[arg], "%ld:%ld%c", &bytes, &iters, &tail) != 2 || bytes < 4 ||
            bytes % 4 != 0 || bytes > (1L << 40) || iters < 1) {
            if (rank == 0) {
                fprintf(stderr, "mpi_allreduce: %s is not BYTES:ITERS (BYTES a multiple of 4)\n",
                        argv[arg]);
            }
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        long count = bytes / 4;
        if (count > 0x7fffffffL) {
            if (rank == 0) {
                fprintf(stderr, "mpi_allreduce: %ld bytes is more than MPI's int count\n", bytes);
            }
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        float *send = malloc((size_t)bytes);
        float *recv = malloc((size_t)bytes);
        if (send == NULL || recv == NULL) {
            fprintf(stderr, "mpi_allreduce (rank %d): cannot allocate 2 x %ld bytes\n", rank,
                    bytes);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        for (long i = 0; i < count; i++) {
            send[i] = (float)(rank + 1);
            recv[i] = 0.0f;
        }
        MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long wrong = count_wrong(recv, count, want);
        for (long i = 0; i < warmup; i++) {
            MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        for (long i = 0; i < iters; i++) {
            MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
        double seconds = (MPI_Wtime() - start) / (double)iters;
        wrong += count_wrong(recv, count, want);
        long wrong_everywhere = 0;
        MPI_Reduce(&wrong, &wrong_everywhere, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("allreduce bytes=%ld count=%ld warmup=%ld iters=%ld time_us=%.3f wrong=%ld\n",
                   bytes, count, warmup, iters, seconds * 1e6, wrong_everywhere);
            fflush(stdout);
        }
        free(send);
        free(recv);
    }
    MPI_Finalize();
    return 0;
}
