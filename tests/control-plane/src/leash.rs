//! Processes that end with whatever started them, however it ends.
//!
//! A test that panics drops its children, and `kill_on_drop` ends them; a test binary that is
//! SIGKILLed (a CI time limit, the OOM killer) runs no destructor, and every server it started
//! would live on. So each child is leashed: the kernel sends it SIGKILL when the thread that
//! started it ends (`PR_SET_PDEATHSIG`), which is when its test ends or its binary dies. It is
//! the *thread* that counts: start a child from the test's own thread or a runtime's worker,
//! never from `spawn_blocking` or a thread that ends before the child should.
//!
//! A process that leashes children, or starts a control plane, while `cargo` is its parent (a
//! test binary of `cargo test`) also follows cargo: once cargo is gone (sent SIGTERM, say, while
//! its test binary runs on), it exits, and everything it started ends with it.
//!
//! Everything the test command starts carries [`RUN`] in its environment (set by
//! `scripts/test`, passed on here even to children started with an empty environment), so the
//! test command can tell afterwards whether anything it started is still running.

use std::ffi::OsStr;
use std::io;
use std::sync::Once;
use std::time::Duration;

/// The environment variable `scripts/test` marks the run's processes with.
pub const RUN: &str = "CRD_BROKER_TEST_RUN";

/// A command whose child ends with the thread that starts it.
pub trait Leash {
    /// Leashes the child: SIGKILL when the starting thread ends, and the run's mark in its
    /// environment. Call it last, after any `env_clear`.
    fn leashed(&mut self) -> &mut Self {
        self.leashed_with(libc::SIGKILL)
    }

    /// [`Leash::leashed`], with `signal` in place of SIGKILL (for a child that cleans up
    /// after itself on SIGTERM).
    fn leashed_with(&mut self, signal: libc::c_int) -> &mut Self;
}

impl Leash for std::process::Command {
    #[allow(unsafe_code)]
    fn leashed_with(&mut self, signal: libc::c_int) -> &mut Self {
        use std::os::unix::process::CommandExt;
        follow_cargo();
        if let Some(run) = std::env::var_os(RUN) {
            self.env(RUN, run);
        }
        let on_parent_death = on_parent_death(signal);
        // SAFETY: the closure makes only async-signal-safe system calls.
        unsafe { self.pre_exec(on_parent_death) }
    }
}

impl Leash for tokio::process::Command {
    fn leashed_with(&mut self, signal: libc::c_int) -> &mut Self {
        self.as_std_mut().leashed_with(signal);
        self
    }
}

/// `program` run by a keeper (`scripts/lib/keep --tree`), for a child that starts children of
/// its own (a shell, `cargo run` and the binary it builds): the keeper ends it and everything it
/// started (SIGTERM, then SIGKILL 5 s later) when it is sent SIGTERM, when the thread that
/// starts it ends, and when this process ends, however it ends. The keeper exits once the
/// program has. Add the program's arguments; it is leashed already (keep the run's mark if its
/// environment is changed).
pub fn tree(program: impl AsRef<OsStr>) -> std::process::Command {
    let mut keep = std::process::Command::new(keeper());
    keep.args(["--owner", &std::process::id().to_string(), "--tree", "--"])
        .arg(program)
        .leashed_with(libc::SIGTERM);
    keep
}

/// The words of `scripts/lib/keep --owner THIS-PROCESS --tree -- command…`, quoted for a
/// shell: for a program that runs a command line (tmux's sessions), ended with its tree should
/// this process end first.
pub fn tree_line(command: &[&str]) -> String {
    let owner = std::process::id().to_string();
    let keeper = keeper();
    let words = [
        keeper.to_str().expect("a UTF-8 path"),
        "--owner",
        &owner,
        "--tree",
        "--",
    ];
    words
        .iter()
        .chain(command)
        .map(|word| format!("'{}'", word.replace('\'', r"'\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

fn keeper() -> std::path::PathBuf {
    crate::root().join("scripts/lib/keep")
}

/// What a child runs between fork and exec: `signal` once its parent thread ends, and at once
/// if the parent has already gone (the request would never fire).
#[allow(unsafe_code)]
fn on_parent_death(signal: libc::c_int) -> impl FnMut() -> io::Result<()> + Send + Sync {
    let parent = std::process::id() as libc::pid_t;
    move || {
        // SAFETY: prctl, getppid and raise are system calls, safe between fork and exec.
        unsafe {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::raise(signal);
            }
        }
        Ok(())
    }
}

/// Runs `stop` as this process exits normally (`exit`, a return from `main`): what a static
/// holds is never dropped.
#[allow(unsafe_code)]
pub(crate) fn at_exit(stop: extern "C" fn()) {
    // SAFETY: registers a plain function with the C library, to run once at exit.
    unsafe { libc::atexit(stop) };
}

/// If this process's parent is cargo (`cargo test`, `cargo nextest`, `cargo run`), exits once
/// cargo is gone, looked at every 200 ms from a thread of its own; started once.
pub fn follow_cargo() {
    static FOLLOWING: Once = Once::new();
    FOLLOWING.call_once(|| {
        let parent = std::os::unix::process::parent_id();
        let name = std::fs::read_to_string(format!("/proc/{parent}/comm")).unwrap_or_default();
        if !name.starts_with("cargo") {
            return;
        }
        let _ = std::thread::Builder::new()
            .name("follow-cargo".into())
            .spawn(move || {
                while std::os::unix::process::parent_id() == parent {
                    std::thread::sleep(Duration::from_millis(200));
                }
                eprintln!("cargo (pid {parent}) has ended: so does this test binary");
                // As SIGTERM's default would: 128 + 15.
                std::process::exit(143);
            });
    });
}

/// The processes that carry `run` as their mark ([`RUN`]) and still run (zombies aside), this
/// one aside: each pid and command line.
pub fn marked(run: &str) -> Vec<(u32, String)> {
    let mark = format!("{RUN}={run}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<(u32, String)> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id())
        .filter(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            environ.split(|b| *b == 0).any(|var| var == mark.as_bytes())
        })
        .filter(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            status
                .lines()
                .any(|l| l.starts_with("State:") && !l.contains("zombie"))
        })
        .map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let words: Vec<String> = cmdline
                .split(|b| *b == 0)
                .filter(|w| !w.is_empty())
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect();
            (pid, words.join(" "))
        })
        .collect();
    found.sort();
    found
}
