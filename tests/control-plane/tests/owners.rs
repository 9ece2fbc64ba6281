//! Nothing outlives its owner: a control plane, a leashed child and a process tree end with the
//! process that started them, however it ends — it exits without stopping them, it is SIGKILLed,
//! or the `cargo test` that started it is sent SIGTERM or SIGINT.
//!
//! Each case runs helper processes (this binary again, an ignored test each) marked with a run
//! of their own ([`leash::RUN`]); afterwards no process carrying that mark may be left.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use control_plane::leash::{self, Leash};

/// How long what a helper started may take to end once the helper has: the keepers look for
/// their owner every second, and give a component 5 s to end on SIGTERM.
const ENDS_WITHIN: Duration = Duration::from_secs(10);

/// A run mark of this test's own.
fn run(name: &str) -> String {
    format!("{name}-{}-{:?}", std::process::id(), Instant::now())
}

/// This binary, to run the ignored helper `test` marked with `run`; it reports on stdout and
/// ends when its stdin closes.
fn helper(test: &str, run: &str) -> Command {
    let mut helper = Command::new(std::env::current_exe().unwrap());
    helper
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(leash::RUN, run)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    helper
}

/// The next line of `child`'s stdout that starts with `prefix`, without it (libtest may print
/// the test's name first, on the same line).
fn report(child: &mut Child, prefix: &str) -> String {
    let mut lines = BufReader::new(child.stdout.as_mut().unwrap()).lines();
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("the helper ended before it said {prefix:?}"))
            .unwrap();
        if let Some((_, rest)) = line.split_once(prefix) {
            return rest.trim().to_string();
        }
    }
}

/// Waits until nothing marked `run` runs; fails after [`ENDS_WITHIN`] naming what is left.
fn nothing_left(run: &str, what: &str) {
    let deadline = Instant::now() + ENDS_WITHIN;
    loop {
        let left = leash::marked(run);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still running after {ENDS_WITHIN:?}:\n{}",
            left.iter()
                .map(|(pid, cmd)| format!("  {pid} {cmd}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Two test binaries, one after the other, each starting a plane and exiting without stopping
/// it: the second starts as the first exits, and removes the first's directory while the
/// first's plane may still run. Before the keepers, the first's watcher found its pid files
/// gone and stopped nothing: its kube-apiserver ran on for good.
#[test]
fn planes_of_processes_that_exit_back_to_back_end_with_them() {
    let run = run("back-to-back");
    let mut first = helper("start_a_plane_and_exit", &run).spawn().unwrap();
    let first_dir = report(&mut first, "plane in ");
    drop(first.stdin.take());
    assert!(first.wait().unwrap().success());
    // At once, as cargo starts the next test binary.
    let mut second = helper("start_a_plane_and_exit", &run).spawn().unwrap();
    let second_dir = report(&mut second, "plane in ");
    assert!(
        !std::path::Path::new(&first_dir).exists(),
        "the second removed the first's directory ({first_dir})"
    );
    let running = leash::marked(&run);
    assert!(
        running.iter().any(|(_, cmd)| cmd.contains(&second_dir)),
        "the second's plane runs: {running:?}"
    );
    drop(second.stdin.take());
    assert!(second.wait().unwrap().success());
    nothing_left(&run, "two planes whose owners exited");
}

/// A test binary SIGKILLed (a CI time limit, the OOM killer) runs no destructor: its plane, its
/// leashed children and a process tree it started end all the same.
#[test]
fn a_killed_test_binary_leaves_nothing_running() {
    let run = run("killed");
    let mut binary = helper("start_everything_and_wait", &run).spawn().unwrap();
    let started: usize = report(&mut binary, "started ").parse().unwrap();
    let running = leash::marked(&run);
    assert!(
        running.len() > started,
        "the helper and the {started} processes it reports run: {running:?}"
    );
    binary.kill().unwrap();
    binary.wait().unwrap();
    nothing_left(&run, "a SIGKILLed test binary's processes");
}

/// `cargo test` sent SIGTERM or SIGINT ends its test binary, and so everything the binary
/// started. A shell stands in for cargo here, under cargo's name.
#[test]
fn a_test_binary_ends_with_the_cargo_that_runs_it() {
    let dir = std::env::temp_dir().join(format!("crd-broker-owners-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cargo = dir.join("cargo");
    let _ = std::fs::remove_file(&cargo);
    std::os::unix::fs::symlink("/bin/sh", &cargo).unwrap();
    for signal in ["TERM", "INT"] {
        let run = run(&format!("cargo-{signal}"));
        let exe = std::env::current_exe().unwrap();
        let test = "start_children_and_wait";
        // The binary in the background: its SIGINT ignored, as a shell does for what it starts
        // in the background, so that only its following cargo can end it.
        let mut cargo = Command::new(&cargo);
        cargo
            .arg("-c")
            .arg(r#""$0" --exact "$1" --ignored --nocapture & wait"#)
            .arg(&exe)
            .arg(test)
            .env(leash::RUN, &run)
            .stdout(Stdio::piped());
        // A cargo takes the signal whatever this binary was started with: one started in the
        // background by a non-interactive shell (a CI job) inherits SIGINT ignored, and so
        // would the stand-in, which would then wait for its child's ten minutes.
        #[allow(unsafe_code)]
        // SAFETY: signal(2) is async-signal-safe, and nothing else runs between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            cargo.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                libc::signal(libc::SIGTERM, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut cargo = cargo.spawn().unwrap();
        report(&mut cargo, "started ");
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &cargo.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        cargo.wait().unwrap();
        nothing_left(&run, &format!("a test binary whose cargo got SIG{signal}"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Starts a plane, says where, and exits when stdin closes without stopping it, as a test
/// binary whose plane is a static does.
#[test]
#[ignore = "a helper process of planes_of_processes_that_exit_back_to_back_end_with_them"]
fn start_a_plane_and_exit() {
    let plane = control_plane::start("127.0.0.1");
    println!("plane in {}", plane.dir.display());
    std::io::stdin().read_to_end(&mut Vec::new()).unwrap();
    std::mem::forget(plane);
    std::process::exit(0);
}

/// Starts what a test binary starts, says how many, and waits to be killed.
#[test]
#[ignore = "a helper process of a_killed_test_binary_leaves_nothing_running"]
fn start_everything_and_wait() {
    let plane = control_plane::start("127.0.0.1");
    let children = children();
    println!("started {}", children.len() + 4);
    std::io::stdin().read_to_end(&mut Vec::new()).unwrap();
    drop((plane, children));
}

/// Starts leashed children and a tree, says so, and waits.
#[test]
#[ignore = "a helper process of a_test_binary_ends_with_the_cargo_that_runs_it"]
fn start_children_and_wait() {
    let children = children();
    println!("started {}", children.len());
    std::thread::sleep(Duration::from_secs(600));
    drop(children);
}

/// A leashed child, and a keeper of a tree: a shell and two children of the shell's.
fn children() -> Vec<Child> {
    let sleeper = Command::new("sleep")
        .arg("600")
        .stdout(Stdio::null())
        .leashed()
        .spawn()
        .unwrap();
    let tree = leash::tree("sh")
        .args(["-c", "sleep 600 & sleep 600"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    vec![sleeper, tree]
}
