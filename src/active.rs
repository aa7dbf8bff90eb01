//! The rule set in force, swapped atomically: every request sees one whole rule set, the old
//! or the new, never a mix.

use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::config::RuleSet;

/// A validated rule set and when it took effect.
pub struct Loaded {
    pub rules: RuleSet,
    pub loaded_at: SystemTime,
}

pub struct ActiveRules(ArcSwap<Loaded>);

impl ActiveRules {
    pub fn new(rules: RuleSet) -> ActiveRules {
        ActiveRules(ArcSwap::from_pointee(Loaded {
            rules,
            loaded_at: SystemTime::now(),
        }))
    }

    /// The rules in force now; hold the `Arc` for the whole request.
    pub fn current(&self) -> Arc<Loaded> {
        self.0.load_full()
    }

    pub fn replace(&self, rules: RuleSet) {
        self.0.store(Arc::new(Loaded {
            rules,
            loaded_at: SystemTime::now(),
        }));
    }
}
