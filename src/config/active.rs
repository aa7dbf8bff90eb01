//! The rule set in force, swapped atomically: every request sees one whole rule set, the old
//! or the new, never a mix.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::config::RuleSet;

/// A validated rule set and when it took effect.
pub struct Loaded {
    pub rules: RuleSet,
    pub loaded_at: SystemTime,
}

pub struct ActiveRules {
    current: ArcSwap<Loaded>,
    /// Where the rules come from, for /rlconfig and health.
    source: String,
    /// A rule set has been put in force (files load before start; xDS rules arrive later).
    arrived: AtomicBool,
}

impl ActiveRules {
    pub fn new(rules: RuleSet) -> ActiveRules {
        ActiveRules {
            current: ArcSwap::from_pointee(Loaded {
                rules,
                loaded_at: SystemTime::now(),
            }),
            source: "file".to_owned(),
            arrived: AtomicBool::new(true),
        }
    }

    /// No rules until the first `replace`, from `source`.
    pub fn awaiting(source: String) -> ActiveRules {
        ActiveRules {
            source,
            arrived: AtomicBool::new(false),
            ..ActiveRules::new(RuleSet::default())
        }
    }

    /// The rules in force now; hold the `Arc` for the whole request.
    pub fn current(&self) -> Arc<Loaded> {
        self.current.load_full()
    }

    pub fn replace(&self, rules: RuleSet) {
        self.current.store(Arc::new(Loaded {
            rules,
            loaded_at: SystemTime::now(),
        }));
        self.arrived.store(true, Ordering::Release);
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether any rule set has been put in force yet.
    pub fn arrived(&self) -> bool {
        self.arrived.load(Ordering::Acquire)
    }
}
