/* ringwatch.bpf.c: the one BPF object the agent embeds.
 *
 * A single translation unit: each concern lives in its own *.bpf.c file,
 * included here, so they share the maps without a BPF linker step.
 * Build: `cargo xtask build-ebpf` (or any cargo build of the agent).
 */
#include <stdbool.h>
#include <linux/types.h>
#include <linux/bpf.h>
#include <asm/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>

#include "kernel.h"
#include "ringwatch.h"
#include "maps.bpf.h"

#include "sched.bpf.c"
#include "tcp.bpf.c"
#include "nccl.bpf.c"

char LICENSE[] SEC("license") = "Dual BSD/GPL";
