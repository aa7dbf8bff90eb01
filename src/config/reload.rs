//! Rules reload when their files change: validate the whole set, then swap it in; a bad
//! edit is reported and the rules in force stay.
//!
//! The watch is on directories (the config directory, or the parent of a config file, and
//! for the reference's runtime layout the parent of its root), not on the files: editors save by renaming over the file, `cp` truncates and rewrites
//! it, and Kubernetes swaps a `..data` symlink to a new directory — all of these show up as
//! events in the directory, where a file watch would lose track. Events are debounced so a
//! burst of writes (many files, a half-written file) is read once, after it settles. The
//! version hash makes a reload of identical content a no-op. SIGHUP forces a reload. Where
//! inotify is unavailable, the directory is polled instead. Files are read and validated on a
//! blocking thread, so a large set takes none of the runtime's workers (which serve the
//! admin and metrics ports) while it loads.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::{PollWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::config::Source;
use crate::config::active::ActiveRules;
use crate::ops::metrics::Metrics;
use crate::ops::rules_series::RulesSeries;

/// Quiet time after the last file event before the rules are read.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// New rules are in force.
    Swapped { version: String },
    /// The files hold the rules already in force.
    Unchanged,
    /// The files are invalid; the rules in force stay.
    Rejected,
}

pub struct Reloader {
    source: Source,
    rules: Arc<ActiveRules>,
    series: RulesSeries,
}

impl Reloader {
    pub fn new(source: Source, rules: Arc<ActiveRules>, metrics: Arc<Metrics>) -> Reloader {
        Reloader {
            source,
            rules,
            series: RulesSeries::new(metrics),
        }
    }

    /// Read and validate the files; swap them in only if they are valid and different.
    pub fn reload(&self) -> Reloaded {
        match self.source.load() {
            Ok(rules) if rules.version() == self.rules.current().rules.version() => {
                self.series.unchanged();
                Reloaded::Unchanged
            }
            Ok(rules) => {
                let version = rules.version().to_owned();
                self.rules.replace(rules);
                self.series.loaded(&version);
                tracing::info!(%version, "rules reloaded");
                Reloaded::Swapped { version }
            }
            Err(errors) => {
                self.series.refused();
                for error in &errors.0 {
                    tracing::error!(%error, "rules not reloaded; the previous rules stay in force");
                }
                Reloaded::Rejected
            }
        }
    }

    /// Watch the files (and SIGHUP) and reload on change, forever: the returned future. The
    /// watch starts now, and the files are read once more once it has, so that an edit made
    /// since they were first read is not lost (no event would ever come for it); a reload of
    /// identical content is a no-op. `poll` forces polling at that period instead of inotify.
    pub fn watch(self, poll: Option<Duration>) -> impl Future<Output = ()> + Send + 'static {
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let watchers: Vec<_> = self
            .source
            .watch
            .iter()
            .filter_map(|(dir, recursive)| {
                start_watcher(dir, *recursive, poll, tx.clone())
                    .inspect_err(|error| {
                        tracing::error!(%error, dir = %dir.display(), "cannot watch rules; reload with SIGHUP");
                    })
                    .ok()
            })
            .collect();
        self.reload();
        let this = Arc::new(self);
        async move {
            // Keep the watchers alive for as long as this task runs.
            let _watchers = watchers;
            tokio::spawn(forward_sighup(tx));
            while rx.recv().await.is_some() {
                // Debounce: wait until events stop for DEBOUNCE, then read once.
                loop {
                    match tokio::time::timeout(DEBOUNCE, rx.recv()).await {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break,
                    }
                }
                let reloader = Arc::clone(&this);
                if let Err(error) = tokio::task::spawn_blocking(move || reloader.reload()).await {
                    tracing::error!(%error, "rules not reloaded; the previous rules stay in force");
                }
            }
        }
    }
}

fn start_watcher(
    dir: &Path,
    recursive: bool,
    poll: Option<Duration>,
    tx: mpsc::UnboundedSender<()>,
) -> notify::Result<Box<dyn Watcher + Send>> {
    let handler = move |event: notify::Result<notify::Event>| {
        // Access events (reads) change nothing.
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = tx.send(());
        }
    };
    let mut watcher: Box<dyn Watcher + Send> = match poll {
        Some(period) => Box::new(PollWatcher::new(
            handler,
            notify::Config::default()
                .with_poll_interval(period)
                .with_compare_contents(true),
        )?),
        None => match notify::recommended_watcher(handler.clone()) {
            Ok(watcher) => Box::new(watcher),
            Err(error) => {
                tracing::warn!(%error, "inotify unavailable; polling the rules every second");
                Box::new(PollWatcher::new(
                    handler,
                    notify::Config::default()
                        .with_poll_interval(Duration::from_secs(1))
                        .with_compare_contents(true),
                )?)
            }
        },
    };
    let mode = if recursive {
        RecursiveMode::Recursive
    } else {
        RecursiveMode::NonRecursive
    };
    watcher.watch(dir, mode)?;
    Ok(watcher)
}

async fn forward_sighup(tx: mpsc::UnboundedSender<()>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP");
        return;
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP: reloading rules");
        if tx.send(()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(limit: u32) -> String {
        format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
        )
    }

    /// An edit made after the rules were first read but before the watch started would never
    /// raise an event: the watch reads the files once more as it starts.
    #[test]
    fn an_edit_made_before_the_watch_starts_is_read_as_it_starts() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.yaml");
        std::fs::write(&file, rules(1)).unwrap();
        let source = Source::path(dir.path().to_path_buf(), false);
        let first = source.load().expect("valid rules");
        let first_version = first.version().to_owned();
        let active = Arc::new(ActiveRules::new(first));
        std::fs::write(&file, rules(2)).unwrap();
        let metrics = Arc::new(Metrics::new(0.8, 100));
        // Polled hourly and never run: only the start can have read the edit.
        let _watch = Reloader::new(source, Arc::clone(&active), metrics)
            .watch(Some(Duration::from_secs(3_600)));
        let now = active.current();
        assert_ne!(now.rules.version(), first_version);
        let edited = Source::path(dir.path().to_path_buf(), false).load();
        assert_eq!(now.rules.version(), edited.expect("valid rules").version());
    }
}
