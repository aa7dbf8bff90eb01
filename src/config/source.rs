//! Which files make up the config: one file, or the files of a directory.
//!
//! By default only `*.yaml`/`*.yml` directly inside the directory are read and dotfiles are
//! skipped, so Kubernetes ConfigMap bookkeeping (`..data`) and editor leftovers never load as
//! rules. The reference's runtime layout reads every file below the directory instead (and
//! dotfiles unless told not to); that mode exists for drop-in compatibility. Symlinks are
//! followed, since ConfigMap files are symlinks.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::yaml::Pos;
use super::{ConfigError, Files};

/// The files to load, sorted by path.
pub fn config_files(path: &Path, which: Files) -> Result<Vec<PathBuf>, ConfigError> {
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
    let mut files = Vec::new();
    collect(path, which, &mut files)
        .map_err(|e| error(format!("cannot list config directory: {e}")))?;
    files.sort();
    Ok(files)
}

fn collect(dir: &Path, which: Files, files: &mut Vec<PathBuf>) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let dotfile = name.starts_with('.');
        // fs::metadata follows symlinks; a dangling one is skipped like any non-file.
        let Ok(metadata) = fs::metadata(entry.path()) else {
            continue;
        };
        match which {
            Files::Yaml => {
                let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
                if is_yaml && !dotfile && metadata.is_file() {
                    files.push(entry.path());
                }
            }
            Files::Runtime { ignore_dotfiles } if dotfile && ignore_dotfiles => {}
            Files::Runtime { .. } if metadata.is_dir() => collect(&entry.path(), which, files)?,
            Files::Runtime { .. } if metadata.is_file() => files.push(entry.path()),
            Files::Runtime { .. } => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_itself() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.conf");
        fs::write(&file, "domain: d\n").unwrap();
        assert_eq!(config_files(&file, Files::Yaml).unwrap(), [file]);
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
        let names: Vec<String> = config_files(dir.path(), Files::Yaml)
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
        let err = config_files(&missing, Files::Yaml).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}:1:1: config path does not exist", missing.display())
        );
    }
}

#[cfg(test)]
mod runtime_tests {
    use super::*;

    #[test]
    fn the_runtime_layout_reads_every_file_at_any_depth() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("nested/deeper")).unwrap();
        fs::create_dir_all(root.join("..data")).unwrap();
        for file in [
            "a.conf",
            "nested/b",
            "nested/deeper/c.yaml",
            ".hidden",
            "..data/d",
        ] {
            fs::write(root.join(file), "").unwrap();
        }
        let names = |which| -> Vec<String> {
            config_files(root, which)
                .unwrap()
                .iter()
                .map(|p| p.strip_prefix(root).unwrap().display().to_string())
                .collect()
        };
        assert_eq!(
            names(Files::Runtime {
                ignore_dotfiles: false
            }),
            [
                "..data/d",
                ".hidden",
                "a.conf",
                "nested/b",
                "nested/deeper/c.yaml"
            ]
        );
        assert_eq!(
            names(Files::Runtime {
                ignore_dotfiles: true
            }),
            ["a.conf", "nested/b", "nested/deeper/c.yaml"]
        );
        assert!(names(Files::Yaml).is_empty(), "no *.yaml directly inside");
    }
}
