//! The process metrics every Prometheus client library exports under the
//! same names (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! `process_start_time_seconds`, …), read from `/proc` at scrape time.
//! prometheus-client has no process collector of its own; these few lines
//! spare a dependency. The restart alert (a changed
//! `process_start_time_seconds`) and the dashboard's CPU and memory panels
//! read them. Linux only: elsewhere nothing is exported.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Ticks per second of the times in `/proc/<pid>/stat`: `USER_HZ`, which
/// the kernel keeps at 100 in what it shows user space on every
/// architecture.
const USER_HZ: f64 = 100.0;

/// What one scrape read.
#[derive(Debug, Default, PartialEq)]
pub struct Sample {
    pub cpu_seconds: f64,
    pub start_time_seconds: f64,
    pub resident_memory_bytes: f64,
    pub virtual_memory_bytes: f64,
    pub open_fds: f64,
    pub max_fds: Option<f64>,
}

/// Why `/proc` could not be read as expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Read {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("unexpected contents of {0}")]
    Parse(&'static str),
}

fn read(path: &'static str) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::Read { path, source })
}

impl Sample {
    /// Reads this process's figures.
    pub fn read() -> Result<Self, Error> {
        let stat = parse_stat(&read("/proc/self/stat")?).ok_or(Error::Parse("/proc/self/stat"))?;
        let boot = boot_time(&read("/proc/stat")?).ok_or(Error::Parse("/proc/stat"))?;
        let status = read("/proc/self/status")?;
        let kib = |key| status_kib(&status, key).ok_or(Error::Parse("/proc/self/status"));
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .map_err(|source| Error::Read {
                path: "/proc/self/fd",
                source,
            })?
            .count();
        Ok(Self {
            cpu_seconds: (stat.utime + stat.stime) as f64 / USER_HZ,
            start_time_seconds: boot + stat.starttime as f64 / USER_HZ,
            resident_memory_bytes: kib("VmRSS:")? * 1024.0,
            virtual_memory_bytes: kib("VmSize:")? * 1024.0,
            // The directory's own handle, open while it was listed, is not
            // one of the process's.
            open_fds: open_fds.saturating_sub(1) as f64,
            max_fds: read("/proc/self/limits")
                .ok()
                .and_then(|l| max_open_files(&l)),
        })
    }
}

/// The fields of `/proc/<pid>/stat` used here.
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    starttime: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses
/// and may hold spaces and parentheses itself: fields are counted from
/// the last `)`.
fn parse_stat(stat: &str) -> Option<Stat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: field 3 (state) is the first; utime is field 14,
    // stime 15, starttime 22.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        starttime: field(22)?,
    })
}

/// The boot time (`btime`, seconds since the epoch) of `/proc/stat`.
fn boot_time(stat: &str) -> Option<f64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The value of `key` (e.g. `VmRSS:`) in `/proc/<pid>/status`, in KiB.
fn status_kib(status: &str, key: &str) -> Option<f64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The soft limit of open files in `/proc/<pid>/limits` (none when
/// unlimited).
fn max_open_files(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Encodes a [`Sample`] at every scrape.
#[derive(Debug, Clone, Copy)]
pub struct ProcessCollector;

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if !cfg!(target_os = "linux") {
            return Ok(());
        }
        let s = match Sample::read() {
            Ok(s) => s,
            Err(e) => {
                // A scrape without them beats a failed scrape.
                tracing::debug!(error = %e, "process metrics unavailable");
                return Ok(());
            }
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let mut gauges = vec![
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_memory_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_memory_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds,
            ),
        ];
        if let Some(max) = s.max_fds {
            gauges.push((
                "process_max_fds",
                "Maximum number of open file descriptors",
                max,
            ));
        }
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        // A command name with a space and a parenthesis of its own.
        let stat = "4242 (a) b) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 8 0 12345 2000000 500 18446744073709551615";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                utime: 250,
                stime: 50,
                starttime: 12345
            })
        );
        assert_eq!(parse_stat("4242 (truncated) S 1"), None);
        assert_eq!(boot_time("cpu 1 2 3\nbtime 1700000000\n"), Some(1.7e9));
        assert_eq!(
            status_kib("Name:\tx\nVmRSS:\t  1234 kB\n", "VmRSS:"),
            Some(1234.0)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(max_open_files(limits), Some(1024.0));
        assert_eq!(
            max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_described_under_the_conventional_names() {
        let mut r = prometheus_client::registry::Registry::default();
        r.register_collector(Box::new(ProcessCollector));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        let value = |name: &str| -> f64 {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} in\n{text}"));
            line[name.len() + 1..].trim().parse().unwrap()
        };
        assert!(
            text.contains("# TYPE process_cpu_seconds counter"),
            "{text}"
        );
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(value("process_resident_memory_bytes") > 1e6, "{text}");
        assert!(value("process_open_fds") >= 3.0, "stdin, stdout, stderr");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        // This test process started a little while ago, not at boot.
        assert!(
            started <= now + 1.0 && started > now - 3600.0,
            "{started} vs {now}"
        );
    }
}
