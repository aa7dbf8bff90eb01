//! The batch script's algorithms: each algorithm's Lua twin, bound to the name the Rust side
//! calls it by.
//!
//! A twin (`Algorithm::lua`, the file `lua/<name>.lua`) is a chunk that returns its table of
//! functions, given its key layout as argument. Each takes a spec `s` (the limit, window,
//! burst and role one or more hits share) and a hit `h` (its key, cost, permit and index, and
//! the request's nonce if the twin's table says `named = true`: splitting it off costs), and
//! every verdict is four values: admitted, remaining, reset (us) and stamp.
//! `prepare(s, now)` works out what all the spec's hits share in this call; `check(s, h,
//! now)` decides; `commit`, `undo` and `refund` charge, take back within the call, and give
//! back in a later call (`commit` is also given its run's tickets and `o`, where the
//! request's own starts: its first characters are random). An optional `take(s, key, cost,
//! cost_text, tickets, o)` checks a hit that costs something and holds no permit, and
//! charges it if admitted, in fewer commands than check and commit; it gets the hit's
//! values as arguments (no hit table is filled for it), may decline a hit by returning
//! nothing (the driver then checks and commits it), and leaves nothing for `undo`, which
//! gets the hit in `h` like the others. An optional `finish()` runs once at the end of
//! every call that made the twin: a write the twin deferred within the call (the fixed
//! window pays a run of charges on one counter in one `INCRBY`) is made by then; and an
//! optional `begin()` at the start of every call that finds the twin made: a twin kept
//! from an earlier call (a function library keeps them, below) forgets what that call
//! left, even one an error ended. A twin keeps in `s` and `h` what its own functions need
//! later; the driver never reads it.
//!
//! Here each twin is wrapped in a function, defined before the driver's `ALGORITHMS` table
//! and `algorithm` function exist (so a twin cannot register itself, under its own name or
//! another), and bound once per layout it serves under `KeyLayout::script_name`, the very
//! name a call asks for. A call makes only the twins its hits use (`algorithm(name)` makes
//! one, the first time a call asks for it), which costs less than making them all; a name
//! nothing is bound to, or a twin that returns no table, is an error naming it. The binding
//! is code, not a table of twins: a script runs afresh on every call, and every table it
//! builds is work for Redis' Lua.
//!
//! The same text goes to Redis two ways (`script`, `library`). As a script (`EVALSHA`) all of
//! it runs on every call: the twins are made anew each time, a closure per function, about a
//! sixth of what a call of one request costs Redis. As a function library (Redis 7's
//! `FUNCTION LOAD`, then `FCALL`) the driver from its line [`EACH_CALL`] on is the library's
//! one function, and what comes before it (the twins, `ALGORITHMS`, and the driver's own
//! first part: what it keeps of the specs and shapes calls send) outlives the call: a twin is
//! made by the first call that asks for it and kept until the library is loaded again.

use std::fmt::Write;

use super::KeyLayout;
use crate::decision::limit::Algorithm;

/// Every twin's script name, algorithm and layout: one per algorithm and layout it is kept in.
fn bindings() -> Vec<(&'static str, Algorithm, KeyLayout)> {
    let mut bound: Vec<(&str, Algorithm, KeyLayout)> = Vec::new();
    for algorithm in Algorithm::ALL {
        for layout in KeyLayout::ALL.map(|l| l.of(algorithm)) {
            if !bound.iter().any(|&(_, k, l)| (k, l) == (algorithm, layout)) {
                bound.push((layout.script_name(algorithm), algorithm, layout));
            }
        }
    }
    bound
}

/// `algorithm(name)` makes a twin's table and keeps it in `ALGORITHMS` for the call's later
/// specs (the driver looks there first): the branches binding each name (`bind`) go between
/// the two halves. A plain table and function cost less than a metatable's `__index`.
/// `every_twin(hook)` runs the optional `hook` (`begin`, `finish`) of every twin made.
const LOOKUP: [&str; 2] = [
    "\
local ALGORITHMS = {}
local function algorithm(name)
  local twin
",
    "  else error('no Lua twin is bound to ' .. tostring(name)) end
  ALGORITHMS[name] = twin or error('the Lua twin of ' .. name .. ' returned nothing')
  return twin
end
local function every_twin(hook)
  for _, twin in pairs(ALGORITHMS) do
    local run = twin[hook]
    if run then
      run()
    end
  end
end
",
];

/// The branch of `LOOKUP` that binds `name` (the `n`-th binding) to its twin and layout.
fn bind(n: usize, name: &str, algorithm: Algorithm, layout: KeyLayout) -> String {
    let branch = if n == 0 { "if" } else { "elseif" };
    let (twin, layout) = (algorithm.name(), layout.lua_name());
    format!("  {branch} name == {name:?} then twin = {twin}_twin({layout:?})\n")
}

/// The comment that opens the driver's part run on each call. A function library runs what
/// is above it once, when loaded, where Redis lets code reach neither `redis` nor Lua's
/// libraries (`string`, `table`): only plain values and tables can be made there.
pub(super) const EACH_CALL: &str = "-- Each call:";

/// The whole batch script: the twins, the `ALGORITHMS` table binding them, then `driver`.
pub(super) fn script(driver: &str) -> String {
    let mut source = twins();
    source.push_str(driver);
    source
}

/// The batch script as a function library named `name` (its one function has the same name):
/// the twins, `ALGORITHMS` and the driver's part above [`EACH_CALL`], kept between calls, then
/// the rest of `driver` as the function, given the call's keys and values under the names a
/// script knows them by. None if `driver` has no such line.
pub(super) fn library(driver: &str, name: &str) -> Option<String> {
    let (kept, each_call) = driver.split_at(driver.find(EACH_CALL)?);
    let mut source = format!("#!lua name={name}\n");
    source.push_str(&twins());
    source.push_str(kept);
    source.push_str("local function batch(KEYS, ARGV)\n");
    source.push_str(each_call);
    let _ = writeln!(source, "end\nredis.register_function('{name}', batch)");
    Some(source)
}

/// The twins, each in a function, and the `ALGORITHMS` table and `algorithm` function that
/// make and keep them.
fn twins() -> String {
    let mut source = String::new();
    for algorithm in Algorithm::ALL {
        let _ = writeln!(source, "local {}_twin = function(...)", algorithm.name());
        source.push_str(algorithm.lua());
        source.push_str("\nend\n");
    }
    source.push_str(LOOKUP[0]);
    for (n, (name, algorithm, layout)) in bindings().into_iter().enumerate() {
        source.push_str(&bind(n, name, algorithm, layout));
    }
    source.push_str(LOOKUP[1]);
    source
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_and_layout_is_bound_under_the_name_calls_ask_for() {
        let script = script("-- driver");
        for algorithm in Algorithm::ALL {
            for layout in KeyLayout::ALL {
                let name = layout.script_name(algorithm);
                let twin = format!(
                    "{}_twin({:?})",
                    algorithm.name(),
                    layout.of(algorithm).lua_name()
                );
                let binding = format!(" name == {name:?} then twin = {twin}\n");
                assert!(
                    script.contains(&binding),
                    "{algorithm} in {layout:?}: {binding}"
                );
            }
        }
        // One twin per algorithm, and the fixed window's again in the reference's layout.
        let mut names: Vec<&str> = bindings().iter().map(|(name, ..)| *name).collect();
        assert!(names.contains(&"fixed_window_reference"));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Algorithm::ALL.len() + 1, "{names:?}");
        assert!(script.ends_with(&format!("{}-- driver", LOOKUP[1])));
    }

    #[test]
    fn the_library_is_the_script_with_its_driver_from_each_call_on_as_the_one_function() {
        let driver = format!("-- kept\n{EACH_CALL}-- driver\n");
        let (script, library) = (script(&driver), library(&driver, "lib_1"));
        let twins = script.strip_suffix(&driver).unwrap();
        let wrapped = format!("local function batch(KEYS, ARGV)\n{EACH_CALL}-- driver\nend\n");
        let register = "redis.register_function('lib_1', batch)\n";
        assert_eq!(
            library.as_deref(),
            Some(&*format!(
                "#!lua name=lib_1\n{twins}-- kept\n{wrapped}{register}"
            ))
        );
        assert_eq!(
            super::library("-- driver\n", "lib_1"),
            None,
            "no line opens each call"
        );
        let batch = include_str!("../../../lua/batch.lua");
        assert_eq!(
            batch.matches(EACH_CALL).count(),
            1,
            "batch.lua opens each call once"
        );
    }

    #[test]
    fn no_twin_names_the_table_binding_them() {
        for algorithm in Algorithm::ALL {
            assert!(
                !algorithm.lua().contains("ALGORITHMS"),
                "{algorithm} names ALGORITHMS"
            );
        }
    }
}
