//! The browser's processes under our chromedriver, from `/proc`: found to
//! be killed when a [`super::Browser`] is dropped (chromedriver alone
//! would leave Chromium running), and measured for the benchmark.

/// Memory of one Chromium renderer process, from `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendererMemory {
    pub pid: u32,
    /// Resident set size (`VmRSS`): counts pages shared with other Chromium
    /// processes in full.
    pub rss_bytes: u64,
    /// Proportional set size (`Pss` of `smaps_rollup`): shared pages split
    /// among their sharers; `None` when the kernel does not say.
    pub pss_bytes: Option<u64>,
    /// Chromium's own WebUI renderer (`--top-chrome-webui`), not a page's.
    pub webui: bool,
}

/// SIGKILLs every process below `root` (with the `kill` command, as
/// [`crate::process::Process::signal`] does: this crate forbids `unsafe`, so no libc).
pub(super) fn kill_descendants(root: u32) {
    let pids: Vec<String> = descendants(root).iter().map(u32::to_string).collect();
    if !pids.is_empty() {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The processes below `root`, from `/proc` (children before theirs).
pub(super) fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = dir
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid …": comm may hold spaces and parens.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// `field` of a `/proc` file in kB ("VmRSS:   1234 kB"), in bytes.
pub(super) fn kb_field(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line[field.len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kb_fields_are_read_in_bytes() {
        let status = "Name:\tchromium\nVmRSS:\t  123 kB\n";
        assert_eq!(kb_field(status, "VmRSS:"), Some(123 * 1024));
        assert_eq!(kb_field(status, "VmHWM:"), None);
    }

    #[test]
    fn descendants_of_this_process_include_a_child() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let found = descendants(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(found.contains(&child.id()), "{found:?}");
    }
}
