//! The Redis I/O thread's scheduler slice: how soon it runs when woken.
//!
//! The I/O thread works in short bursts that requests wait for. Linux's scheduler (EEVDF)
//! often puts a woken thread on its waker's CPU, behind the waker's slice, while another CPU
//! is idle; a shorter slice gives it an earlier deadline, so it runs at once, with its share
//! of the CPU unchanged (measured in BENCHMARKS.md). Linux 6.12 and later take a slice for
//! ordinary threads (`sched_setattr`'s `sched_runtime`, no privilege needed); earlier kernels
//! ignore it. Real-time threads (an operator's `chrt`) keep their policy untouched.

use std::io;
use std::time::Duration;

use super::threads;

/// Give the I/O thread `slice` (from the thread itself, by a task it runs).
pub(super) fn give_io_thread(slice: Duration) {
    threads::io().spawn(async move {
        if let Err(error) = set_for_this_thread(slice) {
            tracing::debug!(%error, ?slice, "the kernel took no slice for the Redis I/O thread");
        }
    });
}

/// Give the calling thread `slice`, keeping its policy, nice value and flags.
#[cfg(target_os = "linux")]
fn set_for_this_thread(slice: Duration) -> io::Result<()> {
    // The struct's first version (48 bytes), which every kernel with sched_setattr reads.
    let size = std::mem::size_of::<libc::sched_attr>();
    // SAFETY: sched_attr is plain integers, for which zero is a value.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most `size` bytes into `attr`, which holds that many.
    let got = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &raw mut attr,
            size as libc::c_uint,
            0,
        )
    };
    if got != 0 {
        return Err(io::Error::last_os_error());
    }
    let policy = i32::try_from(attr.sched_policy).unwrap_or(-1);
    if policy != libc::SCHED_OTHER && policy != libc::SCHED_BATCH {
        return Ok(());
    }
    attr.size = size as u32;
    attr.sched_runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: the kernel reads `attr.size` bytes of `attr`, which holds that many.
    let set = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const attr, 0) };
    if set != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn set_for_this_thread(_slice: Duration) -> io::Result<()> {
    Ok(())
}
