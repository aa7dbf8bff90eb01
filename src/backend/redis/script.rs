//! The batch script and its calls: the algorithms' Lua twins plus the batch driver, assembled
//! once. A server that takes functions (Redis 7) runs it as a function library (`FCALL`),
//! which keeps the twins between calls where a script makes them anew on every one
//! (`twins`); the library is loaded (`FUNCTION LOAD`) by the first call that finds it missing
//! (a new server, a restart, `FUNCTION FLUSH`). A server that has no functions, or a user
//! not allowed them, runs it by hash (`EVALSHA`), and a server that does not know the hash
//! (after SCRIPT FLUSH, a restart or a failover) gets the full text once (EVAL, which also
//! caches it). Both on whatever connection type, Cluster included: `FCALL` and `EVAL` are
//! routed by their first key like `EVALSHA`, and a Cluster client sends `FUNCTION LOAD` to
//! every master. Not the `redis` crate's `Script`: it has no function library, and it reloads
//! a lost script with `SCRIPT LOAD` then `EVALSHA` again, one round trip more than `EVAL`.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ::redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, ServerErrorKind, Value};
use indexmap::IndexSet;

use super::connect::Pool;
use super::{KeyLayout, Wait, twins};
use crate::algorithm::Micros;
use crate::decision::{BackendError, Hit, Outcome, PermitOp, Role};

/// The script text and its SHA-1, and the same as a function library, computed once.
struct Batch {
    source: String,
    sha1: String,
    library: String,
    /// The library's name and its function's: the script's hash in it, so builds whose
    /// scripts differ never replace each other's on a server they share.
    function: String,
}

static BATCH: LazyLock<Batch> = LazyLock::new(|| {
    let driver = include_str!("../../../lua/batch.lua");
    let source = twins::script(driver).expect("lua/batch.lua defines batch, closed at its end");
    let sha1 = sha1_smol::Sha1::from(&source).digest().to_string();
    let function = format!("turnstile_batch_{sha1}");
    Batch {
        library: twins::library(driver, &function),
        source,
        sha1,
        function,
    }
});

/// The batch script's text, as turnstile loads it (`turnstile redis-script`: to preload it,
/// or to run it from a benchmark exactly as turnstile does), and its SHA-1, the hash turnstile
/// calls it by (`EVALSHA`).
pub fn batch_source() -> (&'static str, &'static str) {
    (&BATCH.source, &BATCH.sha1)
}

/// The batch script as the function library turnstile loads on Redis 7, and its function's
/// name (`turnstile redis-script --library`).
pub fn batch_library() -> (&'static str, &'static str) {
    (&BATCH.library, &BATCH.function)
}

/// A script of another module (RLQS shares), with its SHA-1 for EVALSHA.
#[derive(Clone)]
pub struct Lua {
    source: &'static str,
    sha1: String,
}

impl Lua {
    pub fn new(source: &'static str) -> Lua {
        let sha1 = sha1_smol::Sha1::from(source).digest().to_string();
        Lua { source, sha1 }
    }
}

/// Run `lua` on one key: by hash, and by text if the server lost the script.
pub(super) async fn run_lua(
    pool: &Pool,
    lua: &Lua,
    key: &str,
    args: &[String],
) -> RedisResult<i64> {
    let command = |verb: &str, script: &str| {
        let mut cmd = ::redis::cmd(verb);
        cmd.arg(script).arg(1).arg(key).arg(args);
        cmd
    };
    by_hash(pool, command, &lua.sha1, lua.source, None).await
}

/// Run a script by hash, and by text (which also caches it) if the server lost it;
/// `command(verb, script)` is the call with that verb and the hash or the text; `wait`: the
/// replicas it waits for.
async fn by_hash<T: FromRedisValue>(
    pool: &Pool,
    command: impl Fn(&str, &str) -> Cmd,
    sha1: &str,
    source: &str,
    wait: Option<Wait>,
) -> RedisResult<T> {
    match pool.query_replicated(&command("EVALSHA", sha1), wait).await {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            pool.query_replicated(&command("EVAL", source), wait).await
        }
        result => result,
    }
}

/// What a call does with the hits it carries (see `lua/batch.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Charge the admitted hits only if the request passes.
    Atomic,
    /// Charge every admitted hit.
    PerDescriptor,
    /// Charge nothing.
    Check,
    /// Undo a `PerDescriptor` call with the same nonce.
    Refund,
}

impl Mode {
    /// The letter that opens a request's shape.
    fn letter(self) -> char {
        match self {
            Mode::Atomic => 'a',
            Mode::PerDescriptor => 'p',
            Mode::Check => 'c',
            Mode::Refund => 'r',
        }
    }
}

fn role_letter(role: Role) -> &'static str {
    match role {
        Role::Enforce => "e",
        Role::Shadow => "s",
        Role::Quota => "q",
    }
}

/// The latest deadline a ticket holds: 16 digits of microseconds (the year 2286).
const MAX_DEADLINE: i64 = 9_999_999_999_999_999;

/// A request's nonce: it names the request's sliding-window entries, so a refund removes
/// exactly them, and spreads its counters' expiries. Always 12 alphanumerics: the script
/// finds each request's ticket at a fixed place among its run's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Nonce([u8; 12]);

impl Nonce {
    /// A fresh one per request: 12 alphanumerics (~71 bits) keep the log entries short.
    pub(super) fn new() -> Nonce {
        // ASCII, so each character is one byte.
        Nonce(std::array::from_fn(|_| fastrand::alphanumeric() as u8))
    }
}

/// A limit as the script receives it: once per call, whatever number of hits share it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Spec {
    algorithm: &'static str,
    limit: u32,
    window: u64,
    burst: u32,
    role: &'static str,
}

/// One hit of a part: its spec, cost, permit (`+<id>` taken, `-<id>` given back) and, for a
/// refund, the stamp its charge replied.
struct PartHit {
    spec: Spec,
    cost: u64,
    permit: Option<String>,
    stamp: i64,
}

/// One request's share of a script call: its mode, nonce and hits (see `lua/batch.lua`).
pub(super) struct Part {
    mode: Mode,
    nonce: Nonce,
    keys: Vec<String>,
    hits: Vec<PartHit>,
    /// Its keys' and permits' bytes.
    bytes: usize,
}

impl Part {
    pub(super) fn new(mode: Mode, nonce: Nonce) -> Part {
        Part {
            mode,
            nonce,
            keys: Vec::new(),
            hits: Vec::new(),
            bytes: 0,
        }
    }

    /// Add one hit costing `cost` units; a refund passes the `stamp` its charge replied.
    pub(super) fn push(
        &mut self,
        key: String,
        hit: &Hit,
        cost: u64,
        stamp: Option<i64>,
        layout: KeyLayout,
    ) {
        let limit = &hit.limit;
        let permit = hit.permit.as_ref().map(|(op, id)| match op {
            PermitOp::Acquire => format!("+{id}"),
            PermitOp::Release => format!("-{id}"),
        });
        self.bytes += key.len() + permit.as_ref().map_or(0, String::len);
        self.keys.push(key);
        self.hits.push(PartHit {
            spec: Spec {
                algorithm: layout.script_algorithm(limit),
                limit: limit.requests_per_unit,
                window: limit.window,
                burst: limit.burst,
                role: role_letter(hit.role),
            },
            cost,
            permit,
            stamp: stamp.unwrap_or_default(),
        });
    }

    /// How many hits it carries.
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// How many bytes of keys and permits it carries.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The key its call is routed by (on a Cluster, every key of a part shares its slot).
    pub(super) fn first_key(&self) -> Option<&str> {
        self.keys.first().map(String::as_str)
    }
}

/// One script call: the parts of the requests it decides, each with its deadline
/// (microseconds on Redis' clock; 0: none; past it the script decides nothing of that request
/// and charges nothing).
pub(super) struct Call<'a> {
    parts: Vec<(&'a Part, i64)>,
    /// The time to decide at instead of Redis TIME (differential tests only; see
    /// `RedisBackend::evaluate_at`).
    at: Option<Micros>,
    /// The parts' deadlines' earliest (0: none).
    earliest: i64,
    /// The hits' distinct specs, in order of first use.
    specs: IndexSet<Spec>,
    /// Each hit's spec, as its index in `specs`, part after part.
    spec_of: Vec<usize>,
}

impl<'a> Call<'a> {
    pub(super) fn new(parts: Vec<(&'a Part, i64)>, at: Option<Micros>) -> Call<'a> {
        let earliest = parts.iter().map(|&(_, d)| d).filter(|&d| d > 0).min();
        let mut specs = IndexSet::new();
        // Hits in a row tend to share a spec (one busy rule): those skip the hashing.
        let mut last: Option<(Spec, usize)> = None;
        let spec_of = parts
            .iter()
            .flat_map(|(part, _)| &part.hits)
            .map(|hit| match last {
                Some((spec, index)) if spec == hit.spec => index,
                _ => {
                    let index = specs.insert_full(hit.spec).0;
                    last = Some((hit.spec, index));
                    index
                }
            })
            .collect();
        Call {
            parts,
            at,
            earliest: earliest.unwrap_or(0),
            specs,
            spec_of,
        }
    }

    fn command(&self, verb: &str, script: &str) -> Cmd {
        let mut cmd = ::redis::cmd(verb);
        cmd.arg(script).arg(self.spec_of.len());
        for (part, _) in &self.parts {
            cmd.arg(&part.keys);
        }
        let mut specs = String::new();
        let mut digits = itoa::Buffer::new();
        for s in &self.specs {
            specs.push_str(s.algorithm);
            for n in [u64::from(s.limit), s.window, u64::from(s.burst)] {
                specs.push(' ');
                specs.push_str(digits.format(n));
            }
            specs.push(' ');
            specs.push_str(s.role);
            specs.push(';');
        }
        cmd.arg(self.at.unwrap_or(0)).arg(self.earliest).arg(specs);
        // Requests in a row alike in mode and hits make a run: its shape goes once, ended by
        // how many requests it holds, then its requests' tickets in one value, then each
        // request's permits and (refund) stamps.
        let mut runs: Vec<(String, &[(&Part, i64)])> = Vec::new();
        let (mut shape, mut start) = (String::new(), 0);
        let mut spec_of = self.spec_of.iter();
        for (i, (part, _)) in self.parts.iter().enumerate() {
            shape.clear();
            shape.push(part.mode.letter());
            for (hit, spec) in part.hits.iter().zip(&mut spec_of) {
                // Specs count from 1 in Lua.
                shape.push(' ');
                shape.push_str(digits.format(spec + 1));
                shape.push(':');
                shape.push_str(digits.format(hit.cost));
                if hit.permit.is_some() {
                    shape.push('P');
                }
            }
            match runs.last_mut() {
                Some((last, parts)) if *last == shape => *parts = &self.parts[start..=i],
                _ => {
                    start = i;
                    runs.push((shape.clone(), &self.parts[i..=i]));
                }
            }
        }
        cmd.arg(runs.len());
        let mut tickets = String::new();
        for (mut shape, parts) in runs {
            shape.push('*');
            shape.push_str(digits.format(parts.len()));
            cmd.arg(&shape);
            tickets.clear();
            for &(part, deadline) in parts {
                tickets.extend(part.nonce.0.map(char::from));
                // 16 digits, zero-padded.
                let deadline = digits.format(deadline.clamp(0, MAX_DEADLINE));
                tickets.extend(std::iter::repeat_n('0', 16 - deadline.len()));
                tickets.push_str(deadline);
            }
            cmd.arg(&tickets);
            for (part, _) in parts {
                for hit in &part.hits {
                    if let Some(permit) = &hit.permit {
                        cmd.arg(permit);
                    }
                    if part.mode == Mode::Refund {
                        cmd.arg(hit.stamp);
                    }
                }
            }
        }
        cmd
    }
}

/// How one backend's servers run the batch script: as a function until one of them says it
/// has none (an older Redis, or a user its ACL keeps from them), by hash from then on.
#[derive(Default)]
pub(super) struct Runner {
    by_hash: AtomicBool,
}

impl Runner {
    /// Run a call: as a function, loading the library if the server lost it; where the
    /// server has no functions, by hash, and by text if the server lost the script. Only an
    /// answer that functions are not to be had switches to scripts: any other error (a
    /// failover's `READONLY`, say) fails this call alone. With `wait`, the call waits for
    /// that many replicas to have its writes.
    pub(super) async fn run(
        &self,
        pool: &Pool,
        call: &Call<'_>,
        wait: Option<Wait>,
    ) -> RedisResult<Vec<Option<i64>>> {
        let batch = &*BATCH;
        if !self.by_hash.load(Ordering::Relaxed) {
            let fcall = call.command("FCALL", &batch.function);
            match pool.query_replicated(&fcall, wait).await {
                Err(err) if function_missing(&err) => {
                    let mut load = ::redis::cmd("FUNCTION");
                    load.arg("LOAD").arg("REPLACE").arg(&batch.library);
                    match pool.query::<Value>(&load).await {
                        Ok(_) => return pool.query_replicated(&fcall, wait).await,
                        Err(err) if no_functions(&err) => self.give_up_functions(&err),
                        Err(err) => return Err(err),
                    }
                }
                Err(err) if no_functions(&err) => self.give_up_functions(&err),
                result => return result,
            }
        }
        let command = |verb: &str, script: &str| call.command(verb, script);
        by_hash(pool, command, &batch.sha1, &batch.source, wait).await
    }

    fn give_up_functions(&self, err: &RedisError) {
        if !self.by_hash.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "Redis runs no turnstile function ({err}): the batch script runs by hash \
                 (EVALSHA) from now on, at a higher cost to Redis per call"
            );
        }
    }
}

/// The server takes functions but has not loaded this one.
fn function_missing(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err
            .detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// The server has no `FCALL` or `FUNCTION` (before Redis 7, or renamed away), or this user
/// may not use them.
fn no_functions(err: &RedisError) -> bool {
    match err.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => err
            .detail()
            .is_some_and(|d| d.starts_with("unknown command")),
        _ => false,
    }
}

/// One hit's answer: the verdict and, from a `PerDescriptor` call, where its charge went (for a
/// refund; 0 from other calls).
pub(super) struct Reply {
    pub(super) outcome: Outcome,
    pub(super) stamp: i64,
}

/// What the script answered to a call.
pub(super) struct ScriptReply {
    /// The script's time on Redis' clock, in microseconds.
    pub(super) redis_now: i64,
    /// Per part, in order: one reply per hit (none for a refund), or None for a decision that
    /// started past its deadline.
    pub(super) replies: Vec<Option<Vec<Reply>>>,
}

/// Decode the script's reply to `call`: per part, when decided, per hit its remaining
/// (`-1 - remaining` if refused), its reset and, from a `PerDescriptor` part, its stamp; a nil alone
/// for a part past its deadline; nothing for a refund; then the time that ends them.
pub(super) fn decode(raw: &[Option<i64>], call: &Call<'_>) -> Result<ScriptReply, BackendError> {
    let malformed = || {
        BackendError::Unavailable(format!(
            "the Redis script replied {} values for {} requests",
            raw.len(),
            call.parts.len()
        ))
    };
    let (&redis_now, mut rest) = raw.split_last().ok_or_else(malformed)?;
    let redis_now = redis_now.ok_or_else(malformed)?;
    let mut replies = Vec::with_capacity(call.parts.len());
    for (part, _) in &call.parts {
        let per_hit = match part.mode {
            Mode::Refund => {
                replies.push(Some(Vec::new()));
                continue;
            }
            Mode::PerDescriptor => 3,
            Mode::Atomic | Mode::Check => 2,
        };
        if part.len() > 0
            && let Some((None, after)) = rest.split_first()
        {
            rest = after;
            replies.push(None);
            continue;
        }
        let values = part.len() * per_hit;
        if rest.len() < values {
            return Err(malformed());
        }
        let (hits, after) = rest.split_at(values);
        rest = after;
        replies.push(Some(decode_hits(hits, per_hit).ok_or_else(malformed)?));
    }
    if !rest.is_empty() {
        return Err(malformed());
    }
    Ok(ScriptReply { redis_now, replies })
}

/// A decided part's replies, `per_hit` values each; None if one is nil.
fn decode_hits(raw: &[Option<i64>], per_hit: usize) -> Option<Vec<Reply>> {
    raw.chunks_exact(per_hit)
        .map(|r| {
            let (reply, reset) = (r[0]?, r[1]?);
            let (admitted, remaining) = if reply >= 0 {
                (true, reply)
            } else {
                (false, -1 - reply)
            };
            Some(Reply {
                outcome: Outcome {
                    admitted,
                    remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
                    reset_after: Duration::from_micros(reset.max(0).unsigned_abs()),
                },
                stamp: match r.get(2) {
                    Some(stamp) => (*stamp)?,
                    None => 0,
                },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::limit::{Algorithm, Limit, Unit};
    use ::redis::Arg;

    /// Push an enforced hit of `limit` on `key` to `part`.
    fn push(part: &mut Part, key: &str, limit: Limit, permit: Option<(PermitOp, &str)>, cost: u64) {
        let hit = Hit {
            key: String::new(),
            limit,
            units: cost,
            role: Role::Enforce,
            permit: permit.map(|(op, id)| (op, id.into())),
        };
        let stamp = (part.mode == Mode::Refund).then_some(7);
        part.push(key.into(), &hit, cost, stamp, KeyLayout::Turnstile);
    }

    fn args(cmd: &Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => panic!("a script call has no cursor"),
            })
            .collect()
    }

    #[test]
    fn a_call_sends_each_spec_and_each_run_shape_once_then_its_requests_tickets_together() {
        let minute = Limit::fixed(10, Unit::Minute);
        let with_permit = Limit {
            algorithm: Algorithm::Concurrency,
            ..minute
        };
        let mut first = Part::new(Mode::Atomic, Nonce(*b"nonce0000001"));
        push(&mut first, "a", minute, None, 1);
        push(
            &mut first,
            "b",
            with_permit,
            Some((PermitOp::Acquire, "r")),
            1,
        );
        let mut second = Part::new(Mode::Refund, Nonce(*b"nonce0000002"));
        push(&mut second, "c", minute, None, 0);
        push(
            &mut second,
            "d",
            with_permit,
            Some((PermitOp::Release, "r")),
            2,
        );
        let call = Call::new(
            vec![(&first, 0), (&first, 4), (&second, 5), (&first, 3)],
            None,
        );
        let expected = [
            "EVALSHA sha 8 a b a b c d a b",
            // Redis time, the earliest deadline, two specs in one value.
            "0|3|fixed_window 10 60 10 e;concurrency 10 60 10 e;",
            // Three runs of requests alike: the shape (mode, then spec:cost per hit, P for a
            // permit, then how many requests in a row share it), then the requests' tickets
            // (nonce and deadline, 28 characters each), then per request its permits and, in
            // a refund, its stamps.
            "3|a 1:1 2:1P*2|nonce00000010000000000000000nonce00000010000000000000004|+r|+r",
            "r 1:0 2:2P*1|nonce00000020000000000000005|7|-r|7",
            "a 1:1 2:1P*1|nonce00000010000000000000003|+r",
        ];
        let expected: Vec<&str> = expected
            .iter()
            .flat_map(|l| l.split(if l.contains('|') { '|' } else { ' ' }))
            .collect();
        assert_eq!(args(&call.command("EVALSHA", "sha")), expected);
        // Hits in a row on one spec (which skip the spec set's hashing) name it alike.
        let mut same = Part::new(Mode::Atomic, Nonce(*b"nonce0000003"));
        push(&mut same, "e", minute, None, 1);
        push(&mut same, "f", minute, None, 2);
        push(&mut same, "g", with_permit, None, 1);
        push(&mut same, "h", minute, None, 1);
        let call = Call::new(vec![(&same, 0), (&same, 0)], None);
        assert_eq!(
            args(&call.command("EVALSHA", "sha"))[13..17],
            [
                "fixed_window 10 60 10 e;concurrency 10 60 10 e;",
                "1",
                "a 1:1 1:2 2:1 1:1*2",
                "nonce00000030000000000000000nonce00000030000000000000000"
            ]
        );
        let timed = Call::new(vec![(&second, 0)], Some(42));
        assert_eq!(
            args(&timed.command("EVALSHA", "sha"))[5..8],
            ["42", "0", "fixed_window 10 60 10 e;concurrency 10 60 10 e;"]
        );
    }

    #[test]
    fn a_reply_carries_stamps_only_for_each_parts_refusals_below_zero_and_a_nil_for_late() {
        let minute = Limit::fixed(10, Unit::Minute);
        let part = |mode| {
            let mut part = Part::new(mode, Nonce::new());
            push(&mut part, "a", minute, None, 1);
            push(&mut part, "b", minute, None, 1);
            part
        };
        let (atomic, each, refund) = (
            part(Mode::Atomic),
            part(Mode::PerDescriptor),
            part(Mode::Refund),
        );
        let call = Call::new(
            vec![(&atomic, 0), (&each, 0), (&refund, 0), (&atomic, 9)],
            None,
        );
        let v = Some;
        #[rustfmt::skip]
        let raw = [
            v(7), v(100), v(-1), v(200),
            v(6), v(100), v(41), v(-3), v(200), v(42),
            // The refund replies nothing; the late request a nil.
            None,
            v(555),
        ];
        let answer = decode(&raw, &call).expect("a well-formed reply");
        assert_eq!(answer.redis_now, 555);
        /// A hit's reply: admitted, remaining, reset (µs) and stamp.
        type Seen = (bool, u32, u64, i64);
        let seen: Vec<Option<Vec<Seen>>> = answer
            .replies
            .iter()
            .map(|hits| {
                let hits = hits.as_ref()?.iter();
                let seen = |r: &Reply| {
                    let o = &r.outcome;
                    (
                        o.admitted,
                        o.remaining,
                        o.reset_after.as_micros() as u64,
                        r.stamp,
                    )
                };
                Some(hits.map(seen).collect())
            })
            .collect();
        let expected = [
            Some(vec![(true, 7, 100, 0), (false, 0, 200, 0)]),
            Some(vec![(true, 6, 100, 41), (false, 2, 200, 42)]),
            Some(vec![]),
            None,
        ];
        assert_eq!(seen, expected);
        // One value short, one too many, or a nil in a decided hit's place is an error, not a
        // guess.
        assert!(decode(&raw[1..], &call).is_err());
        assert!(decode(&[&raw[..], &[Some(1)]].concat(), &call).is_err());
        let mut nil_in_place = raw;
        nil_in_place[1] = None;
        assert!(decode(&nil_in_place, &call).is_err());
    }
}
