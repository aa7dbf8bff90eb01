//! The batch script's algorithms: each algorithm's Lua twin, bound to the name the Rust side
//! calls it by.
//!
//! A twin (`Kind::lua`, the file `lua/<name>.lua`) is a chunk that returns its table of
//! functions (`check`, `commit`, `undo`, `refund`), given its key layout as argument. Here
//! each is wrapped in a function, defined before the driver's `ALGORITHMS` table exists (so a
//! twin cannot register itself, under its own name or another), and bound once per layout it
//! serves under `KeyLayout::script_name`, the very name a call asks for. A call makes only
//! the twins its hits use (the first lookup of a name makes its table), which costs less
//! than making them all; a name nothing is bound to, or a twin that returns no table, is an
//! error naming it.

use std::fmt::Write;

use super::KeyLayout;
use crate::limit::Kind;

/// Every twin's script name, kind and layout: one per kind and layout it is kept in.
fn bindings() -> Vec<(&'static str, Kind, KeyLayout)> {
    let mut bound: Vec<(&str, Kind, KeyLayout)> = Vec::new();
    for kind in Kind::ALL {
        for layout in KeyLayout::ALL.map(|l| l.of(kind)) {
            if !bound.iter().any(|&(_, k, l)| (k, l) == (kind, layout)) {
                bound.push((layout.script_name(kind), kind, layout));
            }
        }
    }
    bound
}

/// Makes a twin's table on the first lookup of its name in `ALGORITHMS`.
const MAKE_ON_LOOKUP: &str = "\
local ALGORITHMS = setmetatable({}, {
  __index = function(made, name)
    local twin = TWINS[name] or error('no Lua twin is bound to ' .. tostring(name))
    local algorithm = twin[1](twin[2])
      or error('the Lua twin of ' .. name .. ' returned nothing')
    made[name] = algorithm
    return algorithm
  end,
})
";

/// The whole batch script: the twins, the `ALGORITHMS` table binding them, then `driver`.
pub(super) fn script(driver: &str) -> String {
    let mut source = String::new();
    for kind in Kind::ALL {
        let _ = writeln!(source, "local {}_twin = function(...)", kind.name());
        source.push_str(kind.lua());
        source.push_str("\nend\n");
    }
    source.push_str("local TWINS = {\n");
    for (name, kind, layout) in bindings() {
        let _ = writeln!(
            source,
            "  [{name:?}] = {{{}_twin, {:?}}},",
            kind.name(),
            layout.lua_name()
        );
    }
    source.push_str("}\n");
    source.push_str(MAKE_ON_LOOKUP);
    source.push_str(driver);
    source
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_and_layout_is_bound_under_the_name_calls_ask_for() {
        let script = script("-- driver");
        for kind in Kind::ALL {
            for layout in KeyLayout::ALL {
                let name = layout.script_name(kind);
                let twin = format!("{}_twin, {:?}", kind.name(), layout.of(kind).lua_name());
                let binding = format!("  [{name:?}] = {{{twin}}},\n");
                assert!(script.contains(&binding), "{kind} in {layout:?}: {binding}");
            }
        }
        // One twin per kind, and the fixed window's again in the reference's layout.
        let mut names: Vec<&str> = bindings().iter().map(|(name, ..)| *name).collect();
        assert!(names.contains(&"fixed_window_reference"));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Kind::ALL.len() + 1, "{names:?}");
        assert!(script.ends_with("})\n-- driver"));
    }

    #[test]
    fn no_twin_names_the_tables_binding_them() {
        for kind in Kind::ALL {
            for table in ["ALGORITHMS", "TWINS"] {
                assert!(!kind.lua().contains(table), "{kind} names {table}");
            }
        }
    }
}
