//! Rate-limit rules written in envoyproxy/ratelimit's YAML, loaded as parse → validate →
//! compiled matcher.
//!
//! Loading never stops at the first problem: every error in every file is collected, so the
//! `check` command can list them all and a failed reload can be explained in one log line.

mod matcher;
mod model;
mod source;
mod validate;
mod yaml;

use std::fmt;
use std::fs;
use std::path::Path;

pub use matcher::{DomainRules, Rule, RuleSet};
pub use validate::SLIDING_WINDOW_MAX_LIMIT;

use validate::Validator;
use yaml::{Kind, Node, Pos};

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

/// Loads the rules at `path`: one file, or every `*.yaml`/`*.yml` directly inside a directory.
pub fn load(path: &Path) -> Result<RuleSet, ConfigErrors> {
    let files = source::config_files(path).map_err(|e| ConfigErrors(vec![e]))?;
    let mut loader = Loader::default();
    for file in files {
        let name = file.display().to_string();
        match fs::read_to_string(&file) {
            Ok(text) => loader.add(&name, &text),
            Err(e) => loader.errors.push(ConfigError::at(
                &name,
                Pos::START,
                format!("cannot read config file: {e}"),
            )),
        }
    }
    loader.finish()
}

/// Loads rules from text, as if read from a file called `file_name`.
pub fn load_str(file_name: &str, text: &str) -> Result<RuleSet, ConfigErrors> {
    let mut loader = Loader::default();
    loader.add(file_name, text);
    loader.finish()
}

#[derive(Default)]
struct Loader {
    validator: Validator,
    files: Vec<String>,
    version: sha1_smol::Sha1,
    errors: Vec<ConfigError>,
}

impl Loader {
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
                    .filter(|d| d.kind != Kind::Null)
                    .collect();
                if documents.is_empty() {
                    documents.push(Node {
                        kind: Kind::Null,
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
