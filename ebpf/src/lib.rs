//! The BPF object and its record layouts.
