//! Free loopback ports for the processes the tests and the harness start, each handed to one
//! process at a time across the whole machine.
//!
//! A port is found free by binding it and letting it go; the process it is for binds it a moment
//! later. In between, any process may take it. Outgoing connections cannot, as the ports come from
//! below the kernel's ephemeral range (32768–60999). Another process handing out ports the same
//! way could: each walks the range from an offset of its own id, so two whose ids differ by a
//! multiple of 7 (a test binary and the harness it starts, a clean clone's run beside one in the
//! working tree) walk the same ports, and both find one free before either's server binds it.
//! One server then fails to bind, and the other's test talks to a server that is not its own —
//! reset once that server's test ends.
//!
//! So a port handed out is also reserved: an exclusive lock (`flock`) on a file named by the
//! port, in a directory every process shares (`$TMPDIR/crd-broker-ports`), held for as long as
//! the process that took it lives and released by the kernel when it ends, however it ends.
//! `scripts/control-plane` reserves etcd's and kube-apiserver's ports in the same directory.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// The first port handed out, and how many there are.
const LOW: u32 = 20_000;
const SPAN: u32 = 12_000;

/// A port no other process holds or has reserved, that a process a test or the harness starts
/// may bind on 127.0.0.1. It stays reserved as long as this process runs.
pub fn free_port() -> u16 {
    // Each process starts at its own offset and walks on from there.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    walk(std::process::id() % SPAN, &NEXT)
}

/// The reservations this process holds: closing a file would release its lock.
static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// The next port from `start`, by steps of 7 (prime to the span, so the walk reaches every
/// port), that can be reserved and bound.
fn walk(start: u32, next: &AtomicU32) -> u16 {
    let dir = reservations();
    for _ in 0..SPAN {
        let step = next.fetch_add(1, Ordering::Relaxed) % SPAN;
        let port = (LOW + (start + step * 7) % SPAN) as u16;
        let Some(reservation) = reserve(&dir, port) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            HELD.lock().unwrap().push(reservation);
            return port;
        }
    }
    panic!(
        "no free port in {LOW}-{} on 127.0.0.1: every one is bound or reserved in {}",
        LOW + SPAN - 1,
        dir.display()
    )
}

fn reservations() -> PathBuf {
    let dir = std::env::temp_dir().join("crd-broker-ports");
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("creating the port reservations {}: {e}", dir.display()));
    dir
}

/// `port`'s reservation, unless another process (or this one) holds it.
fn reserve(dir: &Path, port: u16) -> Option<File> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(port.to_string()))
        .ok()?;
    file.try_lock().ok()?;
    Some(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};

    /// Where the helper processes start their walk (the same for all of them).
    const START: &str = "CONTROL_PLANE_TEST_PORT_WALK_START";
    const PROCESSES: usize = 4;
    const PER_PROCESS: usize = 50;

    /// Processes that walk the same ports at once, as two whose ids differ by a multiple of 7
    /// do, are handed different ones. (Without the reservations each would be handed the same
    /// 50.)
    #[test]
    fn processes_walking_the_same_ports_at_once_are_handed_different_ones() {
        let mut helpers: Vec<_> = (0..PROCESSES)
            .map(|_| {
                Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "ports::tests::hand_out_ports_and_hold_them"])
                    .args(["--ignored", "--nocapture", "--test-threads", "1"])
                    .env(START, "4321")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("a helper process starts")
            })
            .collect();
        // Every helper holds its ports until all have been read: only then is its stdin closed.
        let mut ports = Vec::new();
        for helper in &mut helpers {
            let lines = BufReader::new(helper.stdout.as_mut().unwrap()).lines();
            let mine: Vec<u16> = lines
                .map(Result::unwrap)
                .take_while(|line| line != "done")
                // libtest writes the test's name before its first line, on the same line.
                .filter_map(|line| line.rsplit_once("port ")?.1.parse().ok())
                .collect();
            assert_eq!(mine.len(), PER_PROCESS, "each helper reports its ports");
            ports.extend(mine);
        }
        for mut helper in helpers {
            drop(helper.stdin.take());
            assert!(helper.wait().unwrap().success());
        }
        let handed = ports.len();
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), handed, "no port was handed to two processes");
    }

    #[test]
    #[ignore = "a helper process of the test above, which starts it"]
    fn hand_out_ports_and_hold_them() {
        let start: u32 = std::env::var(START)
            .expect("started by processes_walking_the_same_ports_at_once…")
            .parse()
            .unwrap();
        let next = AtomicU32::new(0);
        for _ in 0..PER_PROCESS {
            println!("port {}", walk(start, &next));
        }
        println!("done");
        std::io::stdin().read_to_end(&mut Vec::new()).unwrap();
    }
}
