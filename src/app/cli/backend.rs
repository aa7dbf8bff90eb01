//! Where limit state lives: in this process (bounded), or in Redis (its own group); and the
//! cache of refusals in front of either.

use clap::{Args, ValueEnum};

use super::RedisArgs;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// State in this process: exact for one instance, no Redis needed.
    Memory,
    /// State in Redis, shared by every instance.
    Redis,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Backend")]
pub struct BackendArgs {
    /// Where limit state lives. Default: memory, or redis when a Redis URL is given.
    #[arg(long, env = "BACKEND_TYPE", value_enum, ignore_case = true)]
    pub backend: Option<BackendKind>,
    /// Most live keys the memory backend holds; a new key past it evicts one seldom used.
    #[arg(long, env = "TURNSTILE_MEMORY_MAX_KEYS", default_value_t = crate::backend::memory::DEFAULT_MAX_KEYS)]
    pub memory_max_keys: usize,
    /// Most bytes the memory backend's live keys take (keys and per-key state, as counted).
    #[arg(long, env = "TURNSTILE_MEMORY_MAX_BYTES", default_value_t = crate::backend::memory::DEFAULT_MAX_BYTES)]
    pub memory_max_bytes: usize,
    /// Refusals remembered locally, so a key over its limit is refused without a round trip
    /// until its reset (0 disables). Never admits anything the backend would refuse.
    #[arg(long, env = "TURNSTILE_LOCAL_CACHE_ENTRIES", default_value_t = 100_000)]
    pub local_cache_entries: usize,
    /// The reference's local cache size; when set, it sizes the cache instead (one entry per
    /// 256 bytes; 0 disables it).
    #[arg(long, env = "LOCAL_CACHE_SIZE_IN_BYTES")]
    pub local_cache_size_in_bytes: Option<usize>,
    #[command(flatten)]
    pub redis: RedisArgs,
}

impl BackendArgs {
    /// The backend that decides: as named, else Redis if a Redis URL is given (the
    /// reference's default backend is Redis: a deployment that names a Redis and no backend
    /// keeps using it), else memory.
    pub fn kind(&self) -> BackendKind {
        self.backend.unwrap_or(if self.redis.redis_url.is_some() {
            BackendKind::Redis
        } else {
            BackendKind::Memory
        })
    }

    /// Refusals the over-limit cache holds: the reference's size in bytes when given, at one
    /// entry per 256 bytes, else turnstile's count.
    pub fn over_limit_entries(&self) -> usize {
        self.local_cache_size_in_bytes
            .map_or(self.local_cache_entries, |bytes| bytes / 256)
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;
    use super::*;

    /// Rows: the command line, the backend it picks, the refusals its cache holds.
    #[test]
    fn the_backend_and_its_cache_from_the_flags() {
        for (args, kind, entries) in [
            (&[][..], BackendKind::Memory, 100_000),
            (
                &["--redis-url", "redis://127.0.0.1:1"][..],
                BackendKind::Redis,
                100_000,
            ),
            (
                &["--redis-url", "redis://127.0.0.1:1", "--backend", "memory"][..],
                BackendKind::Memory,
                100_000,
            ),
            (
                &["--backend", "redis", "--local-cache-entries", "5"][..],
                BackendKind::Redis,
                5,
            ),
            (
                &["--local-cache-size-in-bytes", "1024"][..],
                BackendKind::Memory,
                4,
            ),
            (
                &[
                    "--local-cache-entries",
                    "5",
                    "--local-cache-size-in-bytes",
                    "0",
                ][..],
                BackendKind::Memory,
                0,
            ),
        ] {
            let backend = parse_serve(args).unwrap().backend;
            assert_eq!(
                (backend.kind(), backend.over_limit_entries()),
                (kind, entries),
                "{args:?}"
            );
        }
    }
}
