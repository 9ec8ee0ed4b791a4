/* kernel.h: the few kernel types ringwatch's BPF programs read, declared by hand.
 *
 * Every struct is marked preserve_access_index, so clang records CO-RE
 * relocations and libbpf/aya fix the field offsets against the running
 * kernel's BTF at load time. Declare only the fields we read; never copy a
 * generated vmlinux.h here (3 MB, tied to one kernel).
 */
#pragma once

#include <linux/types.h>

typedef int pid_t;

struct task_struct {
	pid_t pid;
	pid_t tgid;
} __attribute__((preserve_access_index));
