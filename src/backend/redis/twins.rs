//! The batch script's algorithms: each algorithm's Lua twin, bound to the name the Rust side
//! calls it by, and the script and function library made of them and `lua/batch.lua`.
//!
//! A twin (`Algorithm::lua`, the file `lua/<name>.lua`) is a chunk that, given its key
//! layout, returns its table of functions over a spec `s` (what hits of one limit share) and
//! a hit `h`; every verdict is four values: admitted, remaining, reset (us) and stamp.
//! `prepare(s, now)` works out what the spec's hits share in this call; `check` decides;
//! `commit`, `undo` and `refund` charge, take back within the call, and give back in a
//! later call. Optional: `take` checks and charges a hit without a permit in fewer commands
//! (returning nothing declines it), `begin` and `finish` run at the start and end of every
//! call that made the twin. A twin keeps in `s` and `h` what its own functions need; the
//! driver never reads it.
//!
//! Each twin is wrapped in a function defined before the driver's `ALGORITHMS` table (so a
//! twin cannot register itself) and bound, as code rather than a table, under
//! `KeyLayout::script_name`; a call makes only the twins its hits use. As a script
//! (`EVALSHA`) all of it runs on every call; as a function library (`FCALL`) only the
//! driver's `batch` does, and the twins made by earlier calls are kept (measured in
//! BENCHMARKS.md).

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

/// The line that opens the driver's function `batch`: each call's code, closed by the
/// driver's last `end`.
const BATCH: &str = "local function batch(KEYS, ARGV)\n";

/// The whole batch script: the twins, the `ALGORITHMS` table binding them, then `driver` with
/// `batch`'s body at the top level, where what it reads of the code above is in registers
/// rather than upvalues (a script runs all of it on every call anyway). None if `driver` has
/// no `batch` closed at its end.
pub(super) fn script(driver: &str) -> Option<String> {
    let (kept, body) = driver.split_once(BATCH)?;
    let body = body.trim_end().strip_suffix("end")?;
    let mut source = twins();
    source.push_str(kept);
    source.push_str("local KEYS, ARGV = KEYS, ARGV\n");
    source.push_str(body);
    Some(source)
}

/// The batch script as a function library named `name`: the twins, `ALGORITHMS` and the
/// driver, kept between calls, with the driver's `batch` as its one function, of that name.
/// Code outside `batch` runs once, at load, where Redis lets it reach neither `redis` nor
/// Lua's libraries (`string`, `table`): only plain values and tables can be made there.
pub(super) fn library(driver: &str, name: &str) -> String {
    let mut source = format!("#!lua name={name}\n");
    source.push_str(&twins());
    source.push_str(driver);
    let _ = writeln!(source, "\nredis.register_function('{name}', batch)");
    source
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
        let script = script("local function batch(KEYS, ARGV)\n-- driver\nend\n").unwrap();
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
        assert!(script.ends_with(&format!(
            "{}local KEYS, ARGV = KEYS, ARGV\n-- driver\n",
            LOOKUP[1]
        )));
    }

    #[test]
    fn the_script_runs_batch_at_its_top_level_and_the_library_registers_it() {
        let driver = "-- kept\nlocal function batch(KEYS, ARGV)\n  -- each call\nend\n";
        let script = script(driver).unwrap();
        let twins = script
            .strip_suffix("-- kept\nlocal KEYS, ARGV = KEYS, ARGV\n  -- each call\n")
            .unwrap();
        let register = "\nredis.register_function('lib_1', batch)\n";
        assert_eq!(
            library(driver, "lib_1"),
            format!("#!lua name=lib_1\n{twins}{driver}{register}")
        );
        assert_eq!(super::script("-- no batch\n"), None);
        let batch = include_str!("../../../lua/batch.lua");
        assert_eq!(
            batch.matches(BATCH).count(),
            1,
            "batch.lua defines batch once"
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
