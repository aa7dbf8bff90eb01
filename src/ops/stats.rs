//! The reference's stats, named as it names them and exported as its Prometheus sink does.
//!
//! Each stat has the reference's statsd name (`ratelimit.service.rate_limit.<key>.total_hits`);
//! the mapper turns the name into a series once, when the stat's handle is made, and the
//! handle counts into that series (and into statsd, when exported). Series are kept as
//! statsd_exporter's registry keeps them: one type per name, any label sets under it, a name
//! that would change type refused; a series shows from its first non-zero count, as the
//! reference flushes only counters that moved.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use metrics::{Counter, CounterFn};

use crate::ops::mapper::{Kind, Mapped, Mapper, Observer, Series};
use crate::ops::statsd::StatsdRecorder;

/// How long and how many observations a summary's quantiles are computed over (client_golang
/// keeps ten minutes; the count keeps memory flat under load).
const SUMMARY_WINDOW: Duration = Duration::from_secs(600);
const SUMMARY_SAMPLES: usize = 512;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Cells and maps are left consistent by every writer; a panic elsewhere changes nothing.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    Counter,
    Histogram,
    Summary,
}

impl Type {
    fn name(self) -> &'static str {
        match self {
            Type::Counter => "counter",
            Type::Histogram => "histogram",
            Type::Summary => "summary",
        }
    }
}

type Labels = Vec<(String, String)>;

struct Family {
    kind: Type,
    help: Arc<str>,
    series: BTreeMap<Labels, Arc<Cell>>,
}

enum Cell {
    Counter(CounterCell),
    Histogram(Mutex<Histogram>),
    Summary(Mutex<Summary>),
}

#[derive(Default)]
struct CounterCell {
    /// Unscaled counts: the common case, one atomic add.
    count: AtomicU64,
    /// Scaled counts, as f64 bits.
    scaled: AtomicU64,
    touched: AtomicBool,
}

impl CounterCell {
    fn add(&self, value: u64, scale: Option<f64>) {
        if value == 0 {
            return;
        }
        match scale {
            None => {
                self.count.fetch_add(value, Ordering::Relaxed);
            }
            Some(scale) => {
                let add = value as f64 * scale;
                let _ = self
                    .scaled
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                        Some((f64::from_bits(bits) + add).to_bits())
                    });
            }
        }
        if !self.touched.load(Ordering::Relaxed) {
            self.touched.store(true, Ordering::Relaxed);
        }
    }

    fn value(&self) -> f64 {
        self.count.load(Ordering::Relaxed) as f64
            + f64::from_bits(self.scaled.load(Ordering::Relaxed))
    }
}

struct Histogram {
    bounds: Arc<[f64]>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

struct Summary {
    quantiles: Arc<[f64]>,
    recent: VecDeque<(Instant, f64)>,
    sum: f64,
    count: u64,
}

/// A counter of one stat: its series and its statsd cell.
struct StatCounter {
    cell: Option<Arc<Cell>>,
    scale: Option<f64>,
    statsd: Option<Counter>,
}

impl CounterFn for StatCounter {
    fn increment(&self, value: u64) {
        if let Some(Cell::Counter(cell)) = self.cell.as_deref() {
            cell.add(value, self.scale);
        }
        if let Some(statsd) = &self.statsd {
            statsd.increment(value);
        }
    }

    fn absolute(&self, _: u64) {}
}

/// A timer of one stat, observed in milliseconds as the reference times.
#[derive(Clone)]
pub struct Timer {
    cell: Option<Arc<Cell>>,
    scale: Option<f64>,
}

impl Timer {
    pub fn observe(&self, elapsed: Duration) {
        let value = elapsed.as_secs_f64() * 1000.0 * self.scale.unwrap_or(1.0);
        match self.cell.as_deref() {
            Some(Cell::Histogram(h)) => {
                let mut h = lock(h);
                let bucket = h.bounds.iter().position(|b| value <= *b);
                if let Some(i) = bucket {
                    h.counts[i] += 1;
                }
                h.sum += value;
                h.count += 1;
            }
            Some(Cell::Summary(s)) => {
                let mut s = lock(s);
                let now = Instant::now();
                while s.recent.len() >= SUMMARY_SAMPLES
                    || s.recent
                        .front()
                        .is_some_and(|(t, _)| now - *t > SUMMARY_WINDOW)
                {
                    s.recent.pop_front();
                }
                s.recent.push_back((now, value));
                s.sum += value;
                s.count += 1;
            }
            _ => {}
        }
    }
}

/// The reference's stats of one service.
pub struct Stats {
    mapper: Mapper,
    families: Mutex<BTreeMap<String, Family>>,
    statsd: Option<StatsdRecorder>,
}

impl Stats {
    pub fn new(mapper: Mapper, statsd: Option<StatsdRecorder>) -> Stats {
        Stats {
            mapper,
            families: Mutex::default(),
            statsd,
        }
    }

    /// The counter named `name` in statsd form.
    pub fn counter(&self, name: &str) -> Counter {
        let statsd = self.statsd.as_ref().map(|s| s.counter(name));
        let (cell, scale) = match self.mapper.map_or_escape(name, Kind::Counter) {
            Mapped::Drop => (None, None),
            Mapped::Series(series) => {
                let scale = series.scale;
                (self.cell(series, Type::Counter), scale)
            }
        };
        Counter::from_arc(Arc::new(StatCounter {
            cell,
            scale,
            statsd,
        }))
    }

    /// The timer named `name` in statsd form.
    pub fn timer(&self, name: &str) -> Timer {
        match self.mapper.map_or_escape(name, Kind::Observer) {
            Mapped::Drop => Timer {
                cell: None,
                scale: None,
            },
            Mapped::Series(series) => {
                let kind = match series.observer {
                    Observer::Histogram(_) => Type::Histogram,
                    Observer::Summary(_) => Type::Summary,
                };
                let scale = series.scale;
                Timer {
                    cell: self.cell(series, kind),
                    scale,
                }
            }
        }
    }

    /// The cell of `series`, made on first use; `None` when its name is taken by another type.
    fn cell(&self, series: Series, kind: Type) -> Option<Arc<Cell>> {
        let mut families = lock(&self.families);
        if conflicts(&families, &series.name, kind) {
            tracing::debug!(name = %series.name, "a stat maps to a series of another type");
            return None;
        }
        let family = families
            .entry(series.name.clone())
            .or_insert_with(|| Family {
                kind,
                help: Arc::clone(&series.help),
                series: BTreeMap::new(),
            });
        if let Some(cell) = family.series.get(&series.labels) {
            return Some(Arc::clone(cell));
        }
        let cell = Arc::new(match &series.observer {
            _ if kind == Type::Counter => Cell::Counter(CounterCell::default()),
            Observer::Histogram(bounds) => Cell::Histogram(Mutex::new(Histogram {
                counts: vec![0; bounds.len()],
                bounds: Arc::clone(bounds),
                sum: 0.0,
                count: 0,
            })),
            Observer::Summary(quantiles) => Cell::Summary(Mutex::new(Summary {
                quantiles: Arc::clone(quantiles),
                recent: VecDeque::new(),
                sum: 0.0,
                count: 0,
            })),
        });
        family.series.insert(series.labels, Arc::clone(&cell));
        Some(cell)
    }

    /// The series that have counted, in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let families = lock(&self.families);
        for (name, family) in families.iter() {
            let mut body = String::new();
            for (labels, cell) in &family.series {
                render_series(&mut body, name, labels, cell);
            }
            if body.is_empty() {
                continue;
            }
            let help = family.help.replace('\\', "\\\\").replace('\n', "\\n");
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {}", family.kind.name());
            out.push_str(&body);
        }
    }
}

/// Whether `name` of `kind` would clash with a series already there, as statsd_exporter's
/// registry refuses it (a histogram's or summary's own suffixes included).
fn conflicts(families: &BTreeMap<String, Family>, name: &str, kind: Type) -> bool {
    let other = |n: &str, k: Type| families.get(n).is_some_and(|f| f.kind != k);
    if other(name, kind) {
        return true;
    }
    match kind {
        Type::Counter => ["_bucket", "_count", "_sum"]
            .iter()
            .filter_map(|s| name.strip_suffix(s))
            .any(|base| other(base, Type::Counter)),
        Type::Histogram => ["_sum", "_count", "_bucket"]
            .iter()
            .any(|s| other(&format!("{name}{s}"), kind)),
        Type::Summary => ["_sum", "_count"]
            .iter()
            .any(|s| other(&format!("{name}{s}"), kind)),
    }
}

fn render_series(out: &mut String, name: &str, labels: &Labels, cell: &Cell) {
    match cell {
        Cell::Counter(c) => {
            if c.touched.load(Ordering::Relaxed) {
                sample(out, name, "", labels, None, c.value());
            }
        }
        Cell::Histogram(h) => {
            let h = lock(h);
            if h.count == 0 {
                return;
            }
            let mut cumulative = 0;
            for (bound, count) in h.bounds.iter().zip(&h.counts) {
                cumulative += count;
                let le = go_float(*bound);
                sample(
                    out,
                    name,
                    "_bucket",
                    labels,
                    Some(("le", &le)),
                    cumulative as f64,
                );
            }
            sample(
                out,
                name,
                "_bucket",
                labels,
                Some(("le", "+Inf")),
                h.count as f64,
            );
            sample(out, name, "_sum", labels, None, h.sum);
            sample(out, name, "_count", labels, None, h.count as f64);
        }
        Cell::Summary(s) => {
            let s = lock(s);
            if s.count == 0 {
                return;
            }
            let mut sorted: Vec<f64> = s.recent.iter().map(|(_, v)| *v).collect();
            sorted.sort_by(f64::total_cmp);
            for q in s.quantiles.iter() {
                let value = if sorted.is_empty() {
                    f64::NAN
                } else {
                    let rank = (q * sorted.len() as f64).ceil() as usize;
                    sorted[rank.clamp(1, sorted.len()) - 1]
                };
                let quantile = go_float(*q);
                sample(out, name, "", labels, Some(("quantile", &quantile)), value);
            }
            sample(out, name, "_sum", labels, None, s.sum);
            sample(out, name, "_count", labels, None, s.count as f64);
        }
    }
}

fn sample(
    out: &mut String,
    name: &str,
    suffix: &str,
    labels: &Labels,
    extra: Option<(&str, &str)>,
    value: f64,
) {
    out.push_str(name);
    out.push_str(suffix);
    let all: Vec<(&str, &str)> = labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain(extra)
        .collect();
    if !all.is_empty() {
        out.push('{');
        for (i, (k, v)) in all.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            let _ = write!(out, "{k}=\"{v}\"");
        }
        out.push('}');
    }
    let _ = writeln!(out, " {}", go_float(value));
}

/// A number as Go's `strconv.FormatFloat(v, 'g', -1, 64)` writes it, as the Prometheus
/// client the reference uses does: shortest digits, exponent form from 1e+06 and below 1e-04.
pub(crate) fn go_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    if value == 0.0 {
        return "0".into();
    }
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..6).contains(&exponent) {
        format!("{value}")
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_go_writes_them() {
        let rows = [
            (3.0, "3"),
            (0.5, "0.5"),
            (0.005, "0.005"),
            (123456.0, "123456"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (f64::INFINITY, "+Inf"),
        ];
        for (value, text) in rows {
            assert_eq!(go_float(value), text, "{value}");
        }
    }

    #[test]
    fn a_name_keeps_its_first_type() {
        let mapper = Mapper::from_yaml(
            "mappings:\n- {match: a.*, name: same, timer_type: histogram}\n- {match: b.*, name: same}\n",
        )
        .unwrap();
        let stats = Stats::new(mapper, None);
        stats.counter("b.x").increment(2);
        stats.timer("a.x").observe(Duration::from_millis(3));
        let mut text = String::new();
        stats.render(&mut text);
        assert_eq!(
            text,
            "# HELP same Metric autogenerated by statsd_exporter.\n# TYPE same counter\nsame 2\n"
        );
    }
}
