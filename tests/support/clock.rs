//! Fixed windows end on the clock that turnstile, Redis and the tests share: a minute's at each
//! minute, an hour's at each hour (epoch-aligned). A test that counts exactly within one
//! window first waits out an end that would fall inside its run, or its count would restart
//! midway (a CI run failed so).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const MINUTE: Duration = Duration::from_secs(60);
pub const HOUR: Duration = Duration::from_secs(3_600);
/// Longer than a few calls in a row take: the margin for a test that counts them exactly.
pub const CALLS_SPAN: Duration = Duration::from_secs(2);

/// How far past an end the wait goes, so the run starts clearly inside the next window.
const PAST_THE_END: Duration = Duration::from_millis(50);

/// Wait, if needed, so that the next `margin` holds no end of `window`: until just past the
/// coming end if it falls within `margin`.
pub async fn clear_of_end(window: Duration, margin: Duration) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is past 1970");
    let window_ns = window.as_nanos();
    let left = Duration::from_nanos((window_ns - now.as_nanos() % window_ns) as u64);
    if left < margin {
        tokio::time::sleep(left + PAST_THE_END).await;
    }
}
