//! The process series every Prometheus client library exports (`process_*`).
//!
//! The reference's sink registers on the Go client's default registry, which carries them, and
//! dashboards read them (Envoy Gateway's rate-limit dashboard charts resident and virtual
//! memory). They are read from `/proc` at each scrape, so they cost nothing between scrapes.

use std::fmt::Write;

use crate::ops::stats::go_float;

/// The `process_*` series, in the Prometheus text format; nothing where `/proc` is not.
pub fn render(out: &mut String) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command, which is in parentheses and may hold spaces.
    let Some((_, after)) = stat.rsplit_once(')') else {
        return;
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<f64>().ok());
    // SAFETY: sysconf reads a constant of the system and has no preconditions.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK) as f64,
            libc::sysconf(libc::_SC_PAGESIZE) as f64,
        )
    };
    let mut gauge = |name: &str, help: &str, kind: &str, value: Option<f64>| {
        if let Some(value) = value {
            let value = go_float(value);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
    };
    if let (Some(user), Some(system)) = (field(14), field(15)) {
        let seconds = (user + system) / ticks;
        gauge(
            "process_cpu_seconds_total",
            "CPU time used in user and system mode, in seconds.",
            "counter",
            Some(seconds),
        );
    }
    let open = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as f64);
    gauge(
        "process_open_fds",
        "File descriptors open now.",
        "gauge",
        open.ok(),
    );
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft = |row: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(row))
            .and_then(|l| l[row.len()..].split_whitespace().next())
            .map(|v| v.parse::<f64>().unwrap_or(u64::MAX as f64))
    };
    gauge(
        "process_max_fds",
        "Most file descriptors the process may open.",
        "gauge",
        soft("Max open files"),
    );
    gauge(
        "process_virtual_memory_bytes",
        "Virtual memory size, in bytes.",
        "gauge",
        field(23),
    );
    gauge(
        "process_virtual_memory_max_bytes",
        "Most virtual memory the process may map, in bytes.",
        "gauge",
        soft("Max address space"),
    );
    gauge(
        "process_resident_memory_bytes",
        "Resident memory size, in bytes.",
        "gauge",
        field(24).map(|pages| pages * page),
    );
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    gauge(
        "process_start_time_seconds",
        "When the process started, in seconds since the Unix epoch.",
        "gauge",
        boot.zip(field(22))
            .map(|(boot, start)| boot + start / ticks),
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_process_series_are_read_from_proc() {
        let mut text = String::new();
        super::render(&mut text);
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        assert!(value("process_virtual_memory_max_bytes") > 0.0);
        assert!(value("process_cpu_seconds_total") >= 0.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(
            started <= now + 1.0 && started > now - 86_400.0 * 365.0,
            "{started}"
        );
    }
}
