//! The process: the command line (`cli`, its flags in groups), start-up and shutdown (`run`
//! builds every part in named steps, `ports` serves them), the `explain` command, and what
//! the allocator gives back to the OS.
//!
//! The top of the layers: it may import every other folder, and none imports it.

pub mod allocator;
pub mod cli;
pub mod explain;
mod ports;
pub mod run;
