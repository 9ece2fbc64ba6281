//! The process's families: the standard process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, …, as the Prometheus client libraries
//! name them), read from `/proc` on each scrape, and the tasks alive on the async runtime.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

/// The process's families.
#[derive(Default)]
pub struct ProcessMetrics {
    /// Tasks alive on the async runtime (set at each scrape): a number that grows without
    /// bound is a leak.
    pub runtime_tasks: Gauge,
}

impl ProcessMetrics {
    /// Registers `crd_broker_runtime_tasks` and the `process_` collector.
    pub(super) fn register(&self, root: &mut Registry) {
        root.sub_registry_with_prefix("crd_broker").register(
            "runtime_tasks",
            "Tasks alive on the async runtime",
            self.runtime_tasks.clone(),
        );
        root.register_collector(Box::new(Process));
    }

    /// Reads what is sampled at a scrape rather than kept: the runtime's tasks.
    pub(super) fn sample(&self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.runtime_tasks
                .set(runtime.metrics().num_alive_tasks() as i64);
        }
    }
}

/// Reads `/proc/self` when scraped. Off Linux (no `/proc`), it reports nothing.
#[derive(Debug, Default)]
pub struct Process;

/// What `/proc/self` says.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    threads: i64,
    start_time_seconds: f64,
    open_fds: i64,
    max_fds: i64,
}

/// The unit of `/proc`'s CPU times: `USER_HZ`, which Linux fixes at 100 for userspace on every
/// architecture.
const USER_HZ: f64 = 100.0;

/// From `/proc/self/stat`'s fields after the command name (which may hold spaces and
/// parentheses, so it is cut at the last `)`): CPU seconds and the start in ticks since boot.
fn parse_stat(stat: &str) -> Option<(f64, f64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name, field 3 (state) is fields[0]: utime is field 14, stime 15, starttime 22.
    let at = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<f64>().ok());
    Some(((at(14)? + at(15)?) / USER_HZ, at(22)?))
}

/// A `Name:   value [kB]` line of `/proc/self/status`, in bytes for `kB`.
fn status_field(status: &str, name: &str) -> Option<i64> {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?;
    let mut words = line.split_whitespace();
    let value: i64 = words.next()?.parse().ok()?;
    Some(if words.next() == Some("kB") {
        value * 1024
    } else {
        value
    })
}

fn sample() -> Option<Sample> {
    let boot: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let (cpu_seconds, start_ticks) = parse_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as i64;
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .unwrap_or(-1);
    Some(Sample {
        cpu_seconds,
        resident_bytes: status_field(&status, "VmRSS")?,
        virtual_bytes: status_field(&status, "VmSize")?,
        threads: status_field(&status, "Threads")?,
        start_time_seconds: boot + start_ticks / USER_HZ,
        open_fds,
        max_fds,
    })
}

fn gauge<N: prometheus_client::encoding::EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: N,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = sample() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let e = &mut encoder;
        gauge(
            e,
            "process_resident_memory_bytes",
            "Resident memory, in bytes",
            s.resident_bytes,
        )?;
        gauge(
            e,
            "process_virtual_memory_bytes",
            "Virtual memory, in bytes",
            s.virtual_bytes,
        )?;
        gauge(e, "process_threads", "OS threads", s.threads)?;
        gauge(e, "process_open_fds", "Open file descriptors", s.open_fds)?;
        gauge(
            e,
            "process_max_fds",
            "The open file descriptor limit",
            s.max_fds,
        )?;
        gauge(
            e,
            "process_start_time_seconds",
            "Start time since the Unix epoch, in seconds",
            s.start_time_seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_read_past_names_with_spaces_and_parentheses() {
        let stat =
            "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 123456 789";
        assert_eq!(parse_stat(stat), Some((3.0, 1000.0)));
        assert_eq!(parse_stat("garbage"), None);
        let status = "Name:\tcrd-broker\nVmSize:\t  2048 kB\nVmRSS:\t   512 kB\nThreads:\t7\n";
        assert_eq!(status_field(status, "VmRSS"), Some(512 * 1024));
        assert_eq!(status_field(status, "VmSize"), Some(2048 * 1024));
        assert_eq!(status_field(status, "Threads"), Some(7));
        assert_eq!(status_field(status, "VmSwap"), None);
    }

    #[test]
    fn this_process_is_sampled() {
        let s = sample().expect("/proc is readable");
        assert!(
            s.resident_bytes > 0 && s.threads >= 1 && s.open_fds >= 3,
            "{s:?}"
        );
        assert!(s.max_fds >= s.open_fds, "{s:?}");
    }
}
