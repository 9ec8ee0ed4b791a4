//! `tuner`: Bayesian optimization of a collective runtime's knobs.
//!
//! A pure library: it is given observations and returns suggestions. It never
//! does I/O, reads a clock or starts threads, so the same observations (and
//! seed) always give the same suggestions.
