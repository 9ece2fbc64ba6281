//! Measuring: a lock-free latency histogram, and a process's resident memory and CPU time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Buckets per power of two: about 1.1 % resolution.
const SUB: u32 = 64;
/// Nanoseconds up to 2^40 (about 18 minutes).
const BUCKETS: usize = (41 * SUB) as usize;

/// A histogram of durations that many tasks record into at once.
pub struct Histogram {
    counts: Vec<AtomicU64>,
    max: AtomicU64,
    total: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            max: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }
}

fn bucket(ns: u64) -> usize {
    if ns < SUB as u64 {
        return ns as usize;
    }
    let log = 63 - ns.leading_zeros();
    let shift = log - SUB.trailing_zeros();
    let sub = (ns >> shift) as u32 - SUB;
    ((log - SUB.trailing_zeros() + 1) * SUB + sub).min(BUCKETS as u32 - 1) as usize
}

fn lower_bound(b: usize) -> u64 {
    let b = b as u32;
    if b < SUB {
        return b as u64;
    }
    let octave = b / SUB - 1;
    let sub = (b % SUB) as u64;
    (SUB as u64 + sub) << octave
}

impl Histogram {
    /// Records one duration.
    pub fn record(&self, d: Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        self.counts[bucket(ns)].fetch_add(1, Ordering::Relaxed);
        self.max.fetch_max(ns, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// How many were recorded.
    pub fn count(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// The `q` quantile (0..=1), to about 1 %.
    pub fn quantile(&self, q: f64) -> Duration {
        let total = self.count();
        if total == 0 {
            return Duration::ZERO;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (b, c) in self.counts.iter().enumerate() {
            seen += c.load(Ordering::Relaxed);
            if seen >= rank {
                return Duration::from_nanos(lower_bound(b)).min(self.max());
            }
        }
        self.max()
    }

    /// The largest recorded.
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max.load(Ordering::Relaxed))
    }

    /// p50, p99 and max, in milliseconds.
    pub fn summary(&self) -> Summary {
        let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
        Summary {
            count: self.count(),
            p50_ms: ms(self.quantile(0.50)),
            p99_ms: ms(self.quantile(0.99)),
            max_ms: ms(self.max()),
        }
    }

    /// (latency in ms, cumulative fraction) points for a plot.
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let total = self.count() as f64;
        let mut seen = 0u64;
        let mut points = Vec::new();
        for (b, c) in self.counts.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n == 0 {
                continue;
            }
            seen += n;
            points.push((lower_bound(b) as f64 / 1e6, seen as f64 / total));
        }
        points
    }
}

/// A latency distribution, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct Summary {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

/// Resident memory of a process, in bytes (`VmRSS`).
pub fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// CPU time (user + system) a process has used.
pub fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may contain spaces.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of stat; 12 and 13 after the state field.
    let total = ticks(11) + ticks(12);
    // /proc counts in USER_HZ, which Linux fixes at 100 for user space.
    Duration::from_millis(total * 10)
}

/// Raises this process's open-file limit to its hard limit; children inherit it.
pub fn raise_fd_limit() -> u64 {
    rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_two_percent() {
        let h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).as_micros() as f64;
        let p99 = h.quantile(0.99).as_micros() as f64;
        assert!((p50 - 5000.0).abs() / 5000.0 < 0.02, "{p50}");
        assert!((p99 - 9900.0).abs() / 9900.0 < 0.02, "{p99}");
        assert_eq!(h.max(), Duration::from_micros(10_000));
        assert_eq!(h.count(), 10_000);
    }

    #[test]
    fn buckets_are_monotonic() {
        let mut last = 0;
        for ns in (0..1_000_000u64).step_by(37) {
            let b = bucket(ns);
            assert!(b >= last);
            assert!(
                lower_bound(b) <= ns,
                "{ns} in bucket {b} starting {}",
                lower_bound(b)
            );
            last = b;
        }
    }

    #[test]
    fn this_process_has_memory_and_cpu() {
        assert!(rss(std::process::id()) > 0);
        let _ = cpu(std::process::id());
    }
}

/// Which end of a TCP socket a port is matched against.
#[derive(Debug, Clone, Copy)]
pub enum End {
    Local,
    Remote,
}

/// Process `pid`'s TCP sockets (IPv4 and IPv6, from its own file descriptors and the kernel's
/// tables) in `state` (`"01"` established, `"0A"` listening) whose `end` is on `port`.
pub fn sockets(pid: u32, state: &str, end: End, port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let port = format!("{port:04X}");
    let column = match end {
        End::Local => 1,
        End::Remote => 2,
    };
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(format!("/proc/{pid}/net/{t}")).ok())
        .map(|text| {
            text.lines()
                .skip(1)
                .filter(|line| {
                    // local and remote addresses are HEXIP:HEXPORT; the inode is the tenth field.
                    let f: Vec<&str> = line.split_whitespace().collect();
                    f.len() > 9
                        && f[column].rsplit(':').next() == Some(port.as_str())
                        && f[3] == state
                        && inodes.contains(f[9])
                })
                .count()
        })
        .sum()
}
