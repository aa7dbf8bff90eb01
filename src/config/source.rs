//! Which files make up the config: one file, or the files of a directory.
//!
//! By default only `*.yaml`/`*.yml` directly inside the directory are read and dotfiles are
//! skipped, so Kubernetes ConfigMap bookkeeping (`..data`) and editor leftovers never load as
//! rules. The reference's runtime layout reads every file below the directory instead (and
//! dotfiles unless told not to); that mode exists for drop-in compatibility. Symlinks are
//! followed, since ConfigMap files are symlinks.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::yaml::Pos;
use super::{ConfigError, Files};

/// Most files one config may have: with what each may hold (`MAX_FILE_BYTES`) and what all
/// may hold together, what a directory can make the process read is bounded.
const MAX_FILES: usize = 10_000;

/// The files to load, sorted by path.
pub fn config_files(path: &Path, which: Files) -> Result<Vec<PathBuf>, ConfigError> {
    let error = |message: String| ConfigError::at(&path.display().to_string(), Pos::START, message);
    let metadata = fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => error("config path does not exist".to_owned()),
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
    let mut walk = Walk::default();
    walk.collect(path, which).map_err(error)?;
    walk.files.sort();
    Ok(walk.files)
}

#[derive(Default)]
struct Walk {
    files: Vec<PathBuf>,
    /// Directories read, by their canonical path. Followed symlinks can lead back to a
    /// directory already read (a link to a parent): each is read once, or two such links
    /// would make the paths to walk double at every level.
    read: HashSet<PathBuf>,
}

impl Walk {
    fn collect(&mut self, dir: &Path, which: Files) -> Result<(), String> {
        let listing = |e: std::io::Error| format!("cannot list config directory: {e}");
        if !self.read.insert(fs::canonicalize(dir).map_err(listing)?) {
            return Ok(());
        }
        for entry in fs::read_dir(dir).map_err(listing)? {
            let entry = entry.map_err(listing)?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let dotfile = name.starts_with('.');
            // fs::metadata follows symlinks; a dangling one is skipped like any non-file.
            let Ok(metadata) = fs::metadata(entry.path()) else {
                continue;
            };
            let wanted = match which {
                Files::Yaml => {
                    let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
                    is_yaml && !dotfile && metadata.is_file()
                }
                Files::Runtime { ignore_dotfiles } if dotfile && ignore_dotfiles => false,
                Files::Runtime { .. } if metadata.is_dir() => {
                    self.collect(&entry.path(), which)?;
                    false
                }
                Files::Runtime { .. } => metadata.is_file(),
            };
            if wanted {
                if self.files.len() == MAX_FILES {
                    return Err(format!("more than {MAX_FILES} config files"));
                }
                self.files.push(entry.path());
            }
        }
        Ok(())
    }
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

    #[cfg(unix)]
    #[test]
    fn links_back_to_a_directory_read_it_once() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("config");
        fs::create_dir_all(root.join("nested")).unwrap();
        fs::write(root.join("a.yaml"), "").unwrap();
        fs::write(root.join("nested/b.yaml"), "").unwrap();
        // Two links to the parent: every level of the walk would double its paths.
        symlink("..", root.join("up")).unwrap();
        symlink("..", root.join("nested/up")).unwrap();
        symlink("../nested", root.join("nested/again")).unwrap();
        // On a thread: a walk that follows the links would not end.
        let (tx, rx) = std::sync::mpsc::channel();
        let walked = root.clone();
        std::thread::spawn(move || {
            let which = Files::Runtime {
                ignore_dotfiles: false,
            };
            let _ = tx.send(config_files(&walked, which));
        });
        let files = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the walk ends")
            .unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        assert_eq!(names, ["a.yaml", "nested/b.yaml"]);
    }

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
