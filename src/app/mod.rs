//! The process: the command line, start-up and shutdown (`run` builds every part and serves
//! them), the `explain` command, and what the allocator gives back to the OS.
//!
//! The top of the layers: it may import every other folder, and none imports it.

pub mod allocator;
pub mod cli;
pub mod explain;
pub mod run;
