//! The memory limit the sidecar sheds inside, and the figure measured against it.
//!
//! A limit from the cgroup is measured the way the kernel sees the cgroup: its charged memory
//! less the page cache the kernel would reclaim before it kills (`inactive_file`), the same
//! "working set" the kubelet reports. That charge includes kernel memory (sockets, TLS
//! connections' socket buffers on cgroup v2), which the process's own resident set does not
//! show. A limit written in the config has no cgroup behind it, so the resident set is used.

use std::path::{Path, PathBuf};

/// A limit and how to measure use against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub bytes: u64,
    pub source: Source,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `overload.memory_limit`: measured as the process's resident set.
    Config,
    /// A cgroup v2 directory (`memory.max`).
    CgroupV2(PathBuf),
    /// A cgroup v1 memory-controller directory (`memory.limit_in_bytes`).
    CgroupV1(PathBuf),
}

impl Source {
    pub fn as_str(&self) -> &'static str {
        match self {
            Source::Config => "overload.memory_limit",
            Source::CgroupV2(_) => "cgroup v2 memory.max",
            Source::CgroupV1(_) => "cgroup v1 memory.limit_in_bytes",
        }
    }
}

/// cgroup v1 writes "no limit" as the largest page-aligned i64; anything this large is none.
const UNLIMITED: u64 = 1 << 62;

/// The limit in force: the configured one, else this process's cgroup's.
pub fn find(configured: Option<u64>) -> Option<Limit> {
    if let Some(bytes) = configured {
        return Some(Limit {
            bytes,
            source: Source::Config,
        });
    }
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    find_cgroup(&own, Path::new("/sys/fs/cgroup"))
}

/// The cgroup limit for a process whose `/proc/self/cgroup` reads `own`, with the cgroup
/// file systems mounted under `root`.
pub fn find_cgroup(own: &str, root: &Path) -> Option<Limit> {
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            // v2: the unified hierarchy is mounted at `root` itself when it is the only one.
            if root.join("cgroup.controllers").exists() {
                if let Some(l) = v2_limit(root, rel) {
                    return Some(l);
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            let base = root.join("memory");
            // Inside a container without a cgroup namespace the path names the host's
            // hierarchy, but the mount shows the container's own cgroup at its root.
            let dir = [base.join(rel), base.clone()]
                .into_iter()
                .find(|d| d.join("memory.limit_in_bytes").exists())?;
            return v1_limit(&dir);
        }
    }
    None
}

/// The smallest `memory.max` from the process's cgroup up to the root: a parent's limit
/// binds its children.
fn v2_limit(root: &Path, rel: &str) -> Option<Limit> {
    let mut dir = root.join(rel);
    let own = dir.clone();
    let mut least: Option<u64> = None;
    loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("memory.max")) {
            if let Ok(n) = text.trim().parse::<u64>() {
                least = Some(least.map_or(n, |l| l.min(n)));
            }
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            break;
        }
    }
    least.filter(|b| *b < UNLIMITED).map(|bytes| Limit {
        bytes,
        source: Source::CgroupV2(own),
    })
}

fn v1_limit(dir: &Path) -> Option<Limit> {
    // With `use_hierarchy`, the tightest limit of the cgroup and its ancestors.
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let bytes = stat_field(&stat, "hierarchical_memory_limit").or_else(|| {
        std::fs::read_to_string(dir.join("memory.limit_in_bytes"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })?;
    (bytes < UNLIMITED).then(|| Limit {
        bytes,
        source: Source::CgroupV1(dir.to_path_buf()),
    })
}

fn stat_field(stat: &str, name: &str) -> Option<u64> {
    stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == name).then(|| v.trim().parse().ok())?
    })
}

impl Limit {
    /// Bytes in use by the measure that matches the limit; `None` when it cannot be read.
    pub fn used(&self) -> Option<u64> {
        let (dir, usage, inactive) = match &self.source {
            Source::Config => return crate::memory::resident_bytes(),
            Source::CgroupV2(d) => (d, "memory.current", "inactive_file"),
            Source::CgroupV1(d) => (d, "memory.usage_in_bytes", "total_inactive_file"),
        };
        let usage: u64 = std::fs::read_to_string(dir.join(usage))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
        Some(usage.saturating_sub(stat_field(&stat, inactive).unwrap_or(0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    #[test]
    fn v1_takes_the_hierarchical_limit_of_the_processs_cgroup() {
        let root = tree(&[
            (
                "memory/pod/c1/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "memory/pod/c1/memory.stat",
                "cache 0\nhierarchical_memory_limit 67108864\ntotal_inactive_file 4096\n",
            ),
            ("memory/pod/c1/memory.usage_in_bytes", "1052672\n"),
        ]);
        let l = find_cgroup("4:memory:/pod/c1\n1:cpu:/\n", root.path()).unwrap();
        assert_eq!(l.bytes, 64 << 20);
        assert_eq!(
            l.source,
            Source::CgroupV1(root.path().join("memory/pod/c1"))
        );
        assert_eq!(l.used(), Some(1052672 - 4096));
    }

    #[test]
    fn v1_inside_a_container_reads_the_mounts_root_and_unlimited_is_none() {
        let root = tree(&[
            ("memory/memory.limit_in_bytes", "134217728\n"),
            ("memory/memory.stat", "cache 0\n"),
        ]);
        let l = find_cgroup("4:memory,hugetlb:/kubepods/x\n", root.path()).unwrap();
        assert_eq!(l.bytes, 128 << 20);
        let root = tree(&[("memory/memory.limit_in_bytes", "9223372036854771712\n")]);
        assert_eq!(find_cgroup("4:memory:/\n", root.path()), None);
    }

    #[test]
    fn v2_takes_the_least_memory_max_up_the_tree() {
        let root = tree(&[
            ("cgroup.controllers", "memory\n"),
            ("pod/memory.max", "67108864\n"),
            ("pod/c1/memory.max", "max\n"),
            ("pod/c1/memory.current", "2097152\n"),
            ("pod/c1/memory.stat", "anon 1\ninactive_file 1048576\n"),
        ]);
        let l = find_cgroup("0::/pod/c1\n", root.path()).unwrap();
        assert_eq!(l.bytes, 64 << 20);
        assert_eq!(l.used(), Some(1 << 20));
        let root = tree(&[("cgroup.controllers", ""), ("c/memory.max", "max\n")]);
        assert_eq!(find_cgroup("0::/c\n", root.path()), None);
    }

    #[test]
    fn the_configured_limit_wins_and_is_measured_as_the_resident_set() {
        let l = find(Some(1 << 30)).unwrap();
        assert_eq!(l.source, Source::Config);
        assert!(l.used().unwrap() > 0);
    }
}
