//! Rate-limit rules written in envoyproxy/ratelimit's YAML, loaded as parse → validate →
//! compiled matcher.
//!
//! Loading never stops at the first problem: every error in every file is collected, so the
//! `check` command can list them all and a failed reload can be explained in one log line.
//! The rule set in force (`active`) is swapped whole when the files change (`reload`) or a
//! control plane sends new rules (`xds_client`).
//!
//! It may import `ops`, `algorithm` and `decision`; never `backend` or anything above it.

pub mod active;
mod matcher;
mod model;
pub mod reload;
mod source;
mod validate;
pub mod xds;
pub mod xds_client;
mod yaml;

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

pub use matcher::{DomainRules, Miss, Rule, RuleSet};

use validate::Validator;
use yaml::{Node, NodeKind, Pos};

/// One problem in one config file, at the node that caused it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct ConfigError {
    /// The path as given, or joined onto the directory it was found in.
    pub file: String,
    /// 1-based.
    pub line: usize,
    /// 1-based.
    pub column: usize,
    pub message: String,
}

impl ConfigError {
    fn at(file: &str, pos: Pos, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: file.to_owned(),
            line: pos.line,
            column: pos.column,
            message: message.into(),
        }
    }
}

/// Every error found by one load, by file and then by position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// How a rules path is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// Which files of a directory are rules.
    pub files: Files,
    /// One domain may span files (the reference's MERGE_DOMAIN_CONFIG).
    pub merge_domains: bool,
}

/// Where the rules are and how to read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub path: PathBuf,
    pub options: LoadOptions,
    /// Directories whose changes may change the rules, and whether to watch below them.
    pub watch: Vec<(PathBuf, bool)>,
}

impl Source {
    /// `--config`: a file (its directory is watched, so renames over it are seen) or a
    /// directory of YAML files.
    pub fn path(path: PathBuf, merge_domains: bool) -> Source {
        let dir = if path.is_dir() {
            path.clone()
        } else {
            match path.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
                _ => PathBuf::from("."),
            }
        };
        Source {
            path,
            options: LoadOptions {
                files: Files::Yaml,
                merge_domains,
            },
            watch: vec![(dir, false)],
        }
    }

    /// The reference's runtime layout: `root/subdirectory/appdirectory`, every file below it.
    /// Both of the reference's reload triggers are watched: changes inside the directory, and
    /// `root` itself being swapped (an atomic symlink flip) in its parent.
    pub fn runtime(
        root: &Path,
        subdirectory: &str,
        appdirectory: &str,
        ignore_dotfiles: bool,
        merge_domains: bool,
    ) -> Source {
        let path = root.join(subdirectory).join(appdirectory);
        let mut watch = vec![(path.clone(), true)];
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            watch.push((parent.to_owned(), false));
        }
        Source {
            path,
            options: LoadOptions {
                files: Files::Runtime { ignore_dotfiles },
                merge_domains,
            },
            watch,
        }
    }

    pub fn load(&self) -> Result<RuleSet, ConfigErrors> {
        load_with(&self.path, self.options)
    }
}

/// Which files of a directory are rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Files {
    /// `*.yaml` and `*.yml` directly inside it, dotfiles skipped.
    #[default]
    Yaml,
    /// Every regular file below it, at any depth, as the reference's runtime directory is
    /// read; dotfiles (and dot-directories) too unless `ignore_dotfiles`.
    Runtime { ignore_dotfiles: bool },
}

/// Loads the rules at `path`: one file, or every `*.yaml`/`*.yml` directly inside a directory.
pub fn load(path: &Path) -> Result<RuleSet, ConfigErrors> {
    load_with(path, LoadOptions::default())
}

/// Loads the rules at `path` as `options` say.
pub fn load_with(path: &Path, options: LoadOptions) -> Result<RuleSet, ConfigErrors> {
    let files = source::config_files(path, options.files).map_err(|e| ConfigErrors(vec![e]))?;
    let mut loader = Loader::new(options.merge_domains);
    let mut left = MAX_TOTAL_BYTES;
    for file in files {
        let name = file.display().to_string();
        match read_capped(&file, &mut left) {
            Ok(text) => loader.add(&name, &text),
            Err(Unread::PastTotal) => {
                let message = format!(
                    "config files together larger than {} MiB",
                    MAX_TOTAL_BYTES >> 20
                );
                loader
                    .errors
                    .push(ConfigError::at(&name, Pos::START, message));
                break;
            }
            Err(Unread::Other(message)) => {
                loader
                    .errors
                    .push(ConfigError::at(&name, Pos::START, message))
            }
        }
    }
    loader.finish()
}

/// Largest rules file read. 10 000 rules take about 1 MiB; the bound keeps a stray or hostile
/// file from costing a reload seconds and the process gigabytes.
const MAX_FILE_BYTES: u64 = 16 << 20;

/// Most bytes all rules files together hold: a directory of many files within
/// `MAX_FILE_BYTES` each must not cost what one larger file may not.
const MAX_TOTAL_BYTES: u64 = 64 << 20;

/// Why a rules file was not read.
enum Unread {
    /// It would take the files past `MAX_TOTAL_BYTES`.
    PastTotal,
    Other(String),
}

/// A rules file's text, or why it cannot be read: unreadable, not UTF-8, larger than
/// `MAX_FILE_BYTES`, or larger than the `left` bytes of all files' bound (read only that far,
/// however large it is or grows). What was read comes off `left`, read in vain or not.
fn read_capped(file: &Path, left: &mut u64) -> Result<String, Unread> {
    use std::io::Read;
    let mut bytes = Vec::new();
    fs::File::open(file)
        .and_then(|f| {
            f.take(MAX_FILE_BYTES.min(*left) + 1)
                .read_to_end(&mut bytes)
        })
        .map_err(|e| Unread::Other(format!("cannot read config file: {e}")))?;
    let read = bytes.len() as u64;
    if read > *left {
        return Err(Unread::PastTotal);
    }
    *left -= read;
    if read > MAX_FILE_BYTES {
        return Err(Unread::Other(format!(
            "config file larger than {} MiB",
            MAX_FILE_BYTES >> 20
        )));
    }
    String::from_utf8(bytes)
        .map_err(|e| Unread::Other(format!("cannot read config file: {}", e.utf8_error())))
}

/// Loads rules from text, as if read from a file called `file_name`.
pub fn load_str(file_name: &str, text: &str) -> Result<RuleSet, ConfigErrors> {
    let mut loader = Loader::new(false);
    loader.add(file_name, text);
    loader.finish()
}

struct Loader {
    validator: Validator,
    files: Vec<String>,
    version: sha1_smol::Sha1,
    errors: Vec<ConfigError>,
}

impl Loader {
    fn new(merge_domains: bool) -> Loader {
        Loader {
            validator: Validator::new(merge_domains),
            files: Vec::new(),
            version: sha1_smol::Sha1::new(),
            errors: Vec::new(),
        }
    }

    fn add(&mut self, name: &str, text: &str) {
        self.files.push(name.to_owned());
        // Lengths make the (name, bytes) sequence unambiguous.
        for part in [name.as_bytes(), text.as_bytes()] {
            self.version.update(&(part.len() as u64).to_be_bytes());
            self.version.update(part);
        }

        let mut errors = Vec::new();
        match yaml::parse(name, text) {
            Err(e) => errors.push(e),
            Ok(documents) => {
                // Empty documents (a trailing `---`) are skipped, but a file with nothing else
                // is the reference's "empty domain" error.
                let mut documents: Vec<Node> = documents
                    .into_iter()
                    .filter(|d| d.kind != NodeKind::Null)
                    .collect();
                if documents.is_empty() {
                    documents.push(Node {
                        kind: NodeKind::Null,
                        pos: Pos::START,
                    });
                }
                for document in &documents {
                    if let Some(spec) = model::parse(name, document, &mut errors) {
                        self.validator.add(name, &spec, &mut errors);
                    }
                }
            }
        }
        errors.sort_by_key(|e| (e.line, e.column));
        self.errors.append(&mut errors);
    }

    fn finish(self) -> Result<RuleSet, ConfigErrors> {
        if !self.errors.is_empty() {
            return Err(ConfigErrors(self.errors));
        }
        Ok(RuleSet::new(
            self.validator.finish(),
            self.version.digest().to_string(),
            self.files,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    const B: &str = "domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

    fn messages(errors: &ConfigErrors) -> Vec<String> {
        errors.0.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn several_documents_in_one_file_are_several_domains() {
        let rules = load_str("multi.yaml", &format!("{A}---\n{B}---\n")).unwrap();
        let names: Vec<&str> = rules.domains().map(DomainRules::name).collect();
        assert_eq!(names, ["a", "b"]);
        let b = rules.domain("b").unwrap().lookup([("k", "v")]).unwrap();
        assert_eq!(b.full_key, "b.k");
        assert_eq!(rules.files(), ["multi.yaml"]);
    }

    #[test]
    fn a_directory_loads_every_yaml_file() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a.yaml"), A).unwrap();
        fs::write(dir.path().join("b.yml"), B).unwrap();
        fs::write(dir.path().join(".skipped.yaml"), "not: [valid").unwrap();
        fs::write(dir.path().join("readme.md"), "# not yaml").unwrap();
        let rules = load(dir.path()).unwrap();
        assert_eq!(rules.domains().count(), 2);
        let files: Vec<String> = ["a.yaml", "b.yml"]
            .iter()
            .map(|f| dir.path().join(f).display().to_string())
            .collect();
        assert_eq!(rules.files(), files);

        let single = load(&dir.path().join("b.yml")).unwrap();
        assert!(single.domain("a").is_none());
        assert!(single.domain("b").is_some());
    }

    #[test]
    fn an_empty_directory_loads_no_domains() {
        let dir = tempfile::tempdir().unwrap();
        let rules = load(dir.path()).unwrap();
        assert_eq!(rules.domains().count(), 0);
        assert_eq!(rules.describe(), "");
    }

    #[test]
    fn errors_are_collected_across_files() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("1.yaml"), A).unwrap();
        fs::write(dir.path().join("2.yaml"), "domain: a\n").unwrap();
        fs::write(dir.path().join("3.yaml"), "domain: c\nbogus: 1\n").unwrap();
        fs::write(dir.path().join("4.yaml"), "domain: [\n").unwrap();
        fs::write(dir.path().join("5.yaml"), [0xff, 0xfe]).unwrap();
        let errors = load(dir.path()).unwrap_err();
        let file = |name: &str| dir.path().join(name).display().to_string();
        assert_eq!(errors.0.len(), 4);
        assert_eq!(
            errors.0[0].to_string(),
            format!(
                "{}:1:9: duplicate domain 'a' in config file",
                file("2.yaml")
            )
        );
        assert_eq!(
            errors.0[1].to_string(),
            format!("{}:2:1: config error, unknown key 'bogus'", file("3.yaml"))
        );
        assert_eq!(errors.0[2].file, file("4.yaml"));
        assert_eq!(errors.0[2].line, 2);
        assert!(
            errors.0[2]
                .message
                .starts_with("error loading config file: "),
            "{}",
            errors.0[2]
        );
        assert_eq!(errors.0[3].file, file("5.yaml"));
        assert!(
            errors.0[3].message.starts_with("cannot read config file: "),
            "{}",
            errors.0[3]
        );
        // One line per error.
        assert_eq!(errors.to_string().lines().count(), 4);
        assert_eq!(
            errors.to_string().lines().next().unwrap(),
            errors.0[0].to_string()
        );
    }

    #[test]
    fn what_a_directory_makes_the_loader_read_is_bounded() {
        // A file of `len` bytes that is not UTF-8 (read, then refused without parsing;
        // sparse, so writing it costs nothing).
        let write = |path: &Path, len: u64| {
            let file = fs::File::create(path).unwrap();
            file.set_len(len).unwrap();
            std::io::Write::write_all(&mut &file, &[0xff]).unwrap();
        };
        // Rows: files (count, bytes each), and the last error's message.
        let rows: [(usize, u64, &str); 3] = [
            (4, 15 << 20, "cannot read config file: "),
            (5, 15 << 20, "config files together larger than 64 MiB"),
            (10_001, 1, "more than 10000 config files"),
        ];
        for (count, len, message) in rows {
            let dir = tempfile::tempdir().unwrap();
            for i in 0..count {
                write(&dir.path().join(format!("{i:05}.yaml")), len);
            }
            let errors = load(dir.path()).unwrap_err();
            let last = errors.0.last().unwrap();
            assert!(last.message.starts_with(message), "{count}: {last}");
            // Past the bound nothing more is read, and the bound is said once.
            let said = errors
                .0
                .iter()
                .filter(|e| e.message == last.message)
                .count();
            assert!(said == 1 || count == 4, "{count}: {errors}");
        }
    }

    #[test]
    fn a_missing_path_is_one_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent");
        let errors = load(&missing).unwrap_err();
        assert_eq!(
            messages(&errors),
            [format!(
                "{}:1:1: config path does not exist",
                missing.display()
            )]
        );
    }

    #[test]
    fn version_is_stable_for_the_same_content() {
        let v = |name: &str, text: &str| load_str(name, text).unwrap().version().to_owned();
        let first = v("a.yaml", A);
        assert_eq!(first.len(), 40);
        assert!(first.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(first, v("a.yaml", A));
        assert_ne!(first, v("other.yaml", A));
        assert_ne!(first, v("a.yaml", &format!("{A}# changed\n")));

        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a.yaml"), A).unwrap();
        fs::write(dir.path().join("b.yaml"), B).unwrap();
        let from_disk = load(dir.path()).unwrap().version().to_owned();
        assert_eq!(from_disk, load(dir.path()).unwrap().version());
        fs::write(
            dir.path().join("b.yaml"),
            A.replace("domain: a", "domain: c"),
        )
        .unwrap();
        assert_ne!(from_disk, load(dir.path()).unwrap().version());
    }

    #[test]
    fn error_display_is_file_line_column_message() {
        let errors = load_str("x.yaml", "domain: d\ndescriptors:\n  - value: v\n").unwrap_err();
        assert_eq!(
            errors.0,
            [ConfigError {
                file: "x.yaml".to_owned(),
                line: 3,
                column: 5,
                message: "descriptor has empty key".to_owned(),
            }]
        );
        assert_eq!(errors.to_string(), "x.yaml:3:5: descriptor has empty key");
    }
}
