//! The batch script and its calls: the algorithms' Lua twins plus the batch driver, assembled
//! once and run by hash (EVALSHA). A server that does not know the hash (after SCRIPT FLUSH, a
//! restart or a failover) gets the full text once (EVAL, which also caches it), on whatever
//! connection type, Cluster included, since EVAL is routed by its first key like EVALSHA.

use std::sync::LazyLock;
use std::time::Duration;

use ::redis::{Cmd, ErrorKind, RedisResult, ServerErrorKind};

use super::connect::Pool;
use super::{KeyLayout, twins};
use crate::algorithm::Micros;
use crate::decision::{BackendError, Hit, LeaseOp, Outcome, Role};

/// The script text and its SHA-1, computed once.
struct Batch {
    source: String,
    sha1: String,
}

static BATCH: LazyLock<Batch> = LazyLock::new(|| {
    let source = twins::script(include_str!("../../../lua/batch.lua"));
    let sha1 = sha1_smol::Sha1::from(&source).digest().to_string();
    Batch { source, sha1 }
});

/// The batch script's text, as turnstile loads it (`turnstile redis-script`: to preload it,
/// or to run it from a benchmark exactly as turnstile does).
pub fn batch_source() -> &'static str {
    &BATCH.source
}

/// A script of another module (RLQS shares), with its SHA-1 for EVALSHA.
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
    match pool.query(&command("EVALSHA", &lua.sha1)).await {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            pool.query(&command("EVAL", lua.source)).await
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
    Each,
    /// Charge nothing.
    Check,
    /// Undo an `Each` call with the same nonce.
    Refund,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Atomic => "atomic",
            Mode::Each => "each",
            Mode::Check => "check",
            Mode::Refund => "refund",
        }
    }
}

pub(super) fn role_letter(role: Role) -> String {
    match role {
        Role::Enforce => "e",
        Role::Shadow => "s",
        Role::Quota => "q",
    }
    .into()
}

/// A fresh nonce per request: it names the request's sliding-window entries, so a refund
/// removes exactly them. 10 alphanumerics (~59 bits) keep the log entries short.
pub(super) fn nonce() -> String {
    (0..10).map(|_| fastrand::alphanumeric()).collect()
}

/// The KEYS and ARGV of one script call.
pub(super) struct Call {
    keys: Vec<String>,
    args: Vec<String>,
    layout: KeyLayout,
    mode: Mode,
    /// The time to decide at instead of Redis TIME (differential tests only; see
    /// `RedisBackend::evaluate_at`).
    at: Option<Micros>,
}

/// Where the deadline goes in ARGV.
const DEADLINE_ARG: usize = 2;

impl Call {
    /// A call without a deadline (see [`Call::set_deadline`]); `at` is the time to decide at
    /// instead of Redis TIME (differential tests only; see `RedisBackend::evaluate_at`).
    pub(super) fn new(mode: Mode, nonce: &str, layout: KeyLayout, at: Option<Micros>) -> Call {
        Call {
            keys: Vec::new(),
            args: vec![mode.name().into(), nonce.into(), "0".into()],
            layout,
            mode,
            at,
        }
    }

    /// Past `deadline` (microseconds on Redis' clock; 0: none) the script decides nothing and
    /// charges nothing.
    pub(super) fn set_deadline(&mut self, deadline: i64) {
        self.args[DEADLINE_ARG] = deadline.to_string();
    }

    /// Add one hit costing `hits`; `last` is the role letter, or in a refund the stamp the
    /// charge replied.
    pub(super) fn push(&mut self, key: String, hit: &Hit, hits: u64, last: String) {
        let limit = &hit.limit;
        let lease = match &hit.lease {
            Some((LeaseOp::Acquire, id)) => format!("+{id}"),
            Some((LeaseOp::Release, id)) => format!("-{id}"),
            None => String::new(),
        };
        self.keys.push(key);
        self.args.extend([
            self.layout.script_algorithm(limit).into(),
            limit.requests_per_unit.to_string(),
            limit.window.to_string(),
            limit.burst.to_string(),
            hits.to_string(),
            lease,
            last,
        ]);
    }

    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    fn command(&self, verb: &str, script: &str) -> Cmd {
        let mut cmd = ::redis::cmd(verb);
        cmd.arg(script)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        if let Some(at) = self.at {
            cmd.arg(at);
        }
        cmd
    }
}

/// Run a call: by hash, and by text if the server lost the script.
pub(super) async fn run(pool: &Pool, call: &Call) -> RedisResult<Vec<i64>> {
    let batch = &*BATCH;
    match pool.query(&call.command("EVALSHA", &batch.sha1)).await {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            pool.query(&call.command("EVAL", &batch.source)).await
        }
        result => result,
    }
}

/// One hit's answer: the verdict and where its charge went (for a refund).
pub(super) struct Reply {
    pub(super) outcome: Outcome,
    pub(super) stamp: i64,
}

/// What the script answered to a call.
pub(super) struct Answer {
    /// The script's time on Redis' clock, in microseconds.
    pub(super) redis_now: i64,
    /// One reply per hit; none for a refund, or for a decision that started past its deadline.
    pub(super) replies: Option<Vec<Reply>>,
}

/// Decode the 4 integers per hit the script replies, and the time that ends them.
pub(super) fn decode(mut raw: Vec<i64>, call: &Call) -> Result<Answer, BackendError> {
    let redis_now = raw.pop();
    let expected = if call.mode == Mode::Refund {
        0
    } else {
        call.len() * 4
    };
    let (Some(redis_now), true) = (redis_now, raw.is_empty() || raw.len() == expected) else {
        return Err(BackendError::Unavailable(format!(
            "the Redis script replied {} values for {} hits",
            raw.len() + usize::from(redis_now.is_some()),
            call.len()
        )));
    };
    let late = expected > 0 && raw.is_empty();
    Ok(Answer {
        redis_now,
        replies: (!late).then(|| replies(&raw)),
    })
}

fn replies(raw: &[i64]) -> Vec<Reply> {
    raw.chunks_exact(4)
        .map(|r| Reply {
            outcome: Outcome {
                admitted: r[0] == 1,
                remaining: u32::try_from(r[1].max(0)).unwrap_or(u32::MAX),
                reset_after: Duration::from_micros(r[2].max(0).unsigned_abs()),
            },
            stamp: r[3],
        })
        .collect()
}
