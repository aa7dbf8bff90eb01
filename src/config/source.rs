//! Which files make up the config: one file, or the YAML files directly inside a directory.
//!
//! Unlike the reference, which reads every file under the tree, only `*.yaml`/`*.yml` are read
//! and dotfiles are skipped, so Kubernetes ConfigMap bookkeeping (`..data`) and editor leftovers
//! never load as rules. Symlinks are followed, since ConfigMap files are symlinks.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::ConfigError;
use super::yaml::Pos;

/// The files to load, sorted by name.
pub fn config_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let error = |message: String| ConfigError::at(&path.display().to_string(), Pos::START, message);
    let metadata = fs::metadata(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => error("config path does not exist".to_owned()),
        _ => error(format!("cannot read config path: {e}")),
    })?;
    if metadata.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    if !metadata.is_dir() {
        return Err(error(
            "config path is neither a file nor a directory".to_owned(),
        ));
    }
    let entries =
        fs::read_dir(path).map_err(|e| error(format!("cannot list config directory: {e}")))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| error(format!("cannot list config directory: {e}")))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        // fs::metadata follows symlinks; a dangling one is skipped like any non-file.
        if is_yaml
            && !name.starts_with('.')
            && fs::metadata(entry.path()).is_ok_and(|m| m.is_file())
        {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_itself() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.conf");
        fs::write(&file, "domain: d\n").unwrap();
        assert_eq!(config_files(&file).unwrap(), [file]);
    }

    #[test]
    fn a_directory_gives_its_yaml_files_sorted_without_dotfiles() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.yml", "a.yaml", ".hidden.yaml", "notes.txt", "c.yaml.bak"] {
            fs::write(dir.path().join(name), "domain: d\n").unwrap();
        }
        fs::create_dir(dir.path().join("sub.yaml")).unwrap();
        fs::create_dir(dir.path().join("nested")).unwrap();
        fs::write(dir.path().join("nested/deep.yaml"), "domain: d\n").unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(dir.path().join("a.yaml"), dir.path().join("link.yaml"))
                .unwrap();
            std::os::unix::fs::symlink(dir.path().join("gone"), dir.path().join("dangling.yaml"))
                .unwrap();
        }
        let names: Vec<String> = config_files(dir.path())
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        #[cfg(unix)]
        assert_eq!(names, ["a.yaml", "b.yml", "link.yaml"]);
        #[cfg(not(unix))]
        assert_eq!(names, ["a.yaml", "b.yml"]);
    }

    #[test]
    fn a_missing_path_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = config_files(&missing).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}:1:1: config path does not exist", missing.display())
        );
    }
}
